"""``Alert``: one event of an alert rule, the record that sinks render.

Plain Python values only (no torch), like :class:`~tmetrics_core.records.MetricRecord`: an alert
opens when a rule trips on a series (one metric with one label set) and closes when the series is
back to its baseline; both events are ``Alert`` records with the same ``rule`` and labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tmetrics_core.records import Labels, show_value

__all__ = ["COLUMNS", "Alert", "AlertState"]

COLUMNS: tuple[str, ...] = ("step", "state", "rule", "kind", "metric", "layer", "expert", "tensor", "stat",
                            "value", "baseline", "jump", "opened", "first")
"""Column names of :meth:`Alert.row`: the alerts table of W&B, MLflow and ``tmetrics alerts``."""

AlertState = Literal["open", "closed"]
"""``open``: the rule tripped at ``step``; ``closed``: the series recovered at ``step``."""



@dataclass(frozen=True, slots=True)
class Alert:
    """One alert event.

    ``value`` is the due value that tripped (or recovered), in the metric's unit; ``baseline``
    what it was compared with: the running median or EMA (spike), the bound (threshold), the last
    finite value (nonfinite), the last value before the run of zeros or the repeated value
    (stuck); ``None`` when there was none yet. ``jump`` is the fold change ``max(|v|, |b|) /
    min(|v|, |b|)`` between them (``inf`` for NaN, a zero or a missing baseline): alerts of one
    step are ordered by it, biggest first. ``first`` names the first alert of the cluster this one
    belongs to (``step``, ``rule``, ``metric`` and its labels, flat): the layer or expert that tripped
    first when several trip within ``alerts.cluster_steps`` steps. ``opened`` is the step the
    alert opened (equal to ``step`` for an ``open`` event).
    """

    step: int
    rule: str
    kind: str
    metric: str
    state: AlertState
    value: float
    baseline: float | None
    jump: float
    opened: int
    labels: Labels = Labels()
    first: dict[str, Any] = field(default_factory=dict)

    def where(self) -> str:
        """The labels as words: ``layer 5 expert 7`` (``global`` when none is set)."""
        return self.labels.where()

    def is_first(self) -> bool:
        """Whether ``first`` names this alert itself (its rule, metric, labels and opening step)."""
        lead = self.first
        return (lead.get("step"), lead.get("rule"), lead.get("metric")) == (self.opened, self.rule, self.metric) \
            and all(lead.get(k) == getattr(self.labels, k) for k in Labels.NAMES)

    def describe(self) -> str:
        """One line for a person: ``step 100 OPEN update-ratio-spike layer-update-ratio layer 3:
        0.41 vs baseline 0.0004 (1025x)``, plus ``; first: ...`` when another alert led."""
        base = "none" if self.baseline is None else show_value(self.baseline)
        text = (f"step {self.step} {self.state.upper()} {self.rule} {self.metric} {self.where()}: "
                f"{show_value(self.value)} vs baseline {base} ({_fold(self.jump)})")
        lead = self.first
        if lead and not self.is_first():
            text += f"; first: {_lead(lead)}"
        return text

    def row(self) -> list[Any]:
        """The alert as a table row in :data:`COLUMNS` order; ``first`` as words (``update-ratio-spike
        layer-update-ratio layer 2 at step 100``), unset labels and baseline as ``None``."""
        labels = self.labels
        return [self.step, self.state, self.rule, self.kind, self.metric, labels.layer, labels.expert, labels.tensor,
                labels.stat, self.value, self.baseline, self.jump, self.opened, _lead(self.first) if self.first else ""]

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON form (NaN and infinities as strings), the line format of ``alerts.jsonl``."""
        return {"step": self.step, "rule": self.rule, "kind": self.kind, "metric": self.metric,
                "state": self.state, "labels": self.labels.as_dict(), "value": _json_float(self.value),
                "baseline": None if self.baseline is None else _json_float(self.baseline),
                "jump": _json_float(self.jump), "opened": self.opened, "first": self.first}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        """Inverse of :meth:`to_json`."""
        baseline = data.get("baseline")
        return cls(step=int(data["step"]), rule=str(data["rule"]), kind=str(data["kind"]),
                   metric=str(data["metric"]), state=data["state"], value=float(data["value"]),
                   baseline=None if baseline is None else float(baseline), jump=float(data["jump"]),
                   opened=int(data["opened"]), labels=Labels.from_dict(data.get("labels", {})),
                   first=dict(data.get("first", {})))


def _lead(lead: dict[str, Any]) -> str:
    """The ``first`` of an alert as words: ``update-ratio-spike layer-update-ratio layer 2 at step 100``."""
    where = Labels.from_dict({k: v for k, v in lead.items() if k in Labels.NAMES}).where()
    return f"{lead['rule']} {lead['metric']} {where} at step {lead['step']}"


def _json_float(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def _fold(jump: float) -> str:
    return "jump inf" if not math.isfinite(jump) else f"{jump:.3g}x"
