"""Metric records: the plain-Python values that sinks see.

Nothing here imports torch or torch.distributed: a record is finished (reduced across ranks,
finalized, copied to the host) before it is built. Sinks render keys from the structured
labels; they never parse strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping, Union

__all__ = [
    "HEADS_STAT",
    "Histogram",
    "Labels",
    "MetricRecord",
    "RunInfo",
    "RunStatus",
    "show_value",
    "status_on_exit",
    "Value",
]

RunStatus = Literal["finished", "failed", "killed"]
"""How a run ended: normal exit, an exception in training, or a signal (SIGTERM, SIGINT)."""


def show_value(value: float, digits: int = 4) -> str:
    """``value`` as a person reads it in text: a whole number in full (tokens per expert 16384,
    not ``1.638e+04``), anything else to ``digits`` significant digits."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{digits}g}"


def status_on_exit(exc_type: type[BaseException] | None) -> RunStatus:
    """The status of a run whose ``with`` block ended with ``exc_type`` (None: normally):
    ``killed`` for ``KeyboardInterrupt`` (SIGINT), ``failed`` for any other exception."""
    if exc_type is None:
        return "finished"
    return "killed" if issubclass(exc_type, KeyboardInterrupt) else "failed"


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram merged across ranks by summing counts.

    ``edges`` has ``len(counts) + 1`` increasing finite values; bin ``i`` holds values in
    ``[edges[i], edges[i+1])``. Exact zeros and non-finite values are not in any bin: they are
    counted in ``zeros``, ``nan``, ``posinf`` and ``neginf``. Counts are exact integers.
    """

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    zeros: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.counts) + 1:
            raise ValueError(
                f"Histogram needs len(edges) == len(counts) + 1; got {len(self.edges)} edges "
                f"and {len(self.counts)} counts"
            )

    @property
    def total(self) -> int:
        """Every value counted: binned, zero and non-finite."""
        return sum(self.counts) + self.zeros + self.nan + self.posinf + self.neginf

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form used by the ``jsonl`` sink and the spool."""
        return {
            "edges": list(self.edges),
            "counts": list(self.counts),
            "zeros": self.zeros,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Histogram":
        """Inverse of :meth:`to_json`."""
        return cls(
            edges=tuple(float(e) for e in data["edges"]),
            counts=tuple(int(c) for c in data["counts"]),
            zeros=int(data.get("zeros", 0)),
            nan=int(data.get("nan", 0)),
            posinf=int(data.get("posinf", 0)),
            neginf=int(data.get("neginf", 0)),
        )


Value = Union[float, tuple[float, ...], Histogram]
"""A scalar, a vector (e.g. tokens per global expert) or a histogram."""

HEADS_STAT = "heads"
"""The stat of a vector over global attention heads (``layer-attn-entropy``): its element ``i``
is head ``i``, not expert ``i``."""


@dataclass(frozen=True, slots=True)
class Labels:
    """Which slice of the model a value describes: the one label type from result to sink.

    ``layer`` and ``expert`` are global indices (pipeline and expert offsets applied),
    ``tensor`` a canonical tensor name (``"layers.3.attn.q.weight"``) or a family name
    (``"layers.*.attn.q.weight"``), ``stat`` a sub-statistic of a multi-valued metric
    (``"max_over_mean"``); ``None`` where the label does not apply. A metric name plus its
    ``Labels`` identify one series; backends render the pair into a key
    (:mod:`tmetrics_core.sinks.keys`).
    """

    layer: int | None = None
    expert: int | None = None
    tensor: str | None = None
    stat: str | None = None

    NAMES: ClassVar[tuple[str, ...]] = ("layer", "expert", "tensor", "stat")
    """The label names, in the fixed order of keys, JSON objects and tables."""

    def as_dict(self) -> dict[str, Any]:
        """The labels that are set, in the order :data:`NAMES` (the ``labels`` object of the
        ``jsonl`` and spool lines and of alerts)."""
        return {name: value for name in self.NAMES if (value := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Labels":
        """Inverse of :meth:`as_dict`; indices are converted with ``int``.

        Raises:
            KeyError: a name outside :data:`NAMES`.
        """
        unknown = set(data) - set(cls.NAMES)
        if unknown:
            raise KeyError(f"unknown labels {sorted(unknown)}; valid: {list(cls.NAMES)}")
        layer, expert = data.get("layer"), data.get("expert")
        return cls(layer=None if layer is None else int(layer), expert=None if expert is None else int(expert),
                   tensor=data.get("tensor"), stat=data.get("stat"))

    def where(self) -> str:
        """The labels as words: ``layer 5 expert 7`` (``global`` when none is set)."""
        return " ".join(f"{k} {v}" for k, v in self.as_dict().items()) or "global"

    def substat(self, name: str) -> "Labels":
        """These labels with ``stat`` ``name`` (``<stat>-<name>`` when a stat is set): a value
        derived from this one, such as the ``nonfinite`` count of a histogram."""
        return Labels(self.layer, self.expert, self.tensor, name if self.stat is None else f"{self.stat}-{name}")


@dataclass(frozen=True, slots=True)
class MetricRecord:
    """One finished value of one metric at one step.

    ``metric`` is the catalogue name (``"layer-grad-l2"``); ``labels`` say which slice of the
    model it describes (:class:`Labels`). A value is identical on every rank; only the logging
    rank builds records.
    """

    metric: str
    step: int
    value: Value
    labels: Labels = Labels()

    @property
    def layer(self) -> int | None:
        """``labels.layer``."""
        return self.labels.layer

    @property
    def expert(self) -> int | None:
        """``labels.expert``."""
        return self.labels.expert

    @property
    def tensor(self) -> str | None:
        """``labels.tensor``."""
        return self.labels.tensor

    @property
    def stat(self) -> str | None:
        """``labels.stat``."""
        return self.labels.stat

    @property
    def kind(self) -> Literal["scalar", "vector", "histogram"]:
        """``"scalar"`` for a float, ``"vector"`` for a tuple, ``"histogram"`` for a Histogram."""
        if isinstance(self.value, Histogram):
            return "histogram"
        if isinstance(self.value, tuple):
            return "vector"
        return "scalar"

    def value_json(self) -> Any:
        """The value as JSON: a number (NaN and infinities as the strings ``"NaN"``,
        ``"Infinity"``, ``"-Infinity"``), a list of numbers, or a histogram object."""
        if isinstance(self.value, Histogram):
            return self.value.to_json()
        if isinstance(self.value, tuple):
            return [_float_json(v) for v in self.value]
        return _float_json(self.value)

    def elements(self) -> list[tuple[Labels, float]]:
        """A vector value as one labelled scalar per element: element ``i`` is expert ``i``
        when the labels name no expert (tokens per expert of a layer), head ``i`` (stat
        ``head_i``) for a vector of stat :data:`HEADS_STAT`, else the stat ``element_i``
        (``<stat>-element_i`` with a stat). Sinks and alert rules use it so every
        tracker shows the same per-expert series. Empty for non-vectors."""
        if not isinstance(self.value, tuple):
            return []
        labels = self.labels
        if labels.stat == HEADS_STAT:
            return [(Labels(labels.layer, labels.expert, labels.tensor, f"head_{i}"), float(v))
                    for i, v in enumerate(self.value)]
        if labels.expert is None:
            return [(Labels(labels.layer, i, labels.tensor, labels.stat), float(v)) for i, v in enumerate(self.value)]
        return [(labels.substat(f"element_{i}"), float(v)) for i, v in enumerate(self.value)]

    @staticmethod
    def value_from_json(data: Any) -> Value:
        """Inverse of :meth:`value_json`."""
        if isinstance(data, dict):
            return Histogram.from_json(data)
        if isinstance(data, list):
            return tuple(float(v) for v in data)
        return float(data)


def _float_json(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a sink learns when it opens: where the run lives and what it will log.

    ``dir`` is the run directory (a sink's default files go beneath it); ``config`` the
    validated config as plain data; ``manifest`` the list of per-tensor manifest entries (plain
    dicts, see ``tmetrics_core.manifest.table``); ``tags`` short facts about the run (topology such as
    ``{"dp": "2", "tp": "2"}``, model class, world size); ``num_layers`` and ``num_experts`` size
    the zero-padded key indices; ``metrics`` the catalogue names that will be logged.
    """

    name: str
    dir: str
    config: dict[str, Any] = field(default_factory=dict)
    manifest: tuple[dict[str, Any], ...] = ()
    tags: dict[str, str] = field(default_factory=dict)
    num_layers: int = 0
    num_experts: int = 0
    metrics: tuple[str, ...] = ()
