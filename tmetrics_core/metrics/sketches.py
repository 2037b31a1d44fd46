"""Log-spaced signed histograms that merge by SUM, and quantiles read from them.

A :class:`LogBins` fixes the bins once for every rank, step and tensor, so histograms merge
across ranks, tensors and micro-batches by adding counts, exactly. Magnitudes between
``2**lo`` and ``2**hi`` get ``bins`` log-spaced bins on each side of zero; the rest is counted
apart, so nothing is lost:

=============================  ==========================================================
bin (edge order)               values
=============================  ==========================================================
``[-M, -2**hi)``               negative overflow: every finite ``x < -2**hi`` (closed end)
``bins`` negative bins         ``-2**hi <= x < -2**lo``, log-spaced
``[-2**lo, 0)``                negative underflow
``[0, 2**lo)``                 positive underflow (exact zeros are *not* here)
``bins`` positive bins         ``2**lo <= x < 2**hi``, log-spaced
``[2**hi, M)``                 positive overflow: every finite ``x >= 2**hi`` (closed end)
=============================  ==========================================================

``M`` is the largest float32. Exact zeros (``-0.0`` too), NaN, +Inf and -Inf have their own
counts. Edges are float32 numbers and each element is compared with them exactly
(``torch.searchsorted`` on the element's own value, bf16/fp16 widened to float32), so the
count of a bin never depends on how a tensor is sharded.

Quantiles (:meth:`LogBins.quantile`) come from the merged counts: the bin holding the
requested rank is found and its geometric midpoint returned. With bin ratio
``r = 2**((hi - lo) / bins)``, a quantile ``v`` with ``2**lo < |v| < 2**hi`` is estimated
within relative error ``sqrt(r) - 1`` (:attr:`LogBins.relative_error`); for ``|v| <= 2**lo``
the error is at most ``2**lo / 2`` in absolute terms; for ``|v| >= 2**hi`` the estimate is
``+-2**hi`` (a bound, not an estimate); exact zeros and infinities are returned exactly. No value is ever
gathered: the collective is the fixed-size count vector, whatever the token or rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.statistics import Statistic
from tmetrics_core.records import Histogram

__all__ = ["HistogramMetric", "LogBins", "LogHistogram", "QuantileMetric"]

_F32_MAX = float(torch.finfo(torch.float32).max)
_GROUP = 1 << 22
_MAX_PER_OCTAVE = 4096


@dataclass(frozen=True, slots=True)
class LogBins:
    """Fixed signed log-spaced bins: ``bins`` per sign over magnitudes ``[2**lo, 2**hi)``.

    Vector layout of :meth:`count` (float64, exact integer counts, ``size = 2 * bins + 8``):
    the ``2 * bins + 4`` bins in edge order (see the module table), then the counts of exact
    zeros, NaN, +Inf and -Inf.

    Raises:
        ConfigError: ``lo >= hi``, ``bins < 1``, or more than 4096 bins per octave.
    """

    lo: int = -40
    hi: int = 24
    bins: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.bins, int) or self.bins < 1:
            raise ConfigError(f"got {self.bins!r}; need an int >= 1 (log-spaced bins per sign)", path="bins")
        if self.lo >= self.hi:
            raise ConfigError(f"histogram range 2**{self.lo}..2**{self.hi} is empty; need lo < hi")
        if self.bins > (self.hi - self.lo) * _MAX_PER_OCTAVE:
            raise ConfigError(
                f"got {self.bins} bins over 2**{self.lo}..2**{self.hi}; use at most "
                f"{(self.hi - self.lo) * _MAX_PER_OCTAVE} ({_MAX_PER_OCTAVE} per octave: finer float32 edges "
                "would coincide and the count vector would dwarf the data)",
                path="bins",
            )

    @property
    def size(self) -> int:
        """Length of the count vector: ``2 * bins + 8``."""
        return 2 * self.bins + 8

    @property
    def edges(self) -> tuple[float, ...]:
        """The ``2 * bins + 5`` increasing signed edges (for :class:`~tmetrics_core.records.Histogram`)."""
        return _signed_edges(self.lo, self.hi, self.bins)

    @property
    def relative_error(self) -> float:
        """Largest ``|estimate / v - 1|`` of :meth:`quantile` for ``2**lo < |v| < 2**hi``:
        ``sqrt(r) - 1`` for the widest bin's edge ratio ``r`` (float32 edges)."""
        mags = _magnitude_edges(self.lo, self.hi, self.bins)
        return max(math.sqrt(b / a) for a, b in zip(mags, mags[1:])) - 1.0

    def count(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count every element of ``tensor`` (any shape, float or integer) into the bins.

        Returns a float64 vector of length :attr:`size` on the tensor's device.
        """
        return self.count_many([tensor])[0]

    def count_many(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`count` of each tensor (all on one device), with a fixed number of torch
        operations per 2**22 elements whatever the number of tensors: the tensors' pieces are
        concatenated into groups of at most 2**22 elements (a tensor larger than that is cut),
        each group is binned by one ``searchsorted``, and one ``bincount`` over ``piece * size +
        bin`` counts every piece at once. One ``searchsorted`` per tensor cost 24 ms on a 24 ms
        step of the demo model. Temporary memory stays bounded by the group size. Every element
        is compared with the float32 edges exactly as alone (float64 when any tensor is), so
        counts do not depend on grouping or sharding.
        """
        flat = [t.detach().reshape(-1) for t in tensors]
        if not flat:
            return []
        device = flat[0].device
        nbins = 2 * self.bins + 4
        totals = torch.zeros(len(flat), self.size, dtype=torch.int64, device=device)
        work = torch.float64 if any(x.dtype == torch.float64 for x in flat) else torch.float32
        edges = torch.tensor(self.edges, dtype=work, device=device)
        for owners, pieces in _groups(flat, _GROUP):
            values = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).to(work)  # cat widens mixed dtypes exactly
            index = (torch.searchsorted(edges, values, right=True) - 1).clamp_(0, nbins - 1)
            index = torch.where(values == 0, nbins, index)
            index = torch.where(torch.isnan(values), nbins + 1, index)
            index = torch.where(torch.isposinf(values), nbins + 2, index)
            index = torch.where(torch.isneginf(values), nbins + 3, index)
            sizes = torch.tensor([p.numel() for p in pieces], device=device)
            index += torch.repeat_interleave(torch.arange(len(pieces), device=device) * self.size, sizes)
            counts = torch.bincount(index, minlength=len(pieces) * self.size).view(len(pieces), self.size)
            totals.index_add_(0, torch.tensor(owners, device=device), counts)
        return list(totals.double().unbind(0))

    def histogram(self, vector: Sequence[float]) -> Histogram:
        """The merged count vector as a :class:`~tmetrics_core.records.Histogram`."""
        nbins = 2 * self.bins + 4
        counts = [int(round(c)) for c in vector]
        zeros, nan, posinf, neginf = counts[nbins:nbins + 4]
        return Histogram(edges=self.edges, counts=tuple(counts[:nbins]), zeros=zeros, nan=nan,
                         posinf=posinf, neginf=neginf)

    def quantile(self, vector: Sequence[float], q: float) -> float:
        """The ``q``-quantile of the counted values, NaN excluded: the value of rank
        ``floor(q * (n - 1))`` in sorted order (``q = 0.5`` is the lower median, as
        ``torch.median``), estimated as described in the module docstring. NaN when no
        value was counted.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be in [0, 1]; got {q}")
        nbins = 2 * self.bins + 4
        counts = [int(round(c)) for c in vector]
        zeros, _nan, posinf, neginf = counts[nbins:nbins + 4]
        # Sorted order: -Inf, negative bins, zeros, positive bins, +Inf.
        half = self.bins + 2
        reps = _representatives(self.lo, self.hi, self.bins)
        ordered = ([(neginf, -math.inf)] + list(zip(counts[:half], reps[:half])) + [(zeros, 0.0)]
                   + list(zip(counts[half:nbins], reps[half:])) + [(posinf, math.inf)])
        n = sum(c for c, _ in ordered)
        if n == 0:
            return math.nan
        rank = math.floor(q * (n - 1))
        seen = 0
        for c, value in ordered:
            seen += c
            if rank < seen:
                return value
        raise AssertionError(f"rank {rank} beyond {n} counted values")


def _groups(flat: Sequence[torch.Tensor], limit: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """``flat``'s non-empty tensors cut into pieces of at most ``limit`` elements and packed, in
    order, into groups of at most ``limit`` elements: ``(owner index of each piece, pieces)``."""
    groups: list[tuple[list[int], list[torch.Tensor]]] = []
    owners: list[int] = []
    pieces: list[torch.Tensor] = []
    held = 0
    for owner, x in enumerate(flat):
        for piece in x.split(limit) if x.numel() else ():
            if held + piece.numel() > limit and pieces:
                groups.append((owners, pieces))
                owners, pieces, held = [], [], 0
            owners.append(owner)
            pieces.append(piece)
            held += piece.numel()
    if pieces:
        groups.append((owners, pieces))
    return groups


@lru_cache(maxsize=64)
def _magnitude_edges(lo: int, hi: int, bins: int) -> tuple[float, ...]:
    """``bins + 1`` magnitudes ``2**(lo + j * (hi - lo) / bins)``, rounded to float32."""
    exact = torch.tensor([lo + j * (hi - lo) / bins for j in range(bins + 1)], dtype=torch.float64)
    return tuple(torch.exp2(exact).to(torch.float32).double().tolist())


@lru_cache(maxsize=64)
def _signed_edges(lo: int, hi: int, bins: int) -> tuple[float, ...]:
    mags = _magnitude_edges(lo, hi, bins)
    return (-_F32_MAX,) + tuple(-m for m in reversed(mags)) + (0.0,) + mags + (_F32_MAX,)


@lru_cache(maxsize=64)
def _representatives(lo: int, hi: int, bins: int) -> tuple[float, ...]:
    """The value :meth:`LogBins.quantile` returns for each bin, in edge order."""
    mags = _magnitude_edges(lo, hi, bins)
    geometric = [math.sqrt(a * b) for a, b in zip(mags, mags[1:])]
    negative = [-mags[-1]] + [-g for g in reversed(geometric)] + [-mags[0] / 2]
    positive = [mags[0] / 2] + geometric + [mags[-1]]
    return tuple(negative + positive)


class LogHistogram(Statistic):
    """Counts of every element in the bins of a :class:`LogBins`, merged by SUM.

    Single stage over the axes that split the tensor (Shard, FlatShard, Owned; a Replica
    axis is not reduced, so a replicated tensor counts once). Counts are not linear in the
    tensor, so ``Partial`` tensors are materialized first.
    """

    op = "sum"

    def __init__(self, bins: LogBins) -> None:
        self.bins = bins
        self.name = f"loghist[{bins.lo},{bins.hi},{bins.bins}]"

    def size(self, site):
        return self.bins.size

    def compute(self, tensors, sites, topology, rows):
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for indices in by_device.values():
            for i, vector in zip(indices, self.bins.count_many([tensors[i] for i in indices]), strict=True):
                out[i] = vector
        return out


class HistogramMetric(StatMetric):
    """Signed log-spaced histogram of every element of the group, as a
    :class:`~tmetrics_core.records.Histogram` (counts exact; zeros, NaN and infinities apart).

    Args:
        bins: log-spaced bins per sign over ``[2**lo, 2**hi)`` (default 128: 2 per octave).
        lo, hi: exponents of the binned magnitude range (default ``2**-40 .. 2**24``).
    """

    formula = "counts of x in fixed signed log2-spaced bins; zeros, NaN, +Inf, -Inf apart"

    def __init__(self, *, bins: int | None = None, lo: int = -40, hi: int = 24, **kwargs) -> None:
        self.log_bins = LogBins(lo, hi, 128 if bins is None else bins)
        self.statistics = (LogHistogram(self.log_bins),)
        super().__init__(**kwargs)

    def finalize(self, stats):
        return self.log_bins.histogram(stats[self.statistics[0].name])


class QuantileMetric(StatMetric):
    """The ``q``-quantile of the group's elements, read from a merged :class:`LogBins`
    histogram (lower quantile, NaN excluded; error bound in the module docstring).

    Args:
        q: the quantile in ``[0, 1]`` (default 0.5, the median).
        bins: log-spaced bins per sign (default 1024 over ``2**-20 .. 2**12``: 32 per octave,
            relative error at most ``2**(1/64) - 1``, about 1.1%).
        lo, hi: exponents of the binned magnitude range.
    """

    formula = "value of rank floor(q (n-1)) among the group's elements, from log2-binned counts"

    def __init__(self, *, q: float = 0.5, bins: int | None = None, lo: int = -20, hi: int = 12,
                 **kwargs) -> None:
        if not 0.0 <= q <= 1.0:
            raise ConfigError(f"got {q!r}; need a quantile in [0, 1]", path="q")
        self.q = q
        self.log_bins = LogBins(lo, hi, 1024 if bins is None else bins)
        self.statistics = (LogHistogram(self.log_bins),)
        super().__init__(**kwargs)

    def finalize(self, stats):
        return self.log_bins.quantile(stats[self.statistics[0].name], self.q)
