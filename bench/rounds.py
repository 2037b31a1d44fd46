"""Interleaved timing rounds: each variant runs a few steps per round, the order rotating, so
the drift of a shared machine hits every variant alike (MACHINE-NOTES "Benchmarking here").

Figures from the rounds:

- paired ratio: per round, the variant's seconds per step over the baseline's in the same
  round; the median over rounds (robust to load spikes, blind to rare due steps);
- total ratio: all of the variant's time over all of the baseline's (counts every step, so it
  is the average over steps of an interval variant; less robust to spikes).

Wall time (``time.perf_counter``) and process CPU time (``time.process_time``, all threads) are
both kept: under load from other processes the CPU time moves less.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["Rounds", "interleave"]


@dataclass
class Rounds:
    """Seconds per step, one entry per round, per variant: ``wall`` and ``cpu``."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def paired(self, name: str, baseline: str, *, cpu: bool = False) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
        samples = self.cpu if cpu else self.wall
        return statistics.median(v / b for v, b in zip(samples[name], samples[baseline]))

    def total(self, name: str, baseline: str) -> float:
        """All of ``name``'s wall time over all of ``baseline``'s (the mean over steps)."""
        return sum(self.wall[name]) / sum(self.wall[baseline])

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
