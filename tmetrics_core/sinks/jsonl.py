"""The ``jsonl`` sink: every record as one line of JSON, a stable public format.

``<run dir>/metrics.jsonl`` (or the ``path`` option), one object per record, fields in this
order::

    {"step": 100, "metric": "layer-grad-l2", "labels": {"layer": 3}, "key": "layer-grad-l2/layer_03", "value": 0.0123}

- ``step``: the training step (int).
- ``metric``: the catalogue name.
- ``labels``: those of ``layer`` (int), ``expert`` (int), ``tensor`` (str), ``stat`` (str) that
  are set, in that order.
- ``key``: the key rendered with ``PLAIN_RULES`` (``tmetrics_core.sinks.keys``), widths from the run.
- ``value``: a number (``"NaN"``, ``"Infinity"``, ``"-Infinity"`` as strings, so every line is
  strict JSON), a list of numbers for a vector, or a histogram object
  ``{"edges", "counts", "zeros", "nan", "posinf", "neginf"}``.

Alerts go to ``alerts.jsonl`` in the same directory, one
:meth:`~tmetrics_core.alerts.alert.Alert.to_json` object per line (``step``, ``rule``, ``kind``,
``metric``, ``state``, ``labels``, ``value``, ``baseline``, ``jump``, ``opened``, ``first``); the
file is created with the first alert, so a run without alerts has none.

Each step is appended in one all-or-nothing write and handed to the OS before ``write``
returns, so a reader (``tail -f``, a notebook) sees whole steps; :meth:`JsonlSink.flush`
fsyncs. A run that is resumed appends to the same file. Needs no tracker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Sequence

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.sinks.append_file import AppendFile
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import PLAIN_RULES, KeyBook, KeyRules, index_widths
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus

__all__ = ["JsonlSink"]

_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class JsonlSink:
    """Writes records to a JSON-lines file.

    Keyword args:
        path: the file; default ``<run dir>/metrics.jsonl``. A relative path is taken from the
            current directory.

    Raises:
        ConfigError: ``path`` is not a non-empty string.
    """

    name: ClassVar[str] = "jsonl"
    key_rules: ClassVar[KeyRules] = PLAIN_RULES
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, path: str | os.PathLike[str] | None = None) -> None:
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
            raise ConfigError(
                f"got {path!r}; need a file path such as 'runs/demo/metrics.jsonl'", path="sinks.jsonl.path"
            )
        self._option_path = path
        self._file: AppendFile | None = None
        self._alerts: AppendFile | None = None
        self._keys = KeyBook(PLAIN_RULES)

    @property
    def path(self) -> Path | None:
        """The file written, once opened."""
        return self._file.path if self._file is not None else None

    def open(self, run: RunInfo) -> None:
        """Open (create) the file for appending.

        Raises:
            OSError: the file or its directory cannot be created.
        """
        layer_width, expert_width = index_widths(run.num_layers, run.num_experts)
        self._keys = KeyBook(PLAIN_RULES, layer_width=layer_width, expert_width=expert_width)
        target = Path(self._option_path) if self._option_path is not None else Path(run.dir) / "metrics.jsonl"
        file = AppendFile(target)
        file.open()
        self._file = file
        self._alerts = AppendFile(target.with_name("alerts.jsonl"))

    def log_config(self, config: dict[str, Any]) -> None:
        """Does nothing: the format holds records only; the config is not part of it."""

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Append one line per record, all or none.

        Raises:
            OSError: the append failed (nothing of this step was kept).
            ConfigError: two records render to one key.
        """
        file = self._require_open()
        add = self._keys.add
        lines = [
            _ENCODE(
                {
                    "step": r.step,
                    "metric": r.metric,
                    "labels": r.labels.as_dict(),
                    "key": add(r.metric, r.labels),
                    "value": r.value_json(),
                }
            )
            for r in records
        ]
        if lines:
            file.append(("\n".join(lines) + "\n").encode("utf-8"))

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Append one line per alert to ``alerts.jsonl`` (created on the first alert), all or none.

        Raises:
            OSError: the append failed.
        """
        self._require_open()
        assert self._alerts is not None
        self._alerts.open()
        self._alerts.append("".join(_ENCODE(a.to_json()) + "\n" for a in alerts).encode("utf-8"))
        self._alerts.flush()

    def flush(self) -> None:
        """fsync the file.

        Raises:
            OSError: the OS reported a write-back error.
        """
        self._require_open().flush()

    def close(self, status: RunStatus) -> None:
        """fsync and close the file; the format has no place for ``status``."""
        if self._file is not None:
            try:
                self._file.flush()
            finally:
                self._file.close()
                self._file = None
                if self._alerts is not None:
                    self._alerts.close()
                    self._alerts = None

    def _require_open(self) -> AppendFile:
        if self._file is None:
            raise ValueError("JsonlSink is not open; call open(run) first")
        return self._file
