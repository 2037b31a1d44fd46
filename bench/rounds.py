"""Interleaved timing rounds: each variant runs a few steps per round, the order rotating, so
the drift of a shared machine hits every variant alike (MACHINE-NOTES "Benchmarking here").

Figures from the rounds:

- paired ratio: per round, the variant's seconds per step over the baseline's in the same
  round; the median over rounds (robust to load spikes, blind to rare due steps);
- mean ratio: the mean of the per-round ratios without the highest and lowest 10% (every step
  counts, so it is the average over steps of an interval variant, and a load spike on one
  round does not move it).

Wall time (``time.perf_counter``) and process CPU time (``time.process_time``, all threads) are
both kept: under load from other processes the CPU time moves less.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["PairedSteps", "Rounds", "alternate", "interleave"]


@dataclass
class Rounds:
    """Seconds per step, one entry per round, per variant: ``wall`` and ``cpu``."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def paired(self, name: str, baseline: str, *, cpu: bool = False) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
        samples = self.cpu if cpu else self.wall
        return statistics.median(v / b for v, b in zip(samples[name], samples[baseline]))

    def mean(self, name: str, baseline: str, *, trim: float = 0.1) -> float:
        """Mean of the per-round wall-time ratios of ``name`` to ``baseline``, without the
        ``trim`` fraction of highest and of lowest ratios."""
        ratios = sorted(v / b for v, b in zip(self.wall[name], self.wall[baseline]))
        cut = int(len(ratios) * trim)
        return statistics.fmean(ratios[cut:len(ratios) - cut])

    def median_ms(self, name: str) -> float:
        """Median over rounds of the wall milliseconds per step."""
        return statistics.median(self.wall[name]) * 1e3


def interleave(variants: Mapping[str, Callable[[int], None]], *, rounds: int, steps: int) -> Rounds:
    """Run ``variants[name](steps)`` for every variant in each of ``rounds`` rounds, rotating
    the order each round; returns seconds per step per round."""
    names = list(variants)
    out = Rounds({n: [] for n in names}, {n: [] for n in names})
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name](steps)
            out.wall[name].append((time.perf_counter() - wall) / steps)
            out.cpu[name].append((time.process_time() - cpu) / steps)
    return out


@dataclass(frozen=True)
class PairedSteps:
    """Per-step wall-time differences of two ways of running the same step, paired."""

    differences: tuple[float, ...]
    """Seconds, ``second - first``, one per pair."""
    first_mean: float
    """Seconds per step of ``first``."""

    def overhead(self) -> float:
        """Mean difference over the mean ``first`` step (a fraction: 0.05 is +5%)."""
        return statistics.fmean(self.differences) / self.first_mean

    def standard_error(self) -> float:
        """Standard error of :meth:`overhead` (the spread of the pairs over the square root of
        their number)."""
        return statistics.stdev(self.differences) / len(self.differences) ** 0.5 / self.first_mean


def alternate(first: Callable[[], None], second: Callable[[], None], *, pairs: int) -> PairedSteps:
    """Run ``pairs`` pairs of single steps, ``first`` then ``second`` and ``second`` then
    ``first`` in turn (so neither always follows the other), and pair each ``second`` step with
    the ``first`` step next to it: the machine's drift, which moves over seconds, cancels within
    a pair of steps 0.1 s apart, and the mean over hundreds of pairs resolves a few tenths of a
    percent of a step (rounds of several steps per variant resolve about 1.5%)."""
    differences, firsts = [], []
    for i in range(pairs):
        order = (first, second) if i % 2 == 0 else (second, first)
        times = {}
        for run in order:
            start = time.perf_counter()
            run()
            times[run is second] = time.perf_counter() - start
        differences.append(times[True] - times[False])
        firsts.append(times[False])
    return PairedSteps(tuple(differences), statistics.fmean(firsts))
