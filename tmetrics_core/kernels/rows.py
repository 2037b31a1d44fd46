"""Rows of a list of tensors: the one per-tensor pass every elementwise statistic reads.

:func:`rows` gives, for a list of tensors on any device and of any dtype, float64 ``[n, 5]``
rows of :data:`FIELDS` (sum of squares, sum, largest and smallest element, count of zeros)
from a fixed number of batched torch ops per ``(device, dtype)`` group, whatever the tensor
count. Only the columns asked for are computed (:data:`COLUMNS`); the others are NaN. This
module knows no metric: statistics (``tmetrics_core.metrics.statistics``) declare the columns
they read and turn rows into their vectors.

Ops per ``(device, dtype)`` group (each a single dispatcher call over the group's tensors):

================  ===========================================================================
``sumsq``         ``_foreach_powsum(p=2)`` and a ``stack``: 2 (computed only when asked for:
                  the extremes' statistics ask for it, a NaN in it is their NaN flag)
``absmax``        ``_foreach_abs``, ``_foreach_max``, ``stack``, a negation: 4 (fills ``max``
                  with the absolute maximum and ``min`` with its negation: read only as
                  ``max(max, -min)``; non-empty tensors only)
``max``           ``_foreach_max``, ``stack``: 2 (non-empty tensors only)
``min``           ``_foreach_neg``, ``_foreach_max``, ``stack``, a negation: 4
``sum``           ``_foreach_clamp_min`` and ``_foreach_clamp_max`` at 0, a ``p=1``
                  ``_foreach_norm`` of each, two ``stack``, a subtraction: 7
``zeros``         ``_foreach_norm(p=0)`` (the count of non-zero elements), ``stack``, a
                  subtraction from the element counts: 3
================  ===========================================================================

The absolute values, negation and clamps are temporary copies, of at most :data:`TEMPORARY`
elements at a time (a group above it takes their two ops once per part); plus, per group, one
``stack`` of the columns (which widens each to float64; a column not asked for is a cached NaN
vector) and, when there are several groups, one ``index_copy_`` into the
output. Accumulation: float64 on CPU and for float64 tensors, float32 on accelerators (their
reductions are tree-shaped, not long serial sums); maxima are exact in any dtype, so they are
taken in the tensors' own. Nothing is read back to the host.

One path serves every device. An earlier CPU-only C kernel (one read of each contiguous CPU
float32/bfloat16 tensor for all columns, compiled at first use; accelerators never used it) was
dropped in issue 33. Measured before dropping it (demo model on CPU, one thread, the standard
bundle every step, 60 rotations of single steps, paired against the bare step of 103 ms): with
the kernel +7.4% +- 0.5%, with it switched off +19.2% +- 0.5%; this path +19.2% +- 0.2%. Per 1 M
CPU float32 elements (``python -m bench.prepare_cost --formulations``): sum of squares 0.4-0.5
ms (half of it torch's copy to float64 before it reduces), absmax 1.6 ms (the ``p=inf`` norm it
replaced: 2.7 ms), maximum 0.2 ms, sum 4.1 ms, zeros 1.1 ms. A due step's tmetrics code on the
demo: 15.7 ms with the ``p=inf`` norm, 12.7 ms now, 7.9 ms with the C kernel
(``docs/performance.md``, "One rows pass per call").
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Callable, Iterable, Sequence

import torch

from tmetrics_core import torch_private

__all__ = ["COLUMNS", "FIELDS", "element_counts", "nonfinite_counts", "rows", "spaced"]

FIELDS = ("sumsq", "sum", "max", "min", "zeros")
"""The columns of a row."""

_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")

COLUMNS = frozenset({"sumsq", "sum", "max", "min", "zeros", "absmax"})
"""What a statistic may read of a row: a field of :data:`FIELDS`, or ``absmax``: ``max`` and
``min`` read only as ``max(max, -min)`` (one maximum of the absolute values instead of a
maximum and a minimum)."""


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.device.type == "cpu" or t.dtype == torch.float64 else torch.float32


def rows(tensors: Sequence[torch.Tensor], columns: Iterable[str] = COLUMNS) -> torch.Tensor:
    """``[len(tensors), 5]`` float64 rows of :data:`FIELDS` of ``tensors`` (one ``(device,
    dtype)`` group or several; any layout) from batched torch ops, on the first tensor's device;
    columns no entry of ``columns`` asks for are NaN. An empty tensor gives ``[0, 0, -inf, inf,
    0]``; a NaN shows in the sum of squares, the maximum and minimum of a tensor holding one are
    not defined (ask for ``sumsq`` beside them, and read them only where it is not NaN).

    Raises:
        ValueError: a name not in :data:`COLUMNS`.
    """
    wanted = frozenset(columns)
    if wanted - COLUMNS:
        raise ValueError(f"unknown moments columns {sorted(wanted - COLUMNS)}; known: {sorted(COLUMNS)}")
    n = len(tensors)
    if not n:
        return torch.empty((0, len(FIELDS)), dtype=torch.float64)
    groups = _groups(tensors)
    if groups is None:
        return _group_rows(list(tensors), wanted)
    device = tensors[0].device
    out = torch.empty((n, len(FIELDS)), dtype=torch.float64, device=device)
    for members in groups:
        block = _group_rows([tensors[i] for i in members], wanted).to(device)
        out.index_copy_(0, _index(tuple(members), device), block)
    return out


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[int]] | None:
    """The indices of ``tensors`` per ``(device, dtype)`` group, or None when they share one
    (the usual case, found by C-level loops: this runs for every tensor of every due step)."""
    keys = list(zip(map(_DEVICE, tensors), map(_DTYPE, tensors)))
    if keys.count(keys[0]) == len(keys):
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _group_rows(ts: list[torch.Tensor], wanted: frozenset[str]) -> torch.Tensor:
    """Rows of tensors of one device and dtype (see the module docstring for the ops). Each
    column is stacked in the dtype its op returns; the last ``stack`` widens them to float64
    (exactly: every dtype read here is a subset of float64)."""
    device, acc = ts[0].device, _acc(ts[0])
    n = len(ts)
    nan = _nan(n, device)
    cols = [nan] * len(FIELDS)
    if "sumsq" in wanted:
        cols[0] = torch.stack(torch_private.foreach_powsum(ts, 2, dtype=acc))
    numels = tuple(map(torch.Tensor.numel, ts))
    if wanted & {"max", "min", "absmax"}:
        full = list(range(n)) if 0 not in numels else [i for i, k in enumerate(numels) if k]
        some = ts if len(full) == n else [ts[i] for i in full]
        # A real maximum and minimum where asked; both beside absmax (read as max(max, -min)).
        extremes = {"max", "min"} if "absmax" in wanted and {"max", "min"} & wanted else wanted
        if "max" in extremes:
            cols[2] = _filled(_stacked(torch_private.foreach_max(some) if full else []), full, n, device, -math.inf)
        if "min" in extremes:
            cols[3] = -_filled(_stacked(_through_copies(some, torch_private.foreach_neg, torch_private.foreach_max)),
                               full, n, device, -math.inf)
        if not {"max", "min"} & wanted:
            peak = _filled(_stacked(_through_copies(some, torch_private.foreach_abs, torch_private.foreach_max)),
                           full, n, device, 0.0)
            cols[2], cols[3] = peak, -peak
    if "sum" in wanted:
        cols[1] = _sums(ts, acc)
    if "zeros" in wanted:
        cols[4] = element_counts(numels, device) - _nonzero(ts)
    return torch.stack(cols, 1).to(torch.float64)


@functools.lru_cache(maxsize=64)
def _nan(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` float64 NaN on ``device``, the column of a field not asked for, made once per
    (length, device). Read only: ``stack`` copies it."""
    return torch.full((n,), math.nan, dtype=torch.float64, device=device)


@functools.lru_cache(maxsize=64)
def element_counts(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The element counts as a float64 tensor on ``device``, made once per list of counts (a
    due set's tensors keep their sizes): no host-to-device copy on later due steps. Read only."""
    return torch.tensor(numels, dtype=torch.float64, device=device)


def _sums(ts: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """``[len(ts)]`` sums of the elements: the ``p=1`` norm of the positive parts less that of
    the negative parts, each of a clamped copy (:func:`_through_copies`; no concatenation; NaN
    and infinities propagate as in a plain sum)."""
    def norm(parts: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        return torch_private.foreach_norm(parts, 1, dtype=acc)
    positive = torch.stack(_through_copies(ts, lambda part: torch_private.foreach_clamp_min(part, 0.0), norm))
    negative = torch.stack(_through_copies(ts, lambda part: torch_private.foreach_clamp_max(part, 0.0), norm))
    return positive - negative


_ListOp = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]

TEMPORARY = 1 << 26
"""Elements of a group that a column's temporary copy (absolute values, negation, clamps) holds
at a time: 256 MiB of float32, so that the copy never holds all of a large model's gradients on
an accelerator; a longer tensor is copied alone."""


def _through_copies(ts: list[torch.Tensor], copy: _ListOp, reduce: _ListOp) -> list[torch.Tensor]:
    """``reduce(copy(ts))``, over consecutive parts of ``ts`` of at most :data:`TEMPORARY`
    elements each (one part, one pair of batched ops, for every group below that size): each
    part's copy is freed before the next is made."""
    if not ts:
        return []
    parts = _parts(tuple(map(torch.Tensor.numel, ts)), TEMPORARY)
    if len(parts) == 1:
        return list(reduce(list(copy(ts))))
    return [r for part in parts for r in reduce(list(copy(ts[part])))]


@functools.lru_cache(maxsize=64)
def _parts(numels: tuple[int, ...], budget: int) -> tuple[slice, ...]:
    """Consecutive slices of tensors with ``numels`` elements, each of at most ``budget``
    elements in all or of one tensor; made once per list of sizes."""
    parts, start, size = [], 0, 0
    for i, k in enumerate(numels):
        if size and size + k > budget:
            parts.append(slice(start, i))
            start, size = i, 0
        size += k
    parts.append(slice(start, len(numels)))
    return tuple(parts)


def _nonzero_list(ts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The ``p=0`` norm of each tensor (its count of non-zero elements, NaN included), float64."""
    return torch_private.foreach_norm(list(ts), 0, dtype=torch.float64)


def _nonzero(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(ts)]`` float64 counts of the non-zero elements (NaN included) of each tensor: the
    ``p=0`` norm, counted in float64 so that it is exact for any tensor size."""
    return torch.stack(list(_nonzero_list(ts)))


def _stacked(values: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 0-d ``values`` (one per non-empty tensor) as a vector; None for none."""
    return torch.stack(list(values)) if values else None


def _filled(values: torch.Tensor | None, full: list[int], n: int, device: torch.device, empty: float
            ) -> torch.Tensor:
    """``values`` at rows ``full`` of an ``[n]`` vector, ``empty`` elsewhere (float64 where
    some row is empty, else ``values`` as they are)."""
    if values is not None and len(full) == n:
        return values
    out = torch.full((n,), empty, dtype=torch.float64, device=device)
    if values is not None:
        out[_index(tuple(full), device)] = values.to(torch.float64)
    return out


@functools.lru_cache(maxsize=256)
def _index(positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``positions`` as an int64 index on ``device``, made once per (positions, device): the
    same groups come back every due step, and a fresh index is a host-to-device copy each time."""
    return torch.tensor(positions, dtype=torch.int64, device=device)


def nonfinite_counts(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors), 3]`` float64 counts of NaN, +inf and -inf elements, on the first
    tensor's device, nothing read back to the host. Integer tensors count 0.

    Per floating ``(device, dtype)`` group a fixed number of batched ops (about 16) and one
    temporary copy of at most :data:`TEMPORARY` elements at a time, never a concatenation: with ``M`` the dtype's largest
    finite value and ``L0`` the count of non-zero elements (``_foreach_norm(p=0)``; NaN counts),
    ``T = L0(x - x)`` counts every non-finite element, ``A = L0(max(x, M) - M)`` the +inf and NaN
    ones, ``B = L0(min(x, -M) + M)`` the -inf and NaN ones; then NaN ``= A + B - T``, +inf
    ``= T - B`` and -inf ``= T - A``."""
    n = len(tensors)
    if not n:
        return torch.zeros((0, 3), dtype=torch.float64)
    device = tensors[0].device
    out = torch.zeros((n, 3), dtype=torch.float64, device=device)
    for members in _groups(tensors) or [list(range(n))]:
        dtype = tensors[members[0]].dtype
        if not dtype.is_floating_point:
            continue
        ts = [tensors[i] for i in members] if len(members) < n else list(tensors)
        largest = torch.finfo(dtype).max

        def above(part: list[torch.Tensor], largest: float = largest) -> Sequence[torch.Tensor]:
            up = torch_private.foreach_clamp_min(part, largest)
            torch_private.foreach_sub_(up, largest)
            return up

        def below(part: list[torch.Tensor], largest: float = largest) -> Sequence[torch.Tensor]:
            down = torch_private.foreach_clamp_max(part, -largest)
            torch_private.foreach_add_(down, largest)
            return down

        every = torch.stack(_through_copies(ts, lambda part: torch_private.foreach_sub(part, part), _nonzero_list))
        up_or_nan = torch.stack(_through_copies(ts, above, _nonzero_list))
        down_or_nan = torch.stack(_through_copies(ts, below, _nonzero_list))
        counts = torch.stack([up_or_nan + down_or_nan - every, every - down_or_nan, every - up_or_nan], 1).to(device)
        if len(members) == n:
            return counts
        out.index_copy_(0, _index(tuple(members), device), counts)
    return out


def spaced(rows: Sequence[int]) -> slice | None:
    """``rows`` (indices into a rows output) as a slice when they are evenly spaced and
    increasing (every row, or one kind of row of an interleaved output: a view, no gather), else
    None."""
    first = rows[0]
    step = rows[1] - first if len(rows) > 1 else 1
    if step > 0 and list(rows) == list(range(first, first + step * len(rows), step)):
        return slice(first, first + step * (len(rows) - 1) + 1, step)
    return None
