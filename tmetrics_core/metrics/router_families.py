"""The router diagnostic families: ``layer-router-health``, ``-routing-balance``,
``-seq-aux-decomposition`` and ``-expert-bias``, after the Megatron-LM tensor metrics.

Each reads one joint summary per layer (:func:`~tmetrics_core.metrics.router_sequences.layer_summary`:
the per-sequence statistics and their definitions are there), shared by the four families.

Aggregations: ``mean``/``max``/``min`` over the sequences of a layer (of all ranks and
micro-batches), and ``global``: the same formula on the layer's whole-batch distributions (summed
scores, summed assignment counts). Each family reports per layer and a cross-layer roll-up
(``layer`` unset): means pool every sequence of every layer, max/min take the extreme layer,
``global`` values average the per-layer values; ``layer-router-health`` reports only the roll-up
and, as ``worst-layer-<op>``, the worst layer's value (largest, or smallest for the margin).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.base import MetricResult, StatMetric
from tmetrics_core.metrics.router import check_router_rows, site_experts
from tmetrics_core.metrics.router_sequences import (
    BIAS_FIELDS,
    ROUTER_EXTREMES,
    ROUTER_SUMS,
    LayerSummary,
    RouterOp,
    layer_summary,
)
from tmetrics_core.metrics.statistics import neutral
from tmetrics_core.site import Site

__all__ = [
    "CONTEXT_AXES",
    "ExpertBias",
    "RouterHealth",
    "RoutingBalance",
    "SeqAuxDecomposition",
]

ROUTER_KINDS = frozenset({"router_logits", "router_scores", "router_topk", "expert_bias"})
CONTEXT_AXES = frozenset({"cp"})
"""Axes that cut sequences (context parallelism) although they split tokens."""


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
            site_experts(site)
            if site.num_experts < 2:  # type: ignore[operator]
                raise PlacementError(f"{self.name}: needs at least 2 experts; got {site.describe()}")
        check_router_rows(site, self.name, allow_class_split=False)
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
                                               seq_len, site_experts(topk_site))  # type: ignore[arg-type]
                memo[(ROUTER_SUMS.name, topk_site.key)] = sums
                memo[(ROUTER_EXTREMES.name, topk_site.key)] = extremes
            state[topk_site.key] = [memo[(s.name, topk_site.key)] for s in self.statistics]
        return state

    def finish(self, continuation, host):
        groups, _ = self.grouped(continuation, host)
        per_layer: dict[Any, Mapping[str, list[float]]] = {gkey[0]: stats for gkey, stats in groups.items()}
        layers = sorted(per_layer, key=lambda v: (v is None, v))
        summaries = {layer: LayerSummary(per_layer[layer]) for layer in layers}
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



def _rollup(op: RouterOp, summaries: list[LayerSummary], bias: bool) -> float:
    """The cross-layer value of ``op``: pooled mean, extreme layer, or mean of layer values."""
    if op.aggregation == "mean":
        counts = sum(s.bias_sequences if op.field in BIAS_FIELDS else s.sequences for s in summaries)
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
