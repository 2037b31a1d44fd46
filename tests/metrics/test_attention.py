"""Attention statistics from queries and keys against the float64 materialised softmax."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics import attention
from tmetrics_core.metrics.attention import head_summary, query_parts, rescaled
from tests.metrics.attention_reference import reference_table, structured_visible

B, HQ, HKV, T, D = 2, 4, 2, 13, 8


def _qk(seed: int, *, scale: float = 1.0, tk: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, HQ, T, D, generator=g) * scale, torch.randn(B, HKV, tk, D, generator=g) * scale
    return q.bfloat16(), k.bfloat16()  # as trained: scores of bf16 inputs are exact in float64


def _table(parts: attention.QueryParts) -> dict[str, torch.Tensor]:
    top, sums = head_summary(parts.m, parts.s, parts.t, parts.u, parts.counted)
    n = sums[3]
    return {"max": top, "entropy": sums[0] / n, "lse": sums[1] / n, "sink": sums[2] / n, "queries": n}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert torch.equal(got["max"], want["max"]), (got["max"], want["max"])  # the maximum is exact
    assert torch.equal(got["queries"], want["queries"])
    for name in ("entropy", "lse", "sink"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-12, msg=name)


@pytest.fixture(params=[False, True], ids=["one-block", "many-blocks"])
def blocks(request, monkeypatch):
    if request.param:  # blocks of a few keys and queries: the online merge runs across them
        monkeypatch.setattr(attention, "_BLOCK_ELEMENTS", HQ * 3 * 2)
    return request.param


def _lengths_mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[1, 9:] = False  # right padding
    return mask


def _segments() -> torch.Tensor:
    return torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [7] * 3 + [3] * 10])


CASES = {
    "full": {},
    "causal": {"causal": True},
    "padding": {"causal": True, "token_mask": _lengths_mask()},
    "window": {"causal": True, "window": 4},
    "packed": {"causal": True, "segment_ids": _segments()},
    "packed-padded-window": {"causal": True, "window": 3, "segment_ids": _segments(), "token_mask": _lengths_mask()},
}


@pytest.mark.parametrize("logit_scale", [1.0, 100.0], ids=["unit", "x100"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_structured_masks_match_materialised_softmax(case, logit_scale, blocks):
    q, k = _qk(1, scale=math.sqrt(logit_scale))
    fields = CASES[case]
    spec = AttentionSpec(**fields)
    visible, sink, counted = structured_visible(B, T, T, causal=fields.get("causal", False),
                                                window=fields.get("window"), token_mask=fields.get("token_mask"),
                                                segments=fields.get("segment_ids"))
    want = reference_table(q, k, visible, sink, scale=D ** -0.5, counted=counted)
    _assert_close(_table(query_parts(q, k, spec)), want)


def test_softcap_and_scale(blocks):
    q, k = _qk(2, scale=10.0)
    spec = AttentionSpec(causal=True, softcap=30.0, scale=0.3)
    visible, sink, counted = structured_visible(B, T, T, causal=True)
    want = reference_table(q, k, visible, sink, scale=0.3, softcap=30.0, counted=counted)
    _assert_close(_table(query_parts(q, k, spec)), want)


def test_explicit_masks_bool_and_additive(blocks):
    q, k = _qk(3, scale=3.0)
    visible, _, _ = structured_visible(B, T, T, causal=True, token_mask=_lengths_mask())
    per_head = visible.expand(B, HQ, T, T).clone()
    per_head[:, 1, :, 0] = False  # a head-specific mask: head 1 never sees key 0
    first = per_head.to(torch.uint8).argmax(-1)
    got = _table(query_parts(q, k, AttentionSpec(mask=per_head)))
    # Reference per head (the sink key of an explicit mask is each query's first visible key).
    for h in range(HQ):
        sink = torch.where(per_head[:, h].any(-1), first[:, h], -1)
        want = reference_table(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], per_head[:, h:h + 1], sink, scale=D ** -0.5)
        _assert_close({n: v[h:h + 1] for n, v in got.items()}, want)
    additive = torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(~visible, -math.inf)
    sink = torch.where(visible[:, 0].any(-1), visible[:, 0].to(torch.uint8).argmax(-1), -1)
    _assert_close(_table(query_parts(q, k, AttentionSpec(mask=additive))),
                  reference_table(q, k, visible, sink, scale=D ** -0.5))


def test_key_split_merges_exactly_over_max_then_sum(blocks):
    q, k = _qk(4, scale=10.0)
    mask = _lengths_mask()
    whole = _table(query_parts(q, k, AttentionSpec(causal=True, token_mask=mask, segment_ids=_segments())))
    halves = []
    for lo, hi in ((0, 6), (6, T)):
        spec = AttentionSpec(causal=True, token_mask=mask, segment_ids=_segments(), k_positions=torch.arange(lo, hi))
        halves.append(query_parts(q, k[:, :, lo:hi], spec))
    top = torch.maximum(halves[0].m, halves[1].m)  # the MAX round
    s, t, u = (rescaled(halves[0], top) + rescaled(halves[1], top)).unbind(0)  # the SUM round
    merged = _table(attention.QueryParts(top, s, t, u, halves[0].counted))
    _assert_close(merged, whole)


def test_query_split_sums_per_head():
    q, k = _qk(5)
    spec = AttentionSpec(causal=True)
    whole = head_summary(*_fields(query_parts(q, k, spec)))
    parts = [query_parts(q[:, :, lo:hi], k, AttentionSpec(causal=True, q_positions=torch.arange(lo, hi)))
             for lo, hi in ((0, 7), (7, T))]
    tops, sums = zip(*(head_summary(*_fields(p)) for p in parts))
    assert torch.equal(torch.maximum(*tops), whole[0])
    torch.testing.assert_close(sums[0] + sums[1], whole[1], rtol=1e-12, atol=1e-12)


def test_no_visible_key_counts_nothing():
    q, k = _qk(6)
    mask = torch.zeros(B, T, dtype=torch.bool)
    top, sums = head_summary(*_fields(query_parts(q, k, AttentionSpec(causal=True, token_mask=mask))))
    assert torch.equal(top, torch.full((HQ,), -math.inf, dtype=torch.float64))
    assert torch.equal(sums, torch.zeros(4, HQ, dtype=torch.float64))


def test_spec_refuses_bad_fields():
    with pytest.raises(ConfigError, match="window"):
        AttentionSpec(window=0)
    with pytest.raises(ConfigError, match="softcap"):
        AttentionSpec(softcap=0.0)
    with pytest.raises(ConfigError, match="explicit mask"):
        AttentionSpec(mask=torch.ones(1, 1, 2, 2, dtype=torch.bool), causal=True)


def _fields(p: attention.QueryParts):
    return p.m, p.s, p.t, p.u, p.counted


def test_key_split_placeholder_rounds_stay_neutral():
    """A rank that does not hold a key-split layer (another pipeline stage) runs the same three
    rounds with neutral values and empty per-query parts."""
    from tmetrics_core.metrics.attention_heads import AttentionEntropy
    from tmetrics_core.site import Site
    from tmetrics_core.topology import Topology

    site = Site(name="layers.0.attn.qk", kind="attn_qk", logical_shape=(HQ,), layer=0, meta=(("key_split", "cp"),))
    metric, topology = AttentionEntropy(), Topology.single_process()
    state = metric.prepare([site], [None], topology, {})
    first = metric.start(state, {site.key: site}, topology)
    results = {r.key: r.value for r in first.requests}
    second = metric.resume(first.continuation, results)
    third = metric.resume(second.continuation, {r.key: r.value for r in second.requests})
    done = metric.resume(third.continuation, {r.key: r.value for r in third.requests})
    assert done.done and all(v.numel() in (HQ, 4 * HQ) for v in done.outputs.values())
    top = next(v for k, v in done.outputs.items() if k[1] == "out top")
    assert torch.equal(top, torch.full((HQ,), -math.inf, dtype=torch.float64))
