"""Attention metrics per layer and global head: max logit, entropy, sink mass, log-sum-exp.

Each ``attn_qk`` site is one attention layer; its logical shape is ``(heads,)``, the global
query heads. A rank computes the per-query parts of its local heads and queries over its keys
(:func:`~tmetrics_core.metrics.attention.query_parts`) and writes them into the global head
slots (its tensor-parallel rank's heads; neutral elsewhere), so every placement reduces with one
op per vector:

- heads split on ``tp`` (``Shard(0)`` of the site), queries split on ``dp``/``cp``/sequence
  axes (``Shard(None)``), a layer on one pipeline stage (``Owned``): the max logit per head
  reduces by MAX, the per-head sums of :data:`~tmetrics_core.metrics.attention.SUM_FIELDS` by
  SUM, in the first round;
- keys split over an axis while its ranks hold the same queries (``AttentionSpec.key_split``):
  round 1 takes the MAX of each query's ``m`` over that axis, round 2 the SUM of its rescaled
  ``(s, t, u)`` (exact: :func:`~tmetrics_core.metrics.attention.rescaled`), after which every
  rank of the axis holds the same complete queries; round 3 sums their per-head sums over the
  other axes.

Requests are data for the executor's packed rounds (no collective here, no host read); the four
metrics read the same prepared parts (shared through the observation's memo) and send the same
requests under the same keys, which the executor sends once. Micro-batches merge by MAX and SUM
(key-split parts by appending their queries). Records per layer: the per-head vector (stat
``heads``) and roll-ups over heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Hashable, Mapping, Sequence

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.attention import SUM_FIELDS, head_summary, query_parts, rescaled
from tmetrics_core.metrics.base import CollectiveRequest, MetricResult, Round
from tmetrics_core.metrics.statistics import split_axes
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.topology import Topology

__all__ = ["AttentionEntropy", "AttentionLse", "AttentionLogitMax", "AttentionObservation", "AttentionSink",
           "head_layout"]

KIND = "attn_qk"


@dataclass(frozen=True, eq=False, slots=True)
class AttentionObservation:
    """One observed call: ``q [B, Hq_local, Tq, D]``, ``k [B, Hkv_local, Tk, D]`` and the spec."""

    q: torch.Tensor
    k: torch.Tensor
    spec: AttentionSpec


@dataclass(frozen=True, slots=True)
class _Heads:
    """Per global head: max logit ``[H]`` and sums ``[4 * H]`` (field-major), float64."""

    top: torch.Tensor
    sums: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Queries:
    """Key-split parts of the local heads ``[Hl, N]`` (queries of every micro-batch appended)."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor
    u: torch.Tensor
    counted: torch.Tensor
    first: int


def head_layout(site: Site, topology: Topology, local_heads: int) -> int:
    """The global id of this rank's first local head: ``tp rank x local heads`` when the site
    splits its heads over ``tp`` (``Shard(0)``), else 0."""
    tp = topology.axes.get("tp")
    if tp is None or tp.size == 1 or not site.placement("tp").is_shard(0):
        return 0
    return tp.rank * local_heads


def _key_axis(site: Site) -> str | None:
    return dict(site.meta).get("key_split")  # type: ignore[return-value]


def _key_axes(site: Site, topology: Topology) -> tuple[str, ...]:
    """The axis the site's keys are split over, when it has more than one rank (else none)."""
    axis = _key_axis(site)
    found = topology.axes.get(axis) if axis is not None else None
    return (axis,) if found is not None and found.size > 1 else ()  # type: ignore[return-value]


class _AttentionMetric:
    """Base of the four attention metrics (one protocol implementation, shared requests)."""

    name = ""
    source_kinds = frozenset({KIND})
    scope = "layer"
    formula = ""
    unit = ""
    baseline = ""

    def __init__(self, *, name: str | None = None, source_kinds: Sequence[str] | None = None,
                 scope: str | None = None, select: str | Sequence[str] | None = None) -> None:
        if name is not None:
            self.name = name  # source_kinds and scope are fixed (attn_qk, layer): the catalogue passes them alike
        patterns = (select,) if isinstance(select, str) else tuple(select or ())
        self._match = (lambda s: any(fnmatchcase(s, p) for p in patterns)) if patterns else (lambda s: True)

    def accepts(self, site: Site) -> bool:
        return site.kind == KIND and site.layer is not None and self._match(site.name)

    def check(self, site: Site, topology: Topology) -> None:
        axis = _key_axis(site)
        if axis is not None and axis not in topology.axes:
            raise PlacementError(f"{self.name}: {site.name} splits its keys over axis {axis!r}, which is not an axis "
                                 f"of the topology {list(topology.names)}")
        for name, p in site.placements:
            if p.is_flat_shard() or p.is_partial() or (p.shard_dim() not in (None, 0)):
                raise PlacementError(f"{self.name}: heads split as {p} on {name!r}; attention sites take heads "
                                     f"split on tp (Shard(0)), query splits (Shard(None)) and Owned; got "
                                     f"{site.describe()}")

    def prepare(self, sites: Sequence[Site], tensors: Sequence[Any], topology: Topology,
                memo: dict[Hashable, Any]) -> dict[SiteKey, Any]:
        out: dict[SiteKey, Any] = {}
        for site, obs in zip(sites, tensors):
            key = ("attn_qk parts", site.key)
            state = memo.get(key)
            if state is None:
                state = memo[key] = _prepare(site, obs, topology)
            out[site.key] = state
        return out

    def merge(self, a: dict[SiteKey, Any], b: dict[SiteKey, Any]) -> dict[SiteKey, Any]:
        out = dict(a)
        for key, y in b.items():
            x = out.get(key)
            if x is None:
                out[key] = y
            elif isinstance(x, _Heads):
                out[key] = _Heads(torch.maximum(x.top, y.top), x.sums + y.sums)
            else:
                m, s, t, u, counted = (torch.cat([p, r], dim=1) for p, r in zip(
                    (x.m, x.s, x.t, x.u, x.counted), (y.m, y.s, y.t, y.u, y.counted)))
                out[key] = _Queries(m, s, t, u, counted, x.first)
        return out

    def start(self, state: Mapping[SiteKey, Any], sites: Mapping[SiteKey, Site], topology: Topology) -> Round:
        items = [(sites[k], v) for k, v in sorted(state.items())]
        requests = []
        for site, v in items:
            spread = split_axes(site, topology, "sum", linear=True)
            if isinstance(v, _Heads):
                requests.append(_request("top", site, spread, "max", v.top))
                requests.append(_request("sums", site, spread, "sum", v.sums))
            else:
                keys = _key_axes(site, topology)
                requests.append(_request("m", site, keys, "max", v.m.reshape(-1), uniform=False))
        return self._next(1, items, requests, topology)

    def _next(self, index: int, items: list, requests: list[CollectiveRequest], topology: Topology) -> Round:
        if requests:
            return Round(requests=requests, continuation=(index, items, topology), agreed=True)
        return Round(continuation=(index, items, topology), done=True, outputs=_outputs(items))

    def resume(self, continuation: Any, results: Mapping[Hashable, torch.Tensor]) -> Round:
        index, items, topology = continuation
        requests: list[CollectiveRequest] = []
        after: list = []
        for site, v in items:
            if isinstance(v, _Heads):  # reduced by the round that asked for it, unchanged after
                if _key("top", site) in results:
                    v = _Heads(results[_key("top", site)], results[_key("sums", site)])
                after.append((site, v))
                continue
            axis = _key_axis(site)
            keys = _key_axes(site, topology)
            if index == 1:  # the MAX of m came back: send the rescaled parts
                top = results[_key("m", site)].reshape(v.m.shape)
                parts = rescaled(v, top)  # type: ignore[arg-type]  # (m, s, t, u) as QueryParts
                v = _Queries(top, v.s, v.t, v.u, v.counted, v.first)  # s, t, u replaced next round
                requests.append(_request("stu", site, keys, "sum", parts.reshape(-1), uniform=False))
            elif index == 2:  # complete queries: per-head sums, then over the other axes
                s, t, u = results[_key("stu", site)].reshape(3, *v.m.shape).unbind(0)
                heads = site.logical_shape[0]
                top = torch.full((heads,), -math.inf, dtype=torch.float64, device=s.device)
                sums = torch.zeros((len(SUM_FIELDS), heads), dtype=torch.float64, device=s.device)
                if v.m.numel():  # a placeholder (a stage without this layer) keeps neutral slots
                    local_top, local_sums = head_summary(v.m[None], s[None], t[None], u[None], v.counted[None])
                    top[v.first:v.first + local_top.numel()] = local_top
                    sums[:, v.first:v.first + local_top.numel()] = local_sums
                spread = tuple(a for a in split_axes(site, topology, "sum", linear=True) if a != axis)
                requests.append(_request("top", site, spread, "max", top))
                requests.append(_request("sums", site, spread, "sum", sums.reshape(-1)))
                v = _Heads(top, sums.reshape(-1))
            after.append((site, v))
        return self._next(index + 1, after, requests, topology)

    def finish(self, continuation: Any, host: Mapping[Hashable, list[float]]) -> list[MetricResult]:
        _, items, _ = continuation
        results: list[MetricResult] = []
        for site, _v in items:
            top = host[("attn_qk", "out top", site.key)]
            sums = host[("attn_qk", "out sums", site.key)]
            heads = len(top)
            fields = {f: sums[i * heads:(i + 1) * heads] for i, f in enumerate(SUM_FIELDS)}
            if not any(fields["queries"]):
                continue  # no rank counted a query of this layer: no record
            for value, stat in self.values(top, fields):
                results.append(MetricResult(value, "layer", site.layer, None, None, stat))
        return results

    def values(self, top: list[float], fields: Mapping[str, list[float]]) -> list[tuple[Any, str]]:
        """``(value, stat)`` pairs of one layer from its per-head max logits and sums."""
        raise NotImplementedError(f"{type(self).__name__}.values")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _prepare(site: Site, obs: AttentionObservation | None, topology: Topology) -> Any:
    heads = site.logical_shape[0]
    axis = _key_axis(site)
    if obs is None:  # held elsewhere (another pipeline stage): neutral slots
        if axis is not None:
            empty = torch.zeros((0, 0), dtype=torch.float64)
            return _Queries(empty, empty, empty, empty, empty.bool(), 0)
        return _Heads(torch.full((heads,), -math.inf, dtype=torch.float64),
                      torch.zeros(len(SUM_FIELDS) * heads, dtype=torch.float64))
    parts = query_parts(obs.q.detach(), obs.k.detach(), obs.spec)
    local = parts.m.shape[1]
    first = head_layout(site, topology, local)
    if axis is not None:
        def per_head(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).reshape(local, -1)
        return _Queries(per_head(parts.m), per_head(parts.s), per_head(parts.t), per_head(parts.u),
                        per_head(parts.counted), first)
    local_top, local_sums = head_summary(parts.m, parts.s, parts.t, parts.u, parts.counted)
    device = local_top.device
    top = torch.full((heads,), -math.inf, dtype=torch.float64, device=device)
    sums = torch.zeros((len(SUM_FIELDS), heads), dtype=torch.float64, device=device)
    top[first:first + local] = local_top
    sums[:, first:first + local] = local_sums
    return _Heads(top, sums.reshape(-1))


def _key(stage: str, site: Site) -> Hashable:
    return ("attn_qk", stage, site.key)


def _request(stage: str, site: Site, axes: tuple[str, ...], op: Any, value: torch.Tensor, *,
             uniform: bool = True) -> CollectiveRequest:
    return CollectiveRequest(_key(stage, site), axes, op, value, uniform=uniform)


def _outputs(items: list) -> dict[Hashable, torch.Tensor]:
    out: dict[Hashable, torch.Tensor] = {}
    for site, v in items:
        out[("attn_qk", "out top", site.key)] = v.top
        out[("attn_qk", "out sums", site.key)] = v.sums
    return out


def _means(fields: Mapping[str, list[float]], name: str) -> list[float]:
    return [x / n if n else math.nan for x, n in zip(fields[name], fields["queries"])]


def _rollup(per_head: list[float], total: float, count: float) -> list[tuple[Any, str]]:
    finite = [v for v in per_head if not math.isnan(v)]
    return [(tuple(per_head), "heads"), (total / count if count else math.nan, "mean"),
            (min(finite) if finite else math.nan, "min"), (max(finite) if finite else math.nan, "max")]


class AttentionLogitMax(_AttentionMetric):
    """Max pre-softmax score per global head (after RoPE, scale and soft cap) over batch,
    queries and visible keys; roll-up ``max`` over heads. What a QK-clip reads."""

    name = "layer-attn-logit-max"
    formula = "max over b, i, visible j of x_bhij = scale * q_bhi . k_bhj (after soft cap)"
    unit = "logit"
    baseline = "tens; steady growth past ~100 precedes loss spikes (the reason for QK-norm and QK-clip)"

    def values(self, top, fields):
        heads = [math.nan if v == -math.inf else v for v in top]  # -inf: no query counted in that head
        finite = [v for v in heads if not math.isnan(v)]
        return [(tuple(heads), "heads"), (max(finite) if finite else math.nan, "max")]


class AttentionEntropy(_AttentionMetric):
    """Mean over counted queries of the attention distribution's entropy (nats) per global
    head; roll-ups ``mean`` (over every query of every head), ``min`` and ``max`` over heads."""

    name = "layer-attn-entropy"
    formula = "mean over queries of H = -sum_j p_ij log p_ij = log s - t / s (online softmax over key blocks)"
    unit = "nats"
    baseline = "between 0 and log(visible keys); a head falling toward 0 has collapsed onto one key"

    def values(self, top, fields):
        return _rollup(_means(fields, "entropy"), sum(fields["entropy"]), sum(fields["queries"]))


class AttentionSink(_AttentionMetric):
    """Mean attention mass on each query's sequence's first token (its segment's first real
    token; with an explicit mask, its first visible key) per global head; roll-ups as entropy."""

    name = "layer-attn-sink"
    formula = "mean over queries of p_i,first(i) = u / s"
    unit = "probability"
    baseline = "often high (0.3-0.9) in trained LLMs past the first layers: attention sinks"

    def values(self, top, fields):
        return _rollup(_means(fields, "sink"), sum(fields["sink"]), sum(fields["queries"]))


class AttentionLse(_AttentionMetric):
    """Mean log-sum-exp of the scores per global head; roll-ups as entropy."""

    name = "layer-attn-lse"
    formula = "mean over queries of log sum_j exp(x_ij) = m + log s"
    unit = "logit"
    baseline = "tracks the max logit; growth means sharper, larger scores"

    def values(self, top, fields):
        return _rollup(_means(fields, "lse"), sum(fields["lse"]), sum(fields["queries"]))
