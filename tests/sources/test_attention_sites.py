"""Attention sites end to end in one process: ``tm.observe(..., kind="attn_qk")`` through
``TensorMetrics`` to records equal to the float64 materialised softmax of what each layer saw."""

from __future__ import annotations

import math

import pytest
import torch

import tmetrics_core as tm
from tests.attention_model import HEAD_DIM, HEADS, WIDTH, AttentionModel, attention_metrics, table
from tests.metrics.attention_reference import reference_table, structured_visible

B, T = 3, 11


def _mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, 8:] = False
    return mask


def _reference(seen: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 table over every micro-batch a layer saw (their queries pooled)."""
    visible, sink, counted = structured_visible(B, T, T, causal=True, token_mask=mask)
    tables = [reference_table(q, k, visible, sink, scale=HEAD_DIM ** -0.5, counted=counted) for q, k in seen]
    n = sum(t["queries"] for t in tables)
    out = {"max": torch.stack([t["max"] for t in tables]).amax(0), "queries": n}
    for name in ("entropy", "lse", "sink"):
        out[name] = sum(t[name] * t["queries"] for t in tables) / n
    return out


def check_records(model: AttentionModel, records, mask: torch.Tensor) -> None:
    got = table(records)
    for layer, block in enumerate(model.layers):
        want = _reference(block.attn.seen, mask)
        heads = got[("layer-attn-logit-max", layer, "heads")]
        assert heads == tuple(want["max"].tolist())  # exact
        assert got[("layer-attn-logit-max", layer, "max")] == max(heads)
        for metric, name in (("layer-attn-entropy", "entropy"), ("layer-attn-sink", "sink"),
                             ("layer-attn-lse", "lse")):
            per_head = torch.tensor(got[(metric, layer, "heads")], dtype=torch.float64)
            torch.testing.assert_close(per_head, want[name], rtol=1e-5, atol=1e-12)
            total = (want[name] * want["queries"]).sum() / want["queries"].sum()
            assert got[(metric, layer, "mean")] == pytest.approx(float(total), rel=1e-9)
            assert got[(metric, layer, "min")] == min(got[(metric, layer, "heads")])
            assert got[(metric, layer, "max")] == max(got[(metric, layer, "heads")])


@pytest.mark.parametrize("logit_scale", [1.0, 100.0])
def test_observed_attention_equals_materialised_softmax(logit_scale):
    torch.manual_seed(0)
    model = AttentionModel(logit_scale=logit_scale)
    metrics = attention_metrics(model)
    mask = _mask()
    spec = tm.AttentionSpec(causal=True, token_mask=mask)
    with metrics.step(1):
        for _ in range(2):  # two micro-batches: per-head sums add, maxima take the larger
            model(torch.randn(B, T, WIDTH), spec)
    check_records(model, metrics.last_records, mask)
    assert len(table(metrics.last_records)) == 3 * (2 + 3 * 4)
    metrics.close()


def test_steps_not_due_observe_nothing():
    model = AttentionModel(layers=1)
    metrics = attention_metrics(model)
    metrics.metrics = [(m, 2) for m, _ in metrics.metrics]
    spec = tm.AttentionSpec(causal=True)
    with metrics.step(1):
        model(torch.randn(B, T, WIDTH), spec)
    with metrics.step(3):  # not due: the call returns after one context-variable read
        model(torch.randn(B, T, WIDTH), spec)
        assert not metrics.last_records or metrics.last_records[0].step == 1
    metrics.close()


def test_observe_refuses_a_lone_tensor_for_attn_qk():
    with pytest.raises(TypeError, match=r"\(q, k\)"):
        tm.observe(torch.nn.Linear(1, 1), "qk", torch.zeros(1), kind="attn_qk")


def test_head_with_no_query_is_nan_not_zero():
    model = AttentionModel(layers=1)
    metrics = attention_metrics(model)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 0] = True  # one real token in the batch: every head counts one query
    with metrics.step(1):
        model(torch.randn(B, T, WIDTH), tm.AttentionSpec(causal=True, token_mask=mask))
    got = table(metrics.last_records)
    assert got[("layer-attn-entropy", 0, "heads")] == (0.0,) * HEADS  # one visible key: zero entropy
    assert got[("layer-attn-sink", 0, "heads")] == (1.0,) * HEADS
    assert all(math.isfinite(v) for v in got[("layer-attn-logit-max", 0, "heads")])
    metrics.close()


def test_a_model_that_never_observes_attention_is_told_how(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))  # attention out of reach: no tm.observe call
    metrics = attention_metrics(model)
    with caplog.at_level("WARNING", logger="tmetrics"), metrics.step(1):
        model(torch.randn(B, T, WIDTH))
    assert not metrics.last_records
    assert "tm.observe(self, 'qk', (q, k), kind='attn_qk'" in caplog.text
    metrics.close()
