"""Per-tensor statistics: the local contributions that metrics reduce across ranks.

A :class:`Statistic` turns each local tensor into a small 1-D float64 vector whose entries
merge across ranks and across tensors with one reduce op (``sum``, ``max`` or ``min``), and
says over which axes of a site the vector must be reduced. Several metrics that need the same
statistic of the same site share one computation and one slot in the packed collective.

Local work is batched: :meth:`Statistic.compute` gets every local tensor of a step at once and
uses ``torch._foreach_*`` kernels where they exist. Low-precision inputs accumulate in fp32
(the ``dtype=`` of ``_foreach_norm``/``_foreach_powsum``) and results are carried in float64,
so bf16 or fp16 tensors never overflow or lose the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.errors import PlacementError
from tmetrics_core.kernels.foreach_moments import foreach_rows, nonfinite_counts
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site

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
    "RowL2",
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
    """Base of statistics. Subclasses set ``name``, ``op``, ``linear`` and implement
    :meth:`compute`; multi-stage ones also override :meth:`stages` and :meth:`between`."""

    name: str = ""
    op: ReduceOpName = "sum"
    linear: bool = False
    """True when the local value is the statistic's own op applied to the elements (a sum of
    elements, a maximum, a minimum), so a ``Partial`` of that same op needs no materialization.
    A count, a sum of squares or an absolute maximum is not: of a partial tensor they are wrong."""
    moments: bool = False
    """True when :meth:`from_moments` derives the vectors from the fused one-pass moments
    (``tmetrics_core.kernels.moments``), so statistics of one tensor share a single read."""
    shape_only: bool = False
    """True when the vectors depend on the tensor's shape alone (no element is read)."""
    reads_elements: bool = False
    """True when :meth:`from_moments` may still read elements of the tensor (exact counts of
    non-finite values): such a statistic needs the tensor itself, not a stand-in of its shape."""
    reads_sumsq_only: bool = False
    """True when :meth:`from_moments` reads the sum-of-squares column of the moments rows and no
    other: kernel calls whose statistics all read at most that column compute it alone (see
    :func:`tmetrics_core.kernels.moments.sumsq_suffices`)."""
    reads: frozenset[str] = frozenset({"sumsq", "sum", "max", "min", "zeros"})
    """The moments columns :meth:`moments_matrix` reads (names of
    :data:`tmetrics_core.kernels.foreach_moments.COLUMNS`; ``absmax``: ``max`` and ``min`` only
    as ``max(max, -min)``). A moments pass computes only the columns its statistics declare;
    the others may be NaN. Every column by default (a statistic that does not say)."""

    between_agreed: bool = False
    """Declares that :meth:`between` raises on every rank alike or never (it reads only shapes
    every rank shares); single-stage statistics never call it. See ``StatMetric.resume_agreed``."""

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        """The reductions of this statistic for ``site``: a single stage by default."""
        return (Stage(split_axes(site, topology, self.op, linear=self.linear), self.op, self.size(site)),)

    def size(self, site: Site) -> int:
        """Length of the local vector (1 by default)."""
        return 1

    def compute(self, tensors: Sequence[torch.Tensor], sites: Sequence[Site],
                topology: Topology) -> list[torch.Tensor]:
        """Float64 vectors of the first stage's size, one per local tensor."""
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def from_moments(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Float64 vectors (as :meth:`compute`) from ``[len(tensors), 5]`` moments rows
        (sum of squares, sum, NaN-skipping max and min, zero count) of the same tensors."""
        return list(self.moments_matrix(rows, tensors).unbind(0))

    def moments_matrix(self, rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`from_moments` as one float64 ``[len(tensors), size]`` matrix, row ``i`` the
        vector of tensor ``i`` (for statistics that read no element: ``moments`` and not
        ``reads_elements``, or ``shape_only``)."""
        raise NotImplementedError(f"{type(self).__name__} does not derive from moments")

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
    """Sum of squares of the elements, carried in float64: through the fused moments kernel
    (float64 accumulation) where it applies; else by ``_foreach_powsum`` accumulating in float64
    on CPU and for float64 tensors, in float32 on accelerators (where a float32 square
    overflows above 1.8e19)."""

    name, op, moments, reads_sumsq_only = "sumsq", "sum", True, True
    reads = frozenset({"sumsq"})

    def moments_matrix(self, rows, tensors):
        return rows[:, 0:1]

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


class _AbsMax(Statistic):
    """``[largest absolute value, NaN flag]`` (0 for an empty tensor).

    NOTE [NaN under MAX]: gloo's (and NCCL's) MAX and MIN keep a NaN only when it comes first,
    so a NaN on one shard could vanish in the reduction. Extreme statistics therefore carry
    the NaN as a flag reduced with the same op (here 1.0 when NaN is present, else 0.0) and
    the value without it; metrics report NaN when the flag is set (:func:`flagged_value`).
    """

    name, op, moments = "absmax", "max", True
    reads = frozenset({"sumsq", "absmax"})  # the sum of squares carries the NaN flag

    def size(self, site):
        return 2

    def moments_matrix(self, rows, tensors):
        return _flagged_rows(rows, torch.maximum(rows[:, 2:3], -rows[:, 3:4]).clamp_min_(0.0), 0.0, 1.0)

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


def _flagged_rows(rows: torch.Tensor, value: torch.Tensor, neutral_value: float, flag: float) -> torch.Tensor:
    """``[n, 2]`` from moments rows and an extreme ``value`` ``[n, 1]`` derived from them:
    ``[value, 0]`` per tensor, or ``[neutral_value, flag]`` for a tensor holding a NaN (its sum of
    squares is NaN; the kernel's maximum and minimum skip NaN, so ``value`` itself is not)."""
    nan = torch.isnan(rows[:, 0:1])
    flags = nan.to(rows.dtype) if flag == 1.0 else torch.where(nan, flag, 0.0).to(rows.dtype)
    return torch.cat([value.masked_fill(nan, neutral_value), flags], 1)


def _via_rows(stat: Statistic, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``stat``'s vectors of ``tensors`` from the moments rows of batched torch ops
    (:func:`~tmetrics_core.kernels.foreach_moments.foreach_rows`, the columns ``stat`` reads):
    the numbers the parameter program computes for the same tensors, bit for bit."""
    if not tensors:
        return []
    return list(stat.moments_matrix(foreach_rows(tensors, stat.reads), tensors).unbind(0))


def flagged_value(vector: Sequence[float]) -> float:
    """The value of an extreme statistic ``[value, flag]``: NaN when the flag is set."""
    return math.nan if vector[1] not in (0.0, -math.inf, math.inf) else vector[0]


class _Count(Statistic):
    """Number of elements (float64: exact below 2**53)."""

    name, op, shape_only = "count", "sum", True
    reads: frozenset[str] = frozenset()

    def moments_matrix(self, rows, tensors):
        """The element counts (the rows are not read), on the rows' device."""
        return torch.tensor([[float(t.numel())] for t in tensors], dtype=torch.float64, device=rows.device)

    def compute(self, tensors, sites, topology):
        if all(t.device.type == "cpu" for t in tensors):
            return list(torch.tensor([[float(t.numel())] for t in tensors], dtype=torch.float64).unbind(0))
        # torch.full is a device kernel; torch.tensor(..., device=) would copy from the host.
        return [torch.full((1,), float(t.numel()), dtype=torch.float64, device=t.device) for t in tensors]


class _Sum(Statistic):
    """Sum of the elements, for means: float64 accumulation in the fused kernel and on CPU,
    fp32 on accelerators (float64 for float64 tensors); in batched ops the ``p=1`` norm of the
    positive parts less that of the negative parts (``foreach_moments``)."""

    name, op, linear, moments = "sum", "sum", True, True
    reads = frozenset({"sum"})

    def moments_matrix(self, rows, tensors):
        return rows[:, 1:2]

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


class _Max(Statistic):
    """``[largest element, NaN flag]`` (``[-inf, 0]`` for an empty tensor; flag as in ``_AbsMax``)."""

    name, op, linear, moments = "max", "max", True, True
    reads = frozenset({"sumsq", "max"})

    def size(self, site):
        return 2

    def moments_matrix(self, rows, tensors):
        return _flagged_rows(rows, rows[:, 2:3], -math.inf, 1.0)

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


class _Min(Statistic):
    """``[smallest element, -NaN flag]`` (``[inf, 0]`` for an empty tensor; the flag is -1.0 when NaN
    is present, so the MIN reduction keeps it)."""

    name, op, linear, moments = "min", "min", True, True
    reads = frozenset({"sumsq", "min"})

    def size(self, site):
        return 2

    def moments_matrix(self, rows, tensors):
        return _flagged_rows(rows, rows[:, 3:4], math.inf, -1.0)

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


class _NonFinite(Statistic):
    """``[nan count, +inf count, -inf count]``.

    From the moments rows' sum of squares (shared with the norms) on CPU, where a finite sum
    proves a tensor finite and reading it costs no synchronisation; elsewhere, and when some sum
    is not finite, exact counts of every tensor by a fixed number of batched ops
    (:meth:`moments_matrix`).
    """

    name, op, moments, reads_elements, reads_sumsq_only = "nonfinite", "sum", True, True, True
    reads = frozenset({"sumsq"})

    def size(self, site):
        return 3

    def moments_matrix(self, rows, tensors):
        """``[n, 3]`` counts from the tensors themselves (``tensors``: those the rows were read
        from). On CPU, where reading a value costs no device synchronisation, zeros when every
        sum of squares is finite; elsewhere the exact counts of every tensor, batched
        (:func:`~tmetrics_core.kernels.foreach_moments.nonfinite_counts`), nothing read back."""
        if rows.device.type == "cpu" and bool(torch.isfinite(rows[:, 0]).all()):
            return torch.zeros((len(tensors), 3), dtype=torch.float64)
        return nonfinite_counts(tensors[:]).to(rows.device)

    def compute(self, tensors, sites, topology):
        floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]
        if len(floating) == len(tensors):
            return _via_rows(self, tensors)
        out = [torch.zeros(3, dtype=torch.float64, device=t.device) for t in tensors]  # integers: none
        for i, vec in zip(floating, _via_rows(self, [tensors[i] for i in floating])):
            out[i] = vec
        return out


class _Zeros(Statistic):
    """Number of elements exactly equal to zero (``-0.0`` included)."""

    name, op, moments = "zeros", "sum", True
    reads = frozenset({"zeros"})

    def moments_matrix(self, rows, tensors):
        return rows[:, 4:5]

    def compute(self, tensors, sites, topology):
        return _via_rows(self, tensors)


SUMSQ: Statistic = _SumSq()
ABSMAX: Statistic = _AbsMax()
COUNT: Statistic = _Count()
SUM: Statistic = _Sum()
MAX: Statistic = _Max()
MIN: Statistic = _Min()
NONFINITE: Statistic = _NonFinite()
ZEROS: Statistic = _Zeros()


class RowL2(Statistic):
    """Two-stage statistic behind the mean row-wise L2 norm of a 2-D (or wider) tensor.

    The tensor is viewed as ``[rows, cols]`` with ``rows = shape[0]`` (``dim=0``) and the rest
    flattened; with ``dim=1`` the roles swap (columns of a ``[rows, cols]`` matrix).
    Stage 1: per-line sums of squares, summed over the axes that cut lines (``Shard`` on the
    other dim, ``FlatShard``); when every rank's line count follows from the site (no
    ``Shard(None)`` population split, no FlatShard), zero-padded to the lines of the largest
    shard (the first, as in ``torch.chunk``), so the vector has one length on every rank.
    Between: ``sqrt`` per local line, then ``[sum of line norms, line count]``. Stage 2: summed
    over the axes that split the line population (``Shard`` on the line dim, ``Owned``).
    Result: ``[sum of L2 norms of lines, number of lines]``.
    With a FlatShard the stage-1 vector spans all lines of its ``logical_shape``, so ranges
    that cut lines are summed exactly.
    """

    op = "sum"
    between_agreed = True

    def __init__(self, dim: int) -> None:
        assert dim in (0, 1), dim
        self.dim = dim
        self.name = "row_l2" if dim == 0 else "column_l2"

    def check(self, site: Site, topology: Topology) -> None:
        if len(site.logical_shape) < 2:
            raise PlacementError(f"{self.name} needs a tensor of 2 or more dims; got {site.describe()}")
        flats = [a for a, p in site.placements if p.is_flat_shard()]
        if len(flats) > 1:
            raise PlacementError(f"{self.name}: at most one FlatShard axis per tensor; got {site.describe()}")

    def _line_shape(self, site: Site, topology: Topology, *, largest: bool = False) -> tuple[int, int]:
        """(lines, line length) of the stage-1 vector space on this rank (``largest``: on the
        rank holding the largest shard, coordinate 0 everywhere)."""
        flat = self._flat(site, topology)
        coords = {} if largest else topology.coords()
        shape = flat.logical_shape if flat is not None else site.local_shape(
            coords, {n: a.size for n, a in topology.axes.items()})
        rows = shape[0]
        cols = 1
        for s in shape[1:]:
            cols *= s
        return (rows, cols) if self.dim == 0 else (cols, rows)

    def _flat(self, site: Site, topology: Topology):
        """The FlatShard placement, if any: the local tensor is then 1-D (even on a 1-rank axis)."""
        for _, p in site.placements:
            if p.is_flat_shard():
                return p
        return None

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        cut, population = [], []
        for name in topology.names:
            p = site.placement(name)
            if topology.axes[name].size == 1 or not p.splits():
                continue
            # A StridedShard splits its dim like a Shard: which entries a rank holds does not
            # matter to a sum over lines.
            split = p.shard_dim() if p.is_shard() or p.is_strided_shard() else -1
            if p.is_flat_shard() or (split != -1 and (split in (0, None)) != (self.dim == 0)):
                cut.append(name)
            else:
                population.append(name)
        lines, _ = self._line_shape(site, topology, largest=self._known_lines(site))
        return (Stage(tuple(cut), "sum", lines), Stage(tuple(population), "sum", 2))

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        return index > 0 or self._known_lines(site)

    @staticmethod
    def _known_lines(site: Site) -> bool:
        """Whether every rank's line count follows from the site: no population split
        (``Shard(None)``), no open dim and no FlatShard (whose logical shape is this rank's
        shard on the other axes), so stage-1 vectors can be padded to one length."""
        open_split = any(p.is_flat_shard() or (p.is_shard() and p.dim is None)  # type: ignore[attr-defined]
                         for _, p in site.placements)
        return all(d >= 0 for d in site.logical_shape) and not open_split

    def compute(self, tensors, sites, topology):
        out = []
        for t, site in zip(tensors, sites):
            flat = self._flat(site, topology)
            lines, length = self._line_shape(site, topology)
            if flat is None:
                m = t.reshape(t.shape[0], math.prod(t.shape[1:]))
                if self.dim == 1:
                    m = m.t()
                sums = torch.linalg.vector_norm(m, dim=1, dtype=torch.float64).square()  # float64: no overflow
                if self._known_lines(site):
                    sums = torch.nn.functional.pad(sums, (0, self._line_shape(site, topology, largest=True)[0] - lines))
                out.append(sums)
                continue
            cols = 1
            for s in flat.logical_shape[1:]:
                cols *= s
            index = torch.arange(flat.start, flat.end, device=t.device)
            index = index // cols if self.dim == 0 else index % cols
            vec = torch.zeros(lines, dtype=torch.float64, device=t.device)
            vec.index_add_(0, index, t.reshape(-1).double().pow(2))
            out.append(vec)
        return out

    def placeholder(self, site, topology):
        """-inf per line: sums of squares are never negative, so :meth:`between` tells a tensor
        nobody read (a parameter without a gradient) from one whose lines are zero, and leaves
        its lines out of the count; summed with any rank's lines it stays -inf."""
        return torch.full((self.stages(site, topology)[0].size,), -math.inf, dtype=torch.float64)

    def between(self, index, vector, site, topology):
        lines = self._line_shape(site, topology)[0] if self._known_lines(site) else vector.numel()
        if site.holds(topology.coords()) and lines:
            # Lines of a tensor no rank read (placeholders, -inf) are not lines of the group;
            # a NaN line stays NaN. Decided on the device: no host read.
            sums = vector[:lines]
            read = sums != -math.inf
            return torch.stack([torch.where(read, sums, 0.0).sqrt().sum(), read.sum().to(torch.float64)])
        return torch.zeros(2, dtype=torch.float64, device=vector.device)
