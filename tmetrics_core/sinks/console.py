"""The ``console`` sink: a compact per-step summary for a person watching the terminal.

Every ``every`` steps it prints one block::

    step 100  global-grad-l2 1.234  global-param-l2 456.7
      layer-grad-l2          min 0.01234 @ layer 03  max 4.51 @ layer 17  (24 values)
      layer-expert-tokens    min 0 @ layer 02 expert 017  max 812 @ layer 05 expert 003  (1536 values)
      layer-grad-histogram   24 histograms, 1234567 values, 3 non-finite

Global scalars (no layer or expert) share the first line. Every other metric (per metric, tensor
and stat) is one line: its minimum and maximum with where they are (layer, expert, and the
element index of a vector), the count of values, and how many were NaN or infinite (left out of
min and max). Histograms are summarized by count. Lines go through ``tqdm.write`` so progress
bars stay intact. Needs no tracker.

Alerts print on every step they are raised, whatever ``every`` is, one warning line each::

    tmetrics ALERT step 100 OPEN update-ratio-spike layer-update-ratio layer 2: 0.41 vs baseline 0.0004 (1025x)
"""

from __future__ import annotations

import math
import sys
from typing import Any, ClassVar, Literal, Sequence

from tqdm import tqdm

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import PLAIN_RULES, KeyRules, index_widths
from tmetrics_core.records import Histogram, MetricRecord, RunInfo, RunStatus, show_value

__all__ = ["ConsoleSink"]

_Place = tuple[int | None, int | None, int | None]  # (layer, expert, element index)


class ConsoleSink:
    """Prints a summary of every ``every``-th step.

    Keyword args:
        every: print steps divisible by this (steps >= 1); 1 prints every step.
        stream: ``"stdout"`` or ``"stderr"``.

    Raises:
        ConfigError: ``every`` is not an integer >= 1, or ``stream`` is not one of the two names.
    """

    name: ClassVar[str] = "console"
    key_rules: ClassVar[KeyRules] = PLAIN_RULES
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, every: int = 1, stream: Literal["stdout", "stderr"] = "stdout") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"got {every!r}; need an integer number of steps >= 1", path="sinks.console.every")
        if stream not in ("stdout", "stderr"):
            raise ConfigError(f"got {stream!r}; valid: 'stdout', 'stderr'", path="sinks.console.stream")
        self.every = every
        self.stream = stream
        self._layer_width, self._expert_width = index_widths(0, 0)

    def open(self, run: RunInfo) -> None:
        """Remember the index widths of the run."""
        self._layer_width, self._expert_width = index_widths(run.num_layers, run.num_experts)

    def log_config(self, config: dict[str, Any]) -> None:
        """Does nothing: the console shows metrics only."""

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Print the summary of ``step`` if it is due."""
        if step % self.every == 0 and records:
            tqdm.write(self.summary(records, step), file=self._file())

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Print one ``tmetrics ALERT`` line per alert (see the module docstring)."""
        for alert in alerts:
            tqdm.write(f"tmetrics ALERT {alert.describe()}", file=self._file())

    def flush(self) -> None:
        """Flush the stream."""
        self._file().flush()

    def close(self, status: RunStatus) -> None:
        """Flush the stream; nothing else to end."""
        self.flush()

    def summary(self, records: Sequence[MetricRecord], step: int) -> str:
        """The text printed for ``records`` of ``step`` (no trailing newline)."""
        groups: dict[tuple[str, str | None, str | None], list[MetricRecord]] = {}
        for record in records:
            groups.setdefault((record.metric, record.labels.tensor, record.labels.stat), []).append(record)
        head = [f"step {step}"]
        lines: list[str] = []
        rows: list[tuple[str, str]] = []
        for (metric, tensor, stat), group in groups.items():
            title = "/".join(part for part in (metric, tensor, stat) if part is not None)
            only = group[0].labels
            if len(group) == 1 and group[0].kind == "scalar" and only.layer is None and only.expert is None:
                head.append(f"{title} {_number(group[0].value)}")  # type: ignore[arg-type]
            else:
                rows.append((title, self._describe(group)))
        lines.append("  ".join(head))
        width = max((len(title) for title, _ in rows), default=0)
        lines += [f"  {title.ljust(width)}  {text}" for title, text in rows]
        return "\n".join(lines)

    def _describe(self, group: list[MetricRecord]) -> str:
        histograms = [r.value for r in group if isinstance(r.value, Histogram)]
        values: list[tuple[float, _Place]] = []
        for r in group:
            if isinstance(r.value, tuple):
                values += [(v, (r.labels.layer, r.labels.expert, i)) for i, v in enumerate(r.value)]
            elif not isinstance(r.value, Histogram):
                values.append((r.value, (r.labels.layer, r.labels.expert, None)))
        parts: list[str] = []
        finite = [(v, place) for v, place in values if math.isfinite(v)]
        if finite:
            low = min(finite, key=lambda item: item[0])
            high = max(finite, key=lambda item: item[0])
            parts.append(f"min {_number(low[0])}{self._where(low[1])}  max {_number(high[0])}{self._where(high[1])}")
        if values:
            bad = len(values) - len(finite)
            count = f"{len(values)} value" + ("s" if len(values) != 1 else "")
            parts.append(f"({count}" + (f", {bad} non-finite)" if bad else ")"))
        if histograms:
            total = sum(h.total for h in histograms)
            bad = sum(h.nan + h.posinf + h.neginf for h in histograms)
            parts.append(f"{len(histograms)} histograms, {total} values, {bad} non-finite")
        return "  ".join(parts)

    def _where(self, place: _Place) -> str:
        layer, expert, index = place
        text = ""
        if layer is not None:
            text += f" layer {layer:0{self._layer_width}d}"
        if expert is not None:
            text += f" expert {expert:0{self._expert_width}d}"
        if index is not None:
            text += f" [{index}]"
        return f" @{text}" if text else ""

    def _file(self) -> Any:
        # Looked up at each call, so a redirected sys.stdout (pytest, notebooks) is honoured.
        return sys.stdout if self.stream == "stdout" else sys.stderr


def _number(value: float) -> str:
    return show_value(value)
