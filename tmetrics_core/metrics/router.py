"""MoE router metrics: expert load, decision entropy, z-loss and the router diagnostic families.

Router sites, per MoE layer (all token sites flattened to ``[tokens, ...]`` with padding removed,
population-split across ``dp``/``ep``/..., ``Owned`` on ``pp``):

- ``router_logits`` ``[tokens, E]``: pre-softmax logits (E = ``Site.num_experts``, global);
- ``router_scores`` ``[tokens, E]``: post-softmax/sigmoid probabilities, when the model exposes
  them; otherwise metrics take ``softmax(router_logits)``;
- ``router_topk`` ``[tokens, k]`` int64: the global expert ids each token was dispatched to;
- ``expert_bias`` ``[E]``: the aux-loss-free balancing bias (DeepSeek-V3), when present.

The four diagnostic families (``layer-router-health``, ``-routing-balance``,
``-seq-aux-decomposition``, ``-expert-bias``) follow the Megatron-LM tensor metrics. For each
sequence ``g`` of a layer, with ``u = 1/E``:

- ``s`` = mean score row over the sequence's tokens (rows normalized to sum 1, so sigmoid
  routers are read as DeepSeek-V3's sequence-wise aux loss reads them);
- ``a`` = share of the sequence's *unbiased* top-k assignments (top-k of the scores, k the width
  of ``router_topk``) per expert; ``c`` = share of its dispatched assignments (``router_topk``);
- ``seq_aux_loss = E sum_i a_i s_i`` (Switch Transformer's balance loss, per sequence; 1 when
  balanced), ``aux_load_imbalance = E sum (a_i - u)^2`` and ``score_imbalance = E sum (s_i - u)^2``
  (0 when balanced), ``imbalance_coupling = E sum (a_i - u)(s_i - u)`` (so the loss is
  ``1 + coupling``), ``imbalance_alignment`` = cosine of ``a - u`` and ``s - u`` (0 if either is 0),
  ``actual_load_imbalance = E sum (c_i - u)^2``, ``aux_actual_tv = 1/2 sum |a_i - c_i|``,
  ``aux_actual_overlap`` = share of unbiased assignments that were dispatched,
  ``aux_max_over_mean = E max a``, ``actual_max_over_mean = E max c``,
  ``actual_inactive_fraction`` = share of experts with no dispatched token,
  ``topk_boundary_relative_margin`` = mean over tokens of ``max(0, lowest chosen score - highest
  other score) / lowest chosen score`` (0 when k = 0 or k = E);
- bias statistics: mean, population std, RMS, range, max |b|, and Pearson correlations of ``b``
  with ``s``, ``a`` and ``c`` across experts (0 when either side is constant).

Aggregations: ``mean``/``max``/``min`` over the sequences of a layer (of all ranks and
micro-batches), and ``global``: the same formula on the layer's whole-batch distributions (summed
scores, summed assignment counts). Each family reports per layer and a cross-layer roll-up
(``layer`` unset): means pool every sequence of every layer, max/min take the extreme layer,
``global`` values average the per-layer values; ``layer-router-health`` reports only the roll-up
and, as ``worst-layer-<op>``, the worst layer's value (largest, or smallest for the margin).

Sequences: a ``router_topk`` site with ``Site.meta`` entry ``("seq_len", L)`` holds whole
sequences of ``L`` tokens, row-major; sequences may be spread over ``dp`` ranks in any way, each
whole on one rank. Without it (ragged sequences after padding removal), each observation (one
micro-batch on one rank) counts as one sequence: per-sequence values are then micro-batch values
and depend on how tokens are split across ranks; ``global`` values never do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.base import MetricResult, StatMetric
from tmetrics_core.metrics.softmax import RowSoftmax, RowSoftmaxMetric
from tmetrics_core.metrics.statistics import Statistic, flagged_value, neutral
from tmetrics_core.site import Site

__all__ = [
    "CONTEXT_AXES",
    "SEQUENCE_FIELDS",
    "DeadExperts",
    "DecisionEntropy",
    "ExpertBias",
    "ExpertCounts",
    "ExpertLoadImbalance",
    "ExpertTokens",
    "RouterHealth",
    "RouterOp",
    "RouterZLoss",
    "RoutingBalance",
    "SeqAuxDecomposition",
]

ROUTER_KINDS = frozenset({"router_logits", "router_scores", "router_topk", "expert_bias"})
CONTEXT_AXES = frozenset({"cp"})
"""Axes that cut sequences (context parallelism) although they split tokens."""

SEQUENCE_FIELDS = (
    "seq_aux_loss", "aux_load_imbalance", "score_imbalance", "imbalance_coupling",
    "imbalance_alignment", "actual_load_imbalance", "aux_actual_tv", "aux_actual_overlap",
    "aux_max_over_mean", "actual_max_over_mean", "actual_inactive_fraction",
    "topk_boundary_relative_margin", "bias_mean", "bias_std", "bias_rms", "bias_range",
    "bias_abs_max", "bias_score_correlation", "bias_aux_load_correlation",
    "bias_actual_load_correlation",
)
"""Per-sequence statistics, summed over sequences in the first entries of the sums vector."""

_EXTREMES = ("seq_aux_loss", "actual_load_imbalance", "-aux_actual_overlap")
_EXTREMES_SIZE = 2 * len(_EXTREMES)
_COUNTS = ("sequences", "bias_sequences", "tokens")
_BIAS_FIELDS = SEQUENCE_FIELDS[12:]
_MARGIN_EPS = float(torch.finfo(torch.float32).eps)


def _experts(site: Site) -> int:
    if not site.num_experts or site.num_experts < 1:
        raise PlacementError(
            f"router site {site.describe()} has no num_experts; the router source must set "
            "Site.num_experts to the global expert count"
        )
    return site.num_experts


def _check_rows(site: Site, metric: str, *, allow_class_split: bool) -> None:
    """Token sites: 2-D, rows split only as a population, classes split only if allowed."""
    if site.kind == "expert_bias":
        for axis, p in site.placements:
            if p.is_shard() or p.is_strided_shard() or p.is_flat_shard():
                raise PlacementError(
                    f"{metric}: expert_bias must be whole on every rank that routes (Replica, or "
                    f"Owned by its pipeline stage); got {p} on axis {axis!r} in {site.describe()}"
                )
        return
    if len(site.logical_shape) != 2:
        raise PlacementError(f"{metric}: needs a [tokens, n] router tensor; got {site.describe()}")
    for axis, p in site.placements:
        if p.is_flat_shard():
            raise PlacementError(f"{metric}: a FlatShard cuts token rows; got {site.describe()}")
        dim = p.shard_dim()
        if dim is not None and dim >= 1:
            if allow_class_split and p.is_shard(1) and site.kind == "router_logits":
                continue  # a StridedShard of the experts interleaves them: not a class split
            raise PlacementError(
                f"{metric}: {site.kind} is split by expert ({f'Shard({dim})' if p.is_shard() else repr(p)} on axis "
                f"{axis!r}) but this "
                f"metric needs each token's full row; got {site.describe()}. Observe the router "
                "tensors replicated on that axis (tm.observe without shard_dim): they are small"
            )


class ExpertCounts(Statistic):
    """Tokens dispatched to each global expert: ``bincount`` of ``router_topk`` ids (length E).

    A token routed to k experts counts once for each. Ids outside ``[0, E)`` (a source bug)
    raise ``ValueError`` on CPU, reported on every rank by the executor; on an accelerator,
    where checking would stall the device for a host read, they make the layer's counts NaN.
    """

    name, op = "expert_counts", "sum"

    def size(self, site):
        return _experts(site)

    def check(self, site, topology):
        _experts(site)
        _check_rows(site, self.name, allow_class_split=False)

    def compute(self, tensors, sites, topology, rows):
        out = []
        for ids, site in zip(tensors, sites):
            experts = _experts(site)
            flat = ids.detach().reshape(-1).to(torch.int64)
            if flat.device.type != "cpu":
                out.append(_device_counts(flat, experts))
                continue
            # bincount checks the ids itself (a negative one raises, a large one widens the
            # output), so the common case reads no value on the host.
            try:
                counts = torch.bincount(flat, minlength=experts)
            except RuntimeError:
                counts = None
            if counts is None or counts.numel() > experts:
                raise ValueError(
                    f"{site.name}: expert ids must be in [0, {experts}); got {int(flat.min())}..{int(flat.max())}"
                )
            out.append(counts.to(torch.float64))
        return out


def _device_counts(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """Counts per expert without a host read: ids outside ``[0, E)`` land in an extra slot
    that, when not empty, turns every count NaN (``bincount`` would size its output from the
    largest id, a host read)."""
    valid = (flat >= 0) & (flat < experts)
    slots = torch.zeros(experts + 1, dtype=torch.float64, device=flat.device)
    slots.index_add_(0, torch.where(valid, flat, experts), torch.ones_like(flat, dtype=torch.float64))
    return slots[:experts] + torch.where(slots[experts] > 0, math.nan, 0.0)


class ExpertTokens(StatMetric):
    """Tokens per global expert for each MoE layer, a vector of length E (tokens of every rank
    and micro-batch; each token counts once per chosen expert). Balanced: every entry
    ``k T / E``."""

    statistics = (ExpertCounts(),)
    source_kinds = frozenset({"router_topk"})
    scope = "layer"
    formula = "n_e = #{(t, j): topk_tj = e}, e = 0..E-1"

    def finalize(self, stats):
        return tuple(stats["expert_counts"])


class ExpertLoadImbalance(StatMetric):
    """Expert load imbalance per layer from the token counts ``n_e``: ``max-over-mean``
    (``max n / mean n``, 1 when balanced, E when one expert takes all) and ``cv`` (population
    standard deviation over mean, 0 when balanced, ``sqrt(E - 1)`` when one expert takes all).
    NaN when no token was routed."""

    statistics = (ExpertCounts(),)
    source_kinds = frozenset({"router_topk"})
    scope = "layer"
    formula = "max_e n_e / mean_e n_e;  std_e n_e / mean_e n_e"

    def finalize(self, stats):
        counts = stats["expert_counts"]
        mean = sum(counts) / len(counts)
        if not mean:
            return {"max-over-mean": math.nan, "cv": math.nan}
        var = sum((c - mean) ** 2 for c in counts) / len(counts)
        return {"max-over-mean": max(counts) / mean, "cv": math.sqrt(var) / mean}


class DeadExperts(StatMetric):
    """Number of experts of a layer that received no token in the step (all ranks and
    micro-batches). 0 is healthy."""

    statistics = (ExpertCounts(),)
    source_kinds = frozenset({"router_topk"})
    scope = "layer"
    formula = "#{e : n_e = 0}"

    def finalize(self, stats):
        return float(sum(1 for c in stats["expert_counts"] if c == 0))


class RouterZLoss(RowSoftmaxMetric):
    """Router z-loss per layer (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of the
    squared log-partition of the router logits, ``(1/T) sum_t (log sum_e exp z_te)^2``.
    Large values mean large logits (round-off risk in the softmax); small and stable is healthy."""

    source_kinds = frozenset({"router_logits"})
    scope = "layer"
    formula = "(1/T) sum_t (logsumexp_e z_te)^2"

    def __init__(self, **kwargs) -> None:
        self.statistics = (RowSoftmax(),)
        super().__init__(**kwargs)

    def check(self, site, topology):
        _check_rows(site, self.name, allow_class_split=True)
        super().check(site, topology)

    def from_rows(self, sums):
        return sums["lse_sq"] / sums["rows"] if sums["rows"] else math.nan


class DecisionEntropy(RowSoftmaxMetric):
    """Normalized router decision entropy per layer: the mean over tokens of
    ``H(p_t) / log E`` with ``p_t`` the token's routing distribution (``router_scores`` rows,
    normalized to sum 1; ``softmax(router_logits)`` where the layer exposes no scores).
    1 means uniform routing (no decision), 0 a one-hot decision. Megatron-LM's
    ``layer-router-decision-entropy``."""

    source_kinds = frozenset({"router_scores", "router_logits"})
    scope = "layer"
    formula = "(1/T) sum_t (-sum_e p_te log p_te) / log E"

    def __init__(self, **kwargs) -> None:
        self.statistics = (RowSoftmax(frozenset({"router_scores"})),)
        super().__init__(**kwargs)

    def check(self, site, topology):
        _check_rows(site, self.name, allow_class_split=True)
        super().check(site, topology)

    def kept(self, sites):
        """Scores where a layer has them, logits otherwise (never both for one layer)."""
        scored = {s.layer for s in sites if s.kind == "router_scores"}
        return [i for i, s in enumerate(sites) if s.kind == "router_scores" or s.layer not in scored]

    def from_rows(self, sums):
        return sums["normalized_entropy"] / sums["rows"] if sums["rows"] else math.nan


# ---- the router diagnostic families ------------------------------------------------------


class _RouterSums(Statistic):
    """Per layer: sums over sequences of :data:`SEQUENCE_FIELDS`, the sequence, biased-sequence
    and token counts, then summed scores, unbiased and dispatched assignment counts (E each).
    Computed jointly with :class:`_RouterExtremes` by :func:`layer_summary`."""

    name, op = "router_sums", "sum"

    def size(self, site):
        return len(SEQUENCE_FIELDS) + len(_COUNTS) + 3 * _experts(site)


class _RouterExtremes(Statistic):
    """Per layer: max over sequences of the loss and the dispatched imbalance, and ``-min`` of
    the top-k overlap, then one NaN flag per extreme: ``[x_1, x_2, x_3, f_1, f_2, f_3]``.

    An extreme that is NaN (a NaN score reaches the loss) is carried as ``x = -inf, f = 1``,
    reduced with MAX like the values, so every rank reports NaN however the reduction orders
    the ranks (NOTE [NaN under MAX] in :mod:`~tmetrics_core.metrics.statistics`)."""

    name, op = "router_extremes", "max"

    def size(self, site):
        return _EXTREMES_SIZE


ROUTER_SUMS = _RouterSums()
ROUTER_EXTREMES = _RouterExtremes()


def layer_summary(probs: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None,
                  seq_len: int | None, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums and extremes vectors of one layer's local observation (float64; the
    layouts of :class:`_RouterSums` and :class:`_RouterExtremes`, extremes NaN-flagged).

    Args:
        probs: ``[T, E]`` routing probabilities (rows sum to 1).
        ids: ``[T, k]`` dispatched global expert ids.
        bias: ``[E]`` expert bias or None.
        seq_len: tokens per sequence, or None (the observation is one sequence).
        experts: E.

    Raises:
        ValueError: token counts that disagree or are not a multiple of ``seq_len``; ids out of range.
    """
    tokens = probs.shape[0]
    device = probs.device
    sums = torch.zeros(len(SEQUENCE_FIELDS) + len(_COUNTS) + 3 * experts, dtype=torch.float64, device=device)
    extremes = neutral("max", _EXTREMES_SIZE, device)
    if ids.shape[0] != tokens:
        raise ValueError(f"router_topk has {ids.shape[0]} tokens but the scores have {tokens}")
    if not tokens:
        return sums, extremes
    if seq_len is not None and tokens % seq_len:
        raise ValueError(f"{tokens} tokens are not whole sequences of seq_len {seq_len}")
    groups = tokens // seq_len if seq_len else 1
    group = (torch.arange(tokens, device=device) // (seq_len or tokens))
    k = ids.shape[1]
    ids = ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"expert ids must be in [0, {experts}); got {int(ids.min())}..{int(ids.max())}")
    p = probs.to(torch.float64)
    aux = torch.zeros_like(p, dtype=torch.bool)
    if k:
        aux.scatter_(1, torch.topk(p, min(k, experts), dim=1).indices, True)
    actual = torch.zeros_like(p, dtype=torch.bool)
    actual.scatter_(1, ids, True)

    def per_group(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((groups,) + tuple(x.shape[1:]), dtype=torch.float64, device=device)
        return out.index_add_(0, group, x.to(torch.float64))

    n = per_group(torch.ones(tokens, device=device))
    score = per_group(p) / n.unsqueeze(1)
    aux_counts, actual_counts = per_group(aux), per_group(actual)
    a = aux_counts / aux_counts.sum(1, keepdim=True).clamp_min(1)
    c = actual_counts / actual_counts.sum(1, keepdim=True).clamp_min(1)
    overlap = per_group((aux & actual).sum(1)) / aux_counts.sum(1).clamp_min(1)
    if 0 < k < experts:
        floor = p.masked_fill(~aux, math.inf).amin(1)
        ceiling = p.masked_fill(aux, -math.inf).amax(1)
        margin = per_group((floor - ceiling).clamp_min(0) / floor.clamp_min(_MARGIN_EPS)) / n
    else:
        margin = torch.zeros(groups, dtype=torch.float64, device=device)
    u = 1.0 / experts
    da, ds, dc = a - u, score - u, c - u
    coupling = (da * ds).sum(1)
    norm = (da.pow(2).sum(1) * ds.pow(2).sum(1)).sqrt()
    fields = [
        experts * (a * score).sum(1), experts * da.pow(2).sum(1), experts * ds.pow(2).sum(1),
        experts * coupling, torch.where(norm > 0, coupling / norm, torch.zeros_like(norm)),
        experts * dc.pow(2).sum(1), 0.5 * (a - c).abs().sum(1), overlap,
        experts * a.amax(1), experts * c.amax(1), (c == 0).to(torch.float64).mean(1), margin,
    ]
    if bias is not None:
        b = bias.detach().to(torch.float64).reshape(1, experts).expand(groups, experts)
        fields += [b.mean(1), b.std(1, correction=0), b.pow(2).mean(1).sqrt(), b.amax(1) - b.amin(1),
                   b.abs().amax(1), _correlation(b, score), _correlation(b, a), _correlation(b, c)]
    else:
        fields += [torch.zeros(groups, dtype=torch.float64, device=device)] * len(_BIAS_FIELDS)
    per_sequence = torch.stack(fields, dim=1)
    head = len(SEQUENCE_FIELDS)
    sums[:head] = per_sequence.sum(0)
    sums[head:head + 3] = torch.tensor([groups, groups if bias is not None else 0, tokens],
                                       dtype=torch.float64, device=device)
    body = sums[head + 3:].view(3, experts)
    body[0], body[1], body[2] = p.sum(0), aux_counts.sum(0), actual_counts.sum(0)
    peaks = torch.stack([fields[0].max(), fields[5].max(), (-overlap).max()])
    nan = torch.isnan(peaks)
    return sums, torch.cat([peaks.masked_fill(nan, -math.inf), nan.to(torch.float64)])


def _correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation along dim 1 (0 where either row is constant)."""
    dx = x - x.mean(1, keepdim=True)
    dy = y - y.mean(1, keepdim=True)
    denominator = (dx.pow(2).sum(1) * dy.pow(2).sum(1)).sqrt()
    return torch.where(denominator > 0, (dx * dy).sum(1) / denominator, torch.zeros_like(denominator))


@dataclass(frozen=True, slots=True)
class RouterOp:
    """One reported statistic: ``name`` (the record's stat), the per-sequence ``field`` or
    global formula, ``aggregation`` (``mean``, ``max``, ``min`` over sequences, or ``global``)
    and whether the worst layer is the smallest value."""

    name: str
    field: str
    aggregation: str
    worst_is_min: bool = False


class _RouterFamily(StatMetric):
    """Base of the diagnostic families: one joint summary per layer shared by all four
    (``router_topk`` + ``router_scores`` or ``router_logits`` + optional ``expert_bias``),
    reduced over the population and owner axes of the ``router_topk`` site."""

    source_kinds = ROUTER_KINDS
    scope = "layer"
    statistics = (ROUTER_SUMS, ROUTER_EXTREMES)
    ops: tuple[RouterOp, ...] = ()
    per_layer = True
    worst_layer = False
    needs_bias = False

    def check(self, site: Site, topology: Topology) -> None:
        if site.kind != "expert_bias":
            _experts(site)
            if site.num_experts < 2:  # type: ignore[operator]
                raise PlacementError(f"{self.name}: needs at least 2 experts; got {site.describe()}")
        _check_rows(site, self.name, allow_class_split=False)
        meta = dict(site.meta)
        if site.kind == "router_topk" and "seq_len" in meta:
            for axis, p in site.placements:
                size = topology.axes[axis].size if axis in topology.axes else 1
                if size > 1 and p.splits() and not p.is_owned() and (
                        axis in CONTEXT_AXES or axis not in topology.population_axes):
                    raise PlacementError(
                        f"{self.name}: per-sequence statistics need whole sequences on each rank, but "
                        f"axis {axis!r} ({p}) cuts sequences in {site.describe()}. Drop the seq_len "
                        "meta to get micro-batch statistics, or observe the router after gathering "
                        "the sequence"
                    )

    def prepare(self, sites, tensors, topology, memo):
        """One joint summary per layer that has ``router_topk`` and scores or logits; the
        memo shares it between families. Placeholders (layers held elsewhere) get neutral
        vectors."""
        layers: dict[Any, dict[str, tuple[Site, torch.Tensor | None]]] = {}
        for site, tensor in zip(sites, tensors):
            layers.setdefault(site.layer, {})[site.kind] = (site, tensor)
        state: dict = {}
        for parts in layers.values():
            source = parts.get("router_scores") or parts.get("router_logits")
            if "router_topk" not in parts or source is None:
                continue
            topk_site, ids = parts["router_topk"]
            if ids is None:
                state[topk_site.key] = [neutral(s.op, s.size(topk_site)) for s in self.statistics]
                continue
            if (ROUTER_SUMS.name, topk_site.key) not in memo:
                if source[1] is None:
                    raise ValueError(f"layer {topk_site.layer}: router_topk is held here but {source[0].kind} is not")
                bias = parts.get("expert_bias", (None, None))[1]
                seq_len = dict(topk_site.meta).get("seq_len")
                sums, extremes = layer_summary(_probabilities(source[1], source[0].kind), ids, bias,
                                               seq_len, _experts(topk_site))  # type: ignore[arg-type]
                memo[(ROUTER_SUMS.name, topk_site.key)] = sums
                memo[(ROUTER_EXTREMES.name, topk_site.key)] = extremes
            state[topk_site.key] = [memo[(s.name, topk_site.key)] for s in self.statistics]
        return state

    def finish(self, continuation, host):
        groups, _ = self.grouped(continuation, host)
        per_layer: dict[Any, Mapping[str, list[float]]] = {gkey[0]: stats for gkey, stats in groups.items()}
        layers = sorted(per_layer, key=lambda v: (v is None, v))
        summaries = {layer: _LayerSummary(per_layer[layer]) for layer in layers}
        if self.needs_bias:
            summaries = {layer: s for layer, s in summaries.items() if s.bias_sequences}
        results: list[MetricResult] = []
        if self.per_layer:
            for layer, summary in summaries.items():
                results.extend(MetricResult(summary.value(op), scope="layer", layer=layer, stat=op.name)
                               for op in self.ops)
        if summaries:
            for op in self.ops:
                results.append(MetricResult(_rollup(op, list(summaries.values()), self.needs_bias),
                                            scope="global", stat=op.name))
            if self.worst_layer:
                for op in self.ops:
                    values = [s.value(op) for s in summaries.values()]
                    worst = _nan_extreme(values, smallest=op.worst_is_min)
                    results.append(MetricResult(worst, scope="global", stat=f"worst-layer-{op.name}"))
        return results


def _probabilities(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    x = tensor.detach().to(torch.float64)
    if kind == "router_logits":
        return torch.softmax(x, dim=1)
    return x / x.sum(dim=1, keepdim=True)


class _LayerSummary:
    """The reduced sums and extremes of one layer, read by name."""

    def __init__(self, vectors: Mapping[str, list[float]]) -> None:
        sums = vectors[ROUTER_SUMS.name]
        head = len(SEQUENCE_FIELDS)
        self.field_sums = dict(zip(SEQUENCE_FIELDS, sums[:head]))
        self.sequences, self.bias_sequences, self.tokens = sums[head:head + 3]
        experts = (len(sums) - head - 3) // 3
        body = sums[head + 3:]
        self.score, self.aux, self.actual = body[:experts], body[experts:2 * experts], body[2 * experts:]
        self.experts = experts
        top = vectors[ROUTER_EXTREMES.name]
        peak = [flagged_value((top[i], top[i + len(_EXTREMES)])) for i in range(len(_EXTREMES))]
        self.extremes = {"seq_aux_loss": peak[0], "actual_load_imbalance": peak[1], "aux_actual_overlap": -peak[2]}

    def mean(self, field: str) -> float:
        count = self.bias_sequences if field in _BIAS_FIELDS else self.sequences
        return self.field_sums[field] / count if count else math.nan

    def global_value(self, field: str) -> float:
        e = self.experts
        score, aux, actual = (_normalized(v) for v in (self.score, self.aux, self.actual))
        if field == "global_batch_aux_loss":
            return e * sum(x * y for x, y in zip(aux, score))
        if field == "seq_global_aux_loss_gap":
            return self.mean("seq_aux_loss") - self.global_value("global_batch_aux_loss")
        if field == "actual_load_imbalance":
            return e * sum((x - 1.0 / e) ** 2 for x in actual)
        if field == "aux_actual_tv":
            return 0.5 * sum(abs(x - y) for x, y in zip(aux, actual))
        if field == "aux_max_over_mean":
            return e * max(aux)
        if field == "actual_max_over_mean":
            return e * max(actual)
        raise KeyError(f"no global router statistic {field!r}")

    def value(self, op: RouterOp) -> float:
        if op.aggregation == "mean":
            return self.mean(op.field)
        if op.aggregation == "global":
            return self.global_value(op.field)
        extreme = self.extremes[op.field]
        return extreme if math.isfinite(extreme) or self.sequences else math.nan


def _normalized(values: list[float]) -> list[float]:
    total = max(sum(values), 1.0)
    return [v / total for v in values]


def _rollup(op: RouterOp, summaries: list[_LayerSummary], bias: bool) -> float:
    """The cross-layer value of ``op``: pooled mean, extreme layer, or mean of layer values."""
    if op.aggregation == "mean":
        counts = sum(s.bias_sequences if op.field in _BIAS_FIELDS else s.sequences for s in summaries)
        return sum(s.field_sums[op.field] for s in summaries) / counts if counts else math.nan
    values = [s.value(op) for s in summaries]
    if op.aggregation == "global":
        return sum(values) / len(values)
    return _nan_extreme(values, smallest=op.aggregation == "min")


def _nan_extreme(values: Sequence[float], *, smallest: bool) -> float:
    if any(v != v for v in values):
        return math.nan
    return min(values) if smallest else max(values)


class RouterHealth(_RouterFamily):
    """Compact router health: cross-layer roll-up and worst layer of the sequence aux loss and
    its imbalances, the whole-batch loss and its gap to the sequence loss, the whole-batch
    load extremes and the top-k boundary margin. Balanced: losses and max-over-mean 1,
    imbalances and gap 0; a larger margin is healthier. Megatron-LM's ``layer-router-health``."""

    per_layer = False
    worst_layer = True
    formula = "roll-up and worst layer of E sum a_i s_i, E sum (x_i - 1/E)^2, top-k margins"
    ops = (
        RouterOp("seq-loss", "seq_aux_loss", "mean"),
        RouterOp("seq-assignment-imbalance", "aux_load_imbalance", "mean"),
        RouterOp("seq-score-imbalance", "score_imbalance", "mean"),
        RouterOp("global-batch-loss", "global_batch_aux_loss", "global"),
        RouterOp("seq-global-loss-gap", "seq_global_aux_loss_gap", "global"),
        RouterOp("global-aux-max-over-mean", "aux_max_over_mean", "global"),
        RouterOp("global-actual-imbalance", "actual_load_imbalance", "global"),
        RouterOp("global-actual-max-over-mean", "actual_max_over_mean", "global"),
        RouterOp("topk-boundary-relative-margin", "topk_boundary_relative_margin", "mean", worst_is_min=True),
    )


class SeqAuxDecomposition(_RouterFamily):
    """The sequence aux loss ``E sum a_i s_i = 1 + coupling`` split into assignment imbalance,
    score imbalance, their coupling and alignment. Megatron-LM's
    ``layer-router-seq-aux-decomposition``."""

    formula = "E sum a_i s_i = 1 + E sum (a_i - 1/E)(s_i - 1/E); E sum (a_i - 1/E)^2; E sum (s_i - 1/E)^2"
    ops = (
        RouterOp("loss-mean", "seq_aux_loss", "mean"),
        RouterOp("loss-max", "seq_aux_loss", "max"),
        RouterOp("assignment-imbalance-mean", "aux_load_imbalance", "mean"),
        RouterOp("score-imbalance-mean", "score_imbalance", "mean"),
        RouterOp("imbalance-coupling-mean", "imbalance_coupling", "mean"),
        RouterOp("imbalance-alignment-mean", "imbalance_alignment", "mean"),
    )


class RoutingBalance(_RouterFamily):
    """Unbiased (aux) assignments against dispatched ones: imbalance, total variation, top-k
    overlap, max-over-mean and inactive experts, per sequence and for the whole batch.
    Megatron-LM's ``layer-router-routing-balance``."""

    formula = "E sum (c_i - 1/E)^2; 1/2 sum |a_i - c_i|; overlap of top-k sets; E max c"
    ops = (
        RouterOp("actual-imbalance-mean", "actual_load_imbalance", "mean"),
        RouterOp("actual-imbalance-max", "actual_load_imbalance", "max"),
        RouterOp("aux-actual-tv-mean", "aux_actual_tv", "mean"),
        RouterOp("topk-overlap-mean", "aux_actual_overlap", "mean"),
        RouterOp("topk-overlap-min", "aux_actual_overlap", "min"),
        RouterOp("aux-max-over-mean", "aux_max_over_mean", "mean"),
        RouterOp("actual-max-over-mean", "actual_max_over_mean", "mean"),
        RouterOp("actual-inactive-fraction", "actual_inactive_fraction", "mean"),
        RouterOp("global-actual-imbalance", "actual_load_imbalance", "global"),
        RouterOp("global-aux-actual-tv", "aux_actual_tv", "global"),
        RouterOp("global-aux-max-over-mean", "aux_max_over_mean", "global"),
        RouterOp("global-actual-max-over-mean", "actual_max_over_mean", "global"),
    )


class ExpertBias(_RouterFamily):
    """The aux-loss-free expert bias (DeepSeek-V3, Wang et al. 2024) and how it relates to router
    preference and load: mean, std, RMS, range and max |b|, and its correlations with the mean
    scores, unbiased and dispatched loads. A bias that tracks load (negative correlation with
    scores) is doing its job. Layers without an ``expert_bias`` site, or without routed tokens in
    the step, report nothing.
    Megatron-LM's ``layer-router-expert-bias``."""

    needs_bias = True
    formula = "mean, std, rms, range, max |b| of b; corr(b, s), corr(b, a), corr(b, c) across experts"
    ops = (
        RouterOp("mean", "bias_mean", "mean"),
        RouterOp("std", "bias_std", "mean"),
        RouterOp("rms", "bias_rms", "mean"),
        RouterOp("range", "bias_range", "mean"),
        RouterOp("abs-max", "bias_abs_max", "mean"),
        RouterOp("score-correlation", "bias_score_correlation", "mean"),
        RouterOp("aux-load-correlation", "bias_aux_load_correlation", "mean"),
        RouterOp("actual-load-correlation", "bias_actual_load_correlation", "mean"),
    )
