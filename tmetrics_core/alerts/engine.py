"""``AlertEngine``: runs the alert rules over each step's records on the logging rank.

It sees exactly the records the sinks get (finished, reduced, on the host), so it needs no
collective and costs nothing on other ranks. Per due step it does one dictionary lookup per
record and one tracker update per (rule, series) the record feeds; which rules a metric name
matches and whether a series is in a rule's scope are decided once and cached.

Each series (one metric with one label set; a vector element counts as expert ``i``) has at most
one open alert per rule: a rule that trips opens an ``open`` alert, later trips are silent, and
the first due value back at the baseline emits a ``closed`` alert. An alert opening more than
``cluster_steps`` steps after the current cluster's first alert starts a new cluster; every alert
of a cluster names its first one (earliest step; within a step, the biggest jump, then the most specific
labels), which is how a run says which layer or expert went wrong first. A ``starved`` stuck rule
(a slow condition, not an event) joins a cluster but never starts one: outside a cluster it names
itself.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Any, Sequence, cast

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.alerts.rules import Tracker, tracker_for
from tmetrics_core.config.alerts import AlertRule, AlertsConfig, StuckRule
from tmetrics_core.records import Labels, MetricRecord

__all__ = ["AlertEngine"]

_SeriesKey = tuple[str, Labels]  # metric, labels
_NEW = object()
"""A series not seen yet (its tracker is made on first sight; None: no rule watches it)."""


class AlertEngine:
    """The alert rules of one run and the state of every series they watch.

    Args:
        config: the ``alerts:`` section; its :attr:`~AlertsConfig.active_rules` run.
    """

    def __init__(self, config: AlertsConfig) -> None:
        self.config = config
        self.rules: tuple[AlertRule, ...] = config.active_rules
        self._rules_of: dict[str, tuple[int, ...]] = {}
        self._trackers: dict[tuple[int, _SeriesKey], Tracker | None] = {}
        self._element_keys: dict[tuple[Any, ...], list[_SeriesKey]] = {}  # a vector's series, found once
        self._opened: dict[tuple[int, _SeriesKey], tuple[int, dict[str, Any]]] = {}  # open step, cluster lead
        self._first: dict[str, Any] = {}
        self._cluster_start: int | None = None
        self.history: list[Alert] = []
        """Every alert raised so far, in order."""

    @property
    def watched(self) -> int:
        """How many (rule, series) pairs have a tracker: the work per due step when all are due."""
        return sum(1 for tracker in self._trackers.values() if tracker is not None)

    @property
    def open_alerts(self) -> int:
        """How many series have an open alert now."""
        return len(self._opened)

    def observe(self, records: Sequence[MetricRecord], step: int) -> list[Alert]:
        """Feed one step's records; return the alerts they raise: the step's openings ordered by
        jump (biggest first; a tie goes to the alert naming more of layer and expert), then its
        closings. Scalars and vectors are watched; histograms are not."""
        opened: list[tuple[tuple[int, _SeriesKey], float, float | None]] = []
        closed: list[Alert] = []
        for record in records:
            rules = self._rules_of.get(record.metric)
            if rules is None:
                rules = self._rules_of[record.metric] = tuple(
                    i for i, rule in enumerate(self.rules) if fnmatchcase(record.metric, rule.metric))
            if not rules:
                continue
            value = record.value
            mean = None
            if isinstance(value, float | int):
                items = [((record.metric, record.labels), float(value))]
            elif isinstance(value, tuple):
                shape = (record.metric, record.labels, len(value))
                keys = self._element_keys.get(shape)
                if keys is None:
                    keys = self._element_keys[shape] = [(record.metric, labels) for labels, _ in record.elements()]
                items = list(zip(keys, map(float, value)))
                mean = math.fsum(value) / len(value) if value else None
            else:
                continue
            for index in rules:
                for series, number in items:
                    key = (index, series)
                    found = self._trackers.get(key, _NEW)
                    tracker = (self._new_tracker(index, series) if found is _NEW
                               else cast("Tracker | None", found))
                    if found is _NEW:
                        self._trackers[key] = tracker
                    if tracker is None:
                        continue
                    event = tracker.observe(number, mean)
                    if event is None:
                        continue
                    if event[0] == "trip":
                        opened.append((key, number, event[1]))
                    else:
                        opened_at, first = self._opened.pop(key, (step, self._first))
                        closed.append(self._alert(key, step, "closed", number, event[1], opened=opened_at,
                                                  first=first))
        alerts = self._open(opened, step) + closed
        self.history.extend(alerts)
        return alerts

    def _new_tracker(self, index: int, series: _SeriesKey) -> Tracker | None:
        rule = self.rules[index]
        labels = series[1]
        for label, glob in rule.scope.items():
            value = getattr(labels, label)
            if value is None or not fnmatchcase(str(value), glob):
                return None
        return tracker_for(rule, series[0])

    def _open(self, opened: list[tuple[tuple[int, _SeriesKey], float, float | None]], step: int) -> list[Alert]:
        if not opened:
            return []
        ranked = sorted(opened, key=lambda o: (-_jump(o[1], o[2]),
                                               -sum(x is not None for x in (o[0][1][1].layer, o[0][1][1].expert))))
        events = [o for o in ranked if not self._slow(o[0][0])]
        if events and (self._cluster_start is None or step - self._cluster_start > self.config.cluster_steps):
            self._cluster_start = step
            self._first = self._name(events[0][0], step)
        alerts = []
        for key, number, baseline in ranked:
            joins = self._cluster_start is not None and step - self._cluster_start <= self.config.cluster_steps
            first = self._first if joins else self._name(key, step)
            self._opened[key] = (step, first)
            alerts.append(self._alert(key, step, "open", number, baseline, opened=step, first=first))
        return alerts

    def _slow(self, index: int) -> bool:
        """A rule that names a slow condition (a starved expert), not an event: it joins a
        cluster but never starts one, so a starvation that began earlier cannot be named as the
        first of a later fault; outside a cluster it names itself."""
        rule = self.rules[index]
        return isinstance(rule, StuckRule) and rule.mode == "starved"

    def _name(self, key: tuple[int, _SeriesKey], step: int) -> dict[str, Any]:
        index, (metric, labels) = key
        return {"step": step, "rule": self.rules[index].name, "metric": metric} | labels.as_dict()

    def _alert(self, key: tuple[int, _SeriesKey], step: int, state: str, value: float, baseline: float | None,
               *, opened: int, first: dict[str, Any]) -> Alert:
        index, (metric, labels) = key
        rule = self.rules[index]
        return Alert(step=step, rule=rule.name, kind=rule.kind, metric=metric, state=state,  # type: ignore[arg-type]
                     value=value, baseline=baseline, jump=_jump(value, baseline), opened=opened, labels=labels,
                     first=dict(first))


def _jump(value: float, baseline: float | None) -> float:
    """Fold change between value and baseline; ``inf`` for a non-finite value, a missing
    baseline or one side zero (1 when both are zero)."""
    if baseline is None or not (math.isfinite(value) and math.isfinite(baseline)):
        return math.inf
    a, b = abs(value), abs(baseline)
    low, high = min(a, b), max(a, b)
    if low == 0:
        return 1.0 if high == 0 else math.inf
    return high / low
