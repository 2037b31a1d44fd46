"""Per-tensor statistics: the local contributions that metrics reduce across ranks.

A :class:`Statistic` turns each local tensor into a small 1-D float64 vector whose entries
merge across ranks and across tensors with one reduce op (``sum``, ``max`` or ``min``), and
says over which axes of a site the vector must be reduced. Several metrics that need the same
statistic of the same site share one computation and one slot in the packed collective.

A statistic declares what it reads: :attr:`Statistic.reads`, the columns of the rows
(:func:`tmetrics_core.kernels.rows.rows`: sum of squares, sum, extremes, zero count, one batched
pass for every statistic of a call), and :attr:`Statistic.elements`, whether it also reads the
tensors' elements itself. It has one method, :meth:`Statistic.compute`, given the tensors and
those rows. Rows accumulate in float64 on CPU and for float64 tensors, in float32 on
accelerators, and are carried in float64, so bf16 or fp16 tensors never overflow or lose the sum.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.kernels.rows import element_counts, nonfinite_counts
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey

__all__ = [
    "ABSMAX",
    "COUNT",
    "MAX",
    "MIN",
    "NEUTRAL",
    "NONFINITE",
    "SUM",
    "SUMSQ",
    "ZEROS",
    "flagged_value",
    "Stage",
    "Statistic",
    "neutral",
]

NEUTRAL = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
"""The neutral element of each reduction."""


def neutral(op: ReduceOpName, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float64 vector of ``size`` neutral elements of ``op`` (0, -inf or +inf)."""
    return torch.full((size,), NEUTRAL[op], dtype=torch.float64, device=device)


@dataclass(frozen=True, slots=True)
class Stage:
    """One reduction of a statistic: reduce the vector with ``op`` over ``axes`` (in topology
    order). ``size`` is the vector length, derived from rank-symmetric site metadata."""

    axes: tuple[str, ...]
    op: ReduceOpName
    size: int


def split_axes(site: Site, topology: Topology, op: ReduceOpName, *, linear: bool) -> tuple[str, ...]:
    """Axes over which a single-stage statistic with reduce op ``op`` must be reduced.

    Shard, FlatShard and Owned axes are reduced; Replica axes are not (each value counted
    once). A ``Partial(p)`` axis is reduced when the statistic commutes with it (``linear``
    statistics under ``Partial(sum)`` with op ``sum``; ``max``/``min`` under ``Partial`` of the same
    op); otherwise the tensor must be materialized first (see ``needs_materialize``).
    """
    axes = []
    for name in topology.names:
        p = site.placement(name)
        if topology.axes[name].size == 1:
            continue
        if p.splits() or (p.is_partial() and commutes(p.op, op, linear=linear)):  # type: ignore[attr-defined]
            axes.append(name)
    return tuple(axes)


def commutes(partial_op: str, op: ReduceOpName, *, linear: bool) -> bool:
    """Whether a statistic with merge ``op`` can be reduced directly over ``Partial(partial_op)``."""
    return linear and partial_op == op


class Statistic:
    """Base of statistics. Subclasses set ``name``, ``op``, ``linear``, declare what they read
    (:attr:`reads`, :attr:`elements`) and implement :meth:`compute`; multi-stage ones also
    override :meth:`stages` and :meth:`between`, and one whose observations do not merge by
    ``op`` overrides :meth:`merge`."""

    name: str = ""
    op: ReduceOpName = "sum"
    linear: bool = False
    """True when the local value is the statistic's own op applied to the elements (a sum of
    elements, a maximum, a minimum), so a ``Partial`` of that same op needs no materialization.
    A count, a sum of squares or an absolute maximum is not: of a partial tensor they are wrong."""
    reads: frozenset[str] = frozenset()
    """The row columns :meth:`compute` reads (names of
    :data:`tmetrics_core.kernels.rows.COLUMNS`; ``absmax``: ``max`` and ``min`` only as
    ``max(max, -min)``). The rows of a call's tensors are computed once, with the columns every
    statistic of the call declares (the others may be NaN), and given to :meth:`compute`;
    empty: the statistic reads no rows (it is given None)."""
    elements: bool = True
    """True when :meth:`compute` may read the tensors' elements beyond the rows (exact non-finite
    counts, row norms, histograms). False for a statistic of the rows and the shape alone: then a
    tensor of the same shape (even one not holding those values) may stand in for each tensor."""

    between_agreed: bool = False
    """Declares that :meth:`between` raises on every rank alike or never (it reads only shapes
    every rank shares); single-stage statistics never call it. See ``StatMetric.resume_agreed``."""

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        """The reductions of this statistic for ``site``: a single stage by default."""
        return (Stage(split_axes(site, topology, self.op, linear=self.linear), self.op, self.size(site)),)

    def size(self, site: Site) -> int:
        """Length of the local vector (1 by default)."""
        return 1

    def compute(self, tensors: Sequence[torch.Tensor], sites: Sequence[Site], topology: Topology,
                rows: torch.Tensor | None) -> torch.Tensor | list[torch.Tensor]:
        """The first stage's float64 vectors of ``tensors`` (local tensors of ``sites``): a
        ``[len(tensors), size]`` matrix, row ``i`` the vector of tensor ``i``, or a list of one
        vector per tensor (where their lengths differ). ``rows``: float64 ``[len(tensors), 5]``
        rows of the same tensors (:func:`tmetrics_core.kernels.rows.rows`), at least the columns
        of :attr:`reads`, on the tensors' device; None when :attr:`reads` is empty."""
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def merge(self, key: SiteKey, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The vector of site ``key`` for two observations of one step (micro-batches), ``x``
        and ``y``: their ``op`` elementwise by default. Never changes either in place."""
        if self.op == "sum":
            return x + y
        return torch.maximum(x, y) if self.op == "max" else torch.minimum(x, y)

    def between(self, index: int, vector: torch.Tensor, site: Site, topology: Topology) -> torch.Tensor:
        """Turn the reduced vector of stage ``index`` into the local vector of stage ``index+1``."""
        raise NotImplementedError(f"{type(self).__name__} has one stage")

    def placeholder(self, site: Site, topology: Topology) -> torch.Tensor:
        """The first stage's vector for a tensor this rank does not read (held elsewhere, or a
        parameter without a gradient): the neutral element of its reduction, so it adds
        nothing (float64, the first stage's size)."""
        first = self.stages(site, topology)[0]
        return neutral(first.op, first.size)

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        """Whether stage ``index``'s vector has the same length on EVERY rank of the topology,
        not only on the ranks that reduce it together (then requests over different axes can
        share one collective). True for single-stage statistics, whose length ``size(site)``
        sees no rank; statistics with their own stages say so themselves (default False)."""
        return type(self).stages is Statistic.stages

    def check(self, site: Site, topology: Topology) -> None:
        """Raise :class:`PlacementError` at configuration time if ``site`` cannot be handled."""

    def __repr__(self) -> str:
        return f"<statistic {self.name}>"


class _SumSq(Statistic):
    """Sum of squares of the elements, carried in float64 (the rows' accumulation: float64 on
    CPU and for float64 tensors, float32 on accelerators, where a float32 square overflows above
    1.8e19)."""

    name, op, elements = "sumsq", "sum", False
    reads = frozenset({"sumsq"})

    def compute(self, tensors, sites, topology, rows):
        return rows[:, 0:1]


class _AbsMax(Statistic):
    """``[largest absolute value, NaN flag]`` (0 for an empty tensor).

    NOTE [NaN under MAX]: gloo's (and NCCL's) MAX and MIN keep a NaN only when it comes first,
    so a NaN on one shard could vanish in the reduction. Extreme statistics therefore carry
    the NaN as a flag reduced with the same op (here 1.0 when NaN is present, else 0.0) and
    the value without it; metrics report NaN when the flag is set (:func:`flagged_value`).
    """

    name, op, elements = "absmax", "max", False
    reads = frozenset({"sumsq", "absmax"})  # the sum of squares carries the NaN flag

    def size(self, site):
        return 2

    def compute(self, tensors, sites, topology, rows):
        return _flagged_rows(rows, torch.maximum(rows[:, 2:3], -rows[:, 3:4]).clamp_min_(0.0), 0.0, 1.0)


def _flagged_rows(rows: torch.Tensor, value: torch.Tensor, neutral_value: float, flag: float) -> torch.Tensor:
    """``[n, 2]`` from rows and an extreme ``value`` ``[n, 1]`` derived from them: ``[value, 0]``
    per tensor, or ``[neutral_value, flag]`` for a tensor holding a NaN (its sum of squares is
    NaN; ``value`` is then not read)."""
    nan = torch.isnan(rows[:, 0:1])
    flags = nan.to(rows.dtype) if flag == 1.0 else torch.where(nan, flag, 0.0).to(rows.dtype)
    return torch.cat([value.masked_fill(nan, neutral_value), flags], 1)


def flagged_value(vector: Sequence[float]) -> float:
    """The value of an extreme statistic ``[value, flag]``: NaN when the flag is set."""
    return math.nan if vector[1] not in (0.0, -math.inf, math.inf) else vector[0]


class _Count(Statistic):
    """Number of elements (float64: exact below 2**53); reads the shapes alone."""

    name, op, elements = "count", "sum", False

    def compute(self, tensors, sites, topology, rows):
        device = tensors[0].device if tensors else torch.device("cpu")
        return _count_column(tuple(map(torch.Tensor.numel, tensors)), device)


@functools.lru_cache(maxsize=256)
def _count_column(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[len(numels), 1]`` view of :func:`~tmetrics_core.kernels.rows.element_counts`, made once
    per list of sizes (no op on later due steps). Read only."""
    return element_counts(numels, device).unsqueeze(1)


class _Sum(Statistic):
    """Sum of the elements, for means: float64 accumulation on CPU, fp32 on accelerators
    (float64 for float64 tensors); the ``p=1`` norm of the positive parts less that of the
    negative parts (:func:`tmetrics_core.kernels.rows.rows`)."""

    name, op, linear, elements = "sum", "sum", True, False
    reads = frozenset({"sum"})

    def compute(self, tensors, sites, topology, rows):
        return rows[:, 1:2]


class _Max(Statistic):
    """``[largest element, NaN flag]`` (``[-inf, 0]`` for an empty tensor; flag as in ``_AbsMax``)."""

    name, op, linear, elements = "max", "max", True, False
    reads = frozenset({"sumsq", "max"})

    def size(self, site):
        return 2

    def compute(self, tensors, sites, topology, rows):
        return _flagged_rows(rows, rows[:, 2:3], -math.inf, 1.0)


class _Min(Statistic):
    """``[smallest element, -NaN flag]`` (``[inf, 0]`` for an empty tensor; the flag is -1.0 when NaN
    is present, so the MIN reduction keeps it)."""

    name, op, linear, elements = "min", "min", True, False
    reads = frozenset({"sumsq", "min"})

    def size(self, site):
        return 2

    def compute(self, tensors, sites, topology, rows):
        return _flagged_rows(rows, rows[:, 3:4], math.inf, -1.0)


class _NonFinite(Statistic):
    """``[nan count, +inf count, -inf count]`` (integer tensors count 0).

    On CPU, where reading a value costs no synchronisation, a finite sum of squares in the rows
    (shared with the norms) proves every tensor finite: zeros. Elsewhere, and when some sum is
    not finite, exact counts of every tensor by a fixed number of batched ops
    (:func:`~tmetrics_core.kernels.rows.nonfinite_counts`), nothing read back.
    """

    name, op = "nonfinite", "sum"
    reads = frozenset({"sumsq"})

    def size(self, site):
        return 3

    def compute(self, tensors, sites, topology, rows):
        if rows.device.type == "cpu" and bool(torch.isfinite(rows[:, 0]).all()):
            return torch.zeros((len(tensors), 3), dtype=torch.float64)
        return nonfinite_counts(tensors[:]).to(rows.device)


class _Zeros(Statistic):
    """Number of elements exactly equal to zero (``-0.0`` included)."""

    name, op, elements = "zeros", "sum", False
    reads = frozenset({"zeros"})

    def compute(self, tensors, sites, topology, rows):
        return rows[:, 4:5]


SUMSQ: Statistic = _SumSq()
ABSMAX: Statistic = _AbsMax()
COUNT: Statistic = _Count()
SUM: Statistic = _Sum()
MAX: Statistic = _Max()
MIN: Statistic = _Min()
NONFINITE: Statistic = _NonFinite()
ZEROS: Statistic = _Zeros()

