"""Norm-like metrics on parameters, gradients, optimizer state and activations.

Each class is a :class:`~tmetrics_core.metrics.base.StatMetric`: the statistics it needs and a
``finalize``. Scope (global, layer, tensor, family) and source kinds are set per catalogue
entry, so ``layer-grad-l2`` and ``global-param-l2`` are the same class with other settings.
Across ranks every statistic is reduced over the axes that split the tensor (Shard,
FlatShard, Owned) and never over Replica axes, so a replicated tensor counts once.
"""

from __future__ import annotations

import math

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.statistics import (
    ABSMAX,
    COUNT,
    MAX,
    MIN,
    NONFINITE,
    SUM,
    SUMSQ,
    ZEROS,
    flagged_value,
)
from tmetrics_core.metrics.row_l2 import RowL2

__all__ = ["AbsMax", "L2Norm", "Max", "Mean", "MeanLineL2", "Min", "NonFinite", "Rms", "ZeroFraction"]


class L2Norm(StatMetric):
    """``sqrt(sum of x**2)`` over every element of the group's tensors (units of x).

    Over a global gradient group this equals ``torch.nn.utils.clip_grad_norm_``'s total norm.
    """

    statistics = (SUMSQ,)
    formula = "sqrt(sum_i x_i^2) over the group's elements"

    def finalize(self, stats):
        return math.sqrt(stats["sumsq"][0])


class Rms(StatMetric):
    """``sqrt(sum x**2 / N)``: an L2 norm that does not grow with the element count."""

    statistics = (SUMSQ, COUNT)
    formula = "sqrt(sum_i x_i^2 / N)"

    def finalize(self, stats):
        n = stats["count"][0]
        # No element read on any rank (a layer without a gradient): no record, not a NaN that
        # the non-finite alert would take for a diverged run.
        return math.sqrt(stats["sumsq"][0] / n) if n else None


class AbsMax(StatMetric):
    """``max |x|`` over the group (NaN if any element is NaN)."""

    statistics = (ABSMAX,)
    formula = "max_i |x_i|"

    def finalize(self, stats):
        if stats["absmax"][1] == -math.inf:
            return None  # every tensor a placeholder (no gradient on any rank): no record, not -inf
        return flagged_value(stats["absmax"])


class Max(StatMetric):
    """Largest element of the group."""

    statistics = (MAX,)
    formula = "max_i x_i"

    def finalize(self, stats):
        return flagged_value(stats["max"])


class Min(StatMetric):
    """Smallest element of the group."""

    statistics = (MIN,)
    formula = "min_i x_i"

    def finalize(self, stats):
        return flagged_value(stats["min"])


class Mean(StatMetric):
    """Mean element of the group: ``sum x / N``."""

    statistics = (SUM, COUNT)
    formula = "sum_i x_i / N"

    def finalize(self, stats):
        n = stats["count"][0]
        return stats["sum"][0] / n if n else None  # nothing read on any rank: no record


class MeanLineL2(StatMetric):
    """Mean L2 norm of the rows (``dim=0``) or columns (``dim=1``) of 2-D tensors.

    Two stages across ranks: per-line sums of squares are summed over the axes that cut lines,
    square-rooted, then the line norms are averaged over the line population of the group
    (every row of every tensor of the group weighs the same).
    """

    formula = "mean over lines l of sqrt(sum_j x_lj^2)"

    def __init__(self, *, dim: int = 0, **kwargs) -> None:
        self.statistics = (RowL2(dim),)
        super().__init__(**kwargs)

    def accepts(self, site):
        """Only matrices and wider tensors (vectors such as norm weights have no rows)."""
        return len(site.logical_shape) >= 2 and super().accepts(site)

    def finalize(self, stats):
        (total, lines), = [stats[s.name] for s in self.statistics]
        return total / lines if lines else float("nan")


class NonFinite(StatMetric):
    """Counts of NaN, +Inf and -Inf elements (exact integers), as stats ``nan``, ``posinf``,
    ``neginf`` and ``total``.

    Local work rides on the rows that L2 and RMS metrics share through the step memo
    (see ``NONFINITE``: on CPU a finite sum of squares proves a tensor finite; elsewhere the
    counts are batched on the device).
    """

    statistics = (NONFINITE,)
    formula = "#{x_i = NaN}, #{x_i = +Inf}, #{x_i = -Inf}"

    def finalize(self, stats):
        nan, pos, neg = stats["nonfinite"]
        return {"nan": nan, "posinf": pos, "neginf": neg, "total": nan + pos + neg}


class ZeroFraction(StatMetric):
    """Fraction of elements exactly zero (dead units, pruned weights, vanished gradients)."""

    statistics = (ZEROS, COUNT)
    formula = "#{x_i = 0} / N"

    def finalize(self, stats):
        n = stats["count"][0]
        return stats["zeros"][0] / n if n else None  # nothing read on any rank: no record
