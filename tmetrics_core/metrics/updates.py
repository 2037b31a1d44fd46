"""Optimizer-side metrics: the relative size of a step and the scale of Adam's state.

Both combine source kinds of the same layer, read per kind from the group's statistics
(``stats["update:sumsq"]``...). Parameters, updates and optimizer state carry their tensors'
placements, so each sum of squares counts every element once across Shard, FlatShard (ZeRO)
and Owned (EP, PP) layouts and never twice across Replica axes.
"""

from __future__ import annotations

import math

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.site import FROZEN
from tmetrics_core.metrics.statistics import COUNT, SUMSQ

__all__ = ["OptimizerStateRms", "UpdateRatio"]


class UpdateRatio(StatMetric):
    """Relative update size per layer: ``||Δθ|| / ||θ||`` (dimensionless).

    ``Δθ`` is the ``update`` site (parameter after the optimizer step minus before it, on due
    steps) and ``θ`` the ``param`` site of the same tensor at the same step (after the step).
    Both norms run over the layer's trainable tensors the metric selects: a frozen tensor
    (``requires_grad`` False on every rank, as LoRA's base weights) is left out of ``||θ||``
    too, and a layer with no trainable tensor writes no record; a trainable tensor the
    optimizer did not step (no gradient this step) counts, with an update of 0. Narrow them
    with ``select:``. ``inf`` when ``||θ|| = 0`` and the update is not, NaN when both are 0.

    Healthy training typically shows about 1e-3 per step for Adam (learning rate scale);
    much larger ratios signal instability, much smaller ones a stalled layer.
    """

    statistics = (SUMSQ,)
    source_kinds = frozenset({"update", "param"})
    scope = "layer"
    formula = "sqrt(sum_i Δθ_i^2) / sqrt(sum_i θ_i^2) over the layer's updated tensors"

    def kept(self, sites):
        """The ``update`` and ``param`` sites of the trainable tensors (not :data:`FROZEN`)."""
        updated = {s.name for s in sites if s.kind == "update" and s.meta != FROZEN}
        return [i for i, s in enumerate(sites) if s.name in updated]

    def finalize(self, stats):
        update = stats.get("update:sumsq", [0.0])[0]
        param = stats.get("param:sumsq", [0.0])[0]
        if param == 0.0:
            return math.nan if update == 0.0 else math.inf
        return math.sqrt(update / param)


class OptimizerStateRms(StatMetric):
    """RMS of Adam's moment estimates per layer, one stat per kind present:
    ``exp_avg`` (first moment, units of the gradient) and ``exp_avg_sq`` (second moment, units
    of the gradient squared): ``sqrt(sum m_i^2 / N)`` over the layer's state elements.

    ``exp_avg_sq`` near 0 with a non-zero ``exp_avg`` makes Adam's step explode; a collapsing
    ``exp_avg`` means gradients vanished.
    """

    statistics = (SUMSQ, COUNT)
    source_kinds = frozenset({"exp_avg", "exp_avg_sq"})
    scope = "layer"
    formula = "sqrt(sum_i m_i^2 / N) for m in {exp_avg, exp_avg_sq}"

    def finalize(self, stats):
        out = {}
        for kind in ("exp_avg", "exp_avg_sq"):
            n = stats.get(f"{kind}:count", [0])[0]
            if n:  # no state read on any rank (no step yet, no gradient): no stat, not NaN
                out[kind] = math.sqrt(stats[f"{kind}:sumsq"][0] / n)
        return out or None
