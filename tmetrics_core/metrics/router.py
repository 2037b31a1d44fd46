"""MoE router metrics, the core: tokens per expert, load imbalance, dead experts, z-loss and
decision entropy.

Router sites, per MoE layer (all token sites flattened to ``[tokens, ...]`` with padding removed,
population-split across ``dp``/``ep``/..., ``Owned`` on ``pp``):

- ``router_logits`` ``[tokens, E]``: pre-softmax logits (E = ``Site.num_experts``, global);
- ``router_scores`` ``[tokens, E]``: post-softmax/sigmoid probabilities, when the model exposes
  them; otherwise metrics take ``softmax(router_logits)``;
- ``router_topk`` ``[tokens, k]`` int64: the global expert ids each token was dispatched to;
- ``expert_bias`` ``[E]``: the aux-loss-free balancing bias (DeepSeek-V3), when present.

The diagnostic families over whole sequences (``layer-router-health`` and its kin) are
:mod:`~tmetrics_core.metrics.router_families`, their per-sequence statistics
:mod:`~tmetrics_core.metrics.router_sequences`; both read the sites through :func:`site_experts`
and :func:`check_router_rows` of this module.
"""

from __future__ import annotations

import math

import torch

from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.softmax import RowSoftmax, RowSoftmaxMetric
from tmetrics_core.metrics.statistics import Statistic
from tmetrics_core.site import Site

__all__ = [
    "DeadExperts",
    "DecisionEntropy",
    "ExpertCounts",
    "ExpertLoadImbalance",
    "ExpertTokens",
    "RouterZLoss",
    "check_router_rows",
    "site_experts",
]


def site_experts(site: Site) -> int:
    if not site.num_experts or site.num_experts < 1:
        raise PlacementError(
            f"router site {site.describe()} has no num_experts; the router source must set "
            "Site.num_experts to the global expert count"
        )
    return site.num_experts


def check_router_rows(site: Site, metric: str, *, allow_class_split: bool) -> None:
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
        return site_experts(site)

    def check(self, site, topology):
        site_experts(site)
        check_router_rows(site, self.name, allow_class_split=False)

    def compute(self, tensors, sites, topology, rows):
        out = []
        for ids, site in zip(tensors, sites):
            experts = site_experts(site)
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
        check_router_rows(site, self.name, allow_class_split=True)
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
        check_router_rows(site, self.name, allow_class_split=True)
        super().check(site, topology)

    def kept(self, sites):
        """Scores where a layer has them, logits otherwise (never both for one layer)."""
        scored = {s.layer for s in sites if s.kind == "router_scores"}
        return [i for i, s in enumerate(sites) if s.kind == "router_scores" or s.layer not in scored]

    def from_rows(self, sums):
        return sums["normalized_entropy"] / sums["rows"] if sums["rows"] else math.nan
