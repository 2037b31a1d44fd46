"""The state of one rule on one series (one metric with one label set), fed one due value at a time.

Each tracker keeps O(window) numbers and does O(window log window) work per due value at most
(the spike median), so the cost of the rules per due step is bounded by the number of series.
:meth:`observe` returns ``("trip", baseline)`` when the series starts to break the rule,
``("recover", baseline)`` when an open series is back, and ``None`` otherwise; the engine turns
these into :class:`~tmetrics_core.alerts.alert.Alert` records and keeps one alert open per series.
"""

from __future__ import annotations

import collections
import math
from typing import Literal, Optional, Union

from tmetrics_core.config.alerts import AlertRule, NonfiniteRule, SpikeRule, StuckRule, ThresholdRule

__all__ = ["Event", "Tracker", "tracker_for"]

Event = Optional[tuple[Literal["trip", "recover"], Optional[float]]]
"""``("trip" | "recover", baseline)`` or ``None``."""

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_STARVED_CLOSE = 2.0  # a starved alert closes at this multiple of its share of the mean


class SpikeTracker:
    """:class:`~tmetrics_core.config.alerts.SpikeRule` on one series. Non-finite values are
    skipped (the nonfinite rule reports them) and never enter the baseline."""

    __slots__ = ("rule", "open", "seen", "window", "ema", "var", "_alpha")

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self.open = False
        self.seen = 0
        self.window: collections.deque[float] = collections.deque(maxlen=rule.window)
        self.ema = 0.0
        self.var = 0.0
        self._alpha = 2.0 / (rule.window + 1)

    def observe(self, value: float, mean: float | None = None) -> Event:
        if not math.isfinite(value):
            return None
        event: Event = None
        if self.seen >= self.rule.warmup:
            baseline, bound = self._bound()
            if not self.open and value > self.rule.floor and value > bound:
                self.open, event = True, ("trip", baseline)
            elif self.open and value <= baseline + (bound - baseline) / 2:
                self.open, event = False, ("recover", baseline)
        self._add(value)
        return event

    def _bound(self) -> tuple[float, float]:
        """The baseline and the lowest value that trips."""
        rule = self.rule
        if rule.baseline == "median":
            ordered = sorted(self.window)
            baseline = _median(ordered)
            spread = _MAD_TO_SIGMA * _median(sorted(abs(v - baseline) for v in ordered)) if rule.zscore else 0.0
        else:
            baseline, spread = self.ema, math.sqrt(self.var)
        bounds = []
        if rule.factor is not None:
            bounds.append(rule.factor * baseline)
        if rule.zscore is not None and spread > 0:
            bounds.append(baseline + rule.zscore * spread)
        return baseline, min(bounds) if bounds else math.inf

    def _add(self, value: float) -> None:
        self.window.append(value)
        if self.seen == 0:
            self.ema = value
        else:
            delta = value - self.ema
            self.ema += self._alpha * delta
            self.var = (1 - self._alpha) * (self.var + self._alpha * delta * delta)
        self.seen += 1


class ThresholdTracker:
    """:class:`~tmetrics_core.config.alerts.ThresholdRule` on one series; NaN is skipped."""

    __slots__ = ("rule", "open", "bound")

    def __init__(self, rule: ThresholdRule) -> None:
        self.rule = rule
        self.open = False
        self.bound: float | None = None

    def observe(self, value: float, mean: float | None = None) -> Event:
        if math.isnan(value):
            return None
        above, below = self.rule.above, self.rule.below
        crossed = above if above is not None and value > above else below if below is not None and value < below \
            else None
        if crossed is not None and not self.open:
            self.open, self.bound = True, crossed
            return ("trip", crossed)
        if crossed is None and self.open:
            self.open = False
            return ("recover", self.bound)
        return None


class NonfiniteTracker:
    """:class:`~tmetrics_core.config.alerts.NonfiniteRule` on one series: a NaN or infinite value,
    or a count > 0 for a metric named ``*-nonfinite``. The baseline is the last good value."""

    __slots__ = ("rule", "open", "last", "counts")

    def __init__(self, rule: NonfiniteRule, *, counts: bool) -> None:
        self.rule = rule
        self.open = False
        self.last: float | None = None
        self.counts = counts

    def observe(self, value: float, mean: float | None = None) -> Event:
        bad = not math.isfinite(value) or (self.counts and value > 0)
        event: Event = None
        if bad and not self.open:
            self.open, event = True, ("trip", self.last)
        elif not bad:
            if self.open:
                self.open, event = False, ("recover", self.last)
            self.last = value
        return event


class StuckTracker:
    """:class:`~tmetrics_core.config.alerts.StuckRule` on one series; NaN is skipped. The baseline
    is the last value before the run of zeros (``zero``) or the repeated value (``unchanged``).
    ``mean`` is the mean of the vector the value is an element of (``share``), else ``None``."""

    __slots__ = ("rule", "open", "run", "previous", "before", "share", "seen")

    def __init__(self, rule: StuckRule) -> None:
        self.rule = rule
        self.open = False
        self.run = 0
        self.previous: float | None = None
        self.before: float | None = None
        self.share: float | None = None  # the value before the zeros over its vector's mean then
        self.seen = 0

    def observe(self, value: float, mean: float | None = None) -> Event:
        if math.isnan(value):
            return None
        self.seen += 1
        atol = self.rule.atol
        fed = True  # starved mode: back at twice the share, so an open alert may close
        if self.rule.mode == "zero":
            stuck = abs(value) <= atol
            baseline = self.before
            if not stuck:
                self.before = value
                self.share = value / mean if mean else None
        elif self.rule.mode == "starved":
            assert self.rule.share is not None  # checked by StuckRule
            stuck = mean is not None and mean > 0 and value < self.rule.share * mean
            # an open alert closes only at twice the share, so a load hovering at the share is one alert
            fed = mean is not None and mean > 0 and value >= _STARVED_CLOSE * self.rule.share * mean
            baseline = self.before
            if not stuck:
                self.before = value
        else:
            stuck = self.previous is not None and abs(value - self.previous) <= atol
            baseline = self.previous
        # zero, starved: such values in a row; unchanged: equal values in a row, the first included
        self.run = self.run + 1 if stuck else (1 if self.rule.mode == "unchanged" else 0)
        self.previous = value
        due = self.seen > self.rule.warmup and (
            self.rule.share is None or self.rule.mode == "starved"
            or (self.share is not None and self.share >= self.rule.share))
        if self.run >= self.rule.steps and not self.open and due:
            self.open = True
            return ("trip", value if self.rule.mode == "unchanged" else baseline)
        if self.open and not stuck and (self.rule.mode != "starved" or fed):
            self.open = False
            return ("recover", value)
        return None


Tracker = Union[SpikeTracker, ThresholdTracker, NonfiniteTracker, StuckTracker]
"""The state of one rule on one series."""


def tracker_for(rule: AlertRule, metric: str) -> Tracker:
    """A fresh tracker of ``rule`` for a series of ``metric``."""
    if isinstance(rule, SpikeRule):
        return SpikeTracker(rule)
    if isinstance(rule, ThresholdRule):
        return ThresholdTracker(rule)
    if isinstance(rule, NonfiniteRule):
        return NonfiniteTracker(rule, counts=metric.endswith("-nonfinite"))
    return StuckTracker(rule)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
