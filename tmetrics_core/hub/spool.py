"""The spool: records a sink could not take, kept on local disk for ``tmetrics replay``.

One JSONL file per sink, ``<spool_dir>/<sink>.jsonl``, append-only. Each line is one JSON
object of one of three kinds::

    {"run": {...RunInfo fields...}, "sink": "mlflow"}          first line of a new file
    {"config": {...}, "sink": "mlflow"}                         a run config the sink missed
    {"step": 7, "metric": "layer-grad-l2", "labels": {"layer": 3}, "value": 0.25, "sink": "mlflow"}
    {"alert": {...Alert.to_json()...}, "sink": "mlflow"}        an alert the sink missed

A record line has the fields of the ``jsonl`` sink's format (``value`` as
:meth:`~tmetrics_core.records.MetricRecord.value_json`: a number, ``"NaN"``/``"Infinity"``/
``"-Infinity"``, a list, or a histogram object) plus the sink name, so :class:`SpoolReader`
reads a ``metrics.jsonl`` written by the ``jsonl`` sink as well.

The writer never raises into its caller: a disk that is full or failing is reported once as a
warning on the ``tmetrics.spool`` logger, and the records of every failed write are counted as
dropped by the caller. The reader skips a line it cannot parse (a torn last line after a kill)
and counts it instead of failing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.sinks.append_file import AppendFile
from tmetrics_core.records import Labels, MetricRecord, RunInfo

__all__ = [
    "SpoolConfig",
    "SpoolEntry",
    "SpoolReader",
    "SpoolWriter",
    "spool_path",
]

_log = logging.getLogger("tmetrics.spool")
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


@dataclass(frozen=True, slots=True)
class SpoolConfig:
    """A run config (plain data) that a sink's ``log_config`` did not take."""

    config: dict[str, Any]


SpoolEntry = Union[RunInfo, SpoolConfig, MetricRecord, Alert]
"""What :class:`SpoolReader` yields: the run header, a config, one record or one alert."""


def spool_path(spool_dir: str | os.PathLike[str], sink: str) -> Path:
    """The spool file of ``sink``: ``<spool_dir>/<sink>.jsonl``."""
    return Path(spool_dir) / f"{sink}.jsonl"


def _record_line(record: MetricRecord, sink: str) -> str:
    return _ENCODE(
        {
            "step": record.step,
            "metric": record.metric,
            "labels": record.labels.as_dict(),
            "value": record.value_json(),
            "sink": sink,
        }
    )


class SpoolWriter:
    """Appends one sink's unwritten records to its spool file.

    The file and its directory are created on the first write, so a run that never spills
    leaves no file. A new file starts with a ``run`` line holding ``run`` (when given), which
    :func:`tmetrics_core.hub.replay.replay` uses to reopen the sink as the original run (same
    name, directory and index widths). Every write is one all-or-nothing append followed by
    ``fsync``. Not thread-safe: one writer thread per file.

    Args:
        path: the spool file, usually :func:`spool_path`.
        sink: the sink's entry-point name, stored on every line.
        run: the run the records belong to.
    """

    def __init__(self, path: str | os.PathLike[str], *, sink: str, run: RunInfo | None = None) -> None:
        self.path = Path(path)
        self.sink = sink
        self._run = run
        self._file = AppendFile(self.path)
        self._warned = False

    def write_records(self, records: Sequence[MetricRecord]) -> int:
        """Append ``records`` and fsync; returns how many are now on disk: ``len(records)``,
        or 0 when the write failed (the caller counts them as dropped). Never raises."""
        if not records:
            return 0
        sink = self.sink
        text = "\n".join(_record_line(r, sink) for r in records) + "\n"
        return len(records) if self._append(text) else 0

    def write_alerts(self, alerts: Sequence[Alert]) -> bool:
        """Append one ``alert`` line per alert and fsync; False when it failed. Never raises."""
        return self._append("".join(_ENCODE({"alert": a.to_json(), "sink": self.sink}) + "\n" for a in alerts))

    def write_config(self, config: dict[str, Any]) -> bool:
        """Append a ``config`` line and fsync; False when it could not be written. Never raises."""
        return self._append(_ENCODE({"config": config, "sink": self.sink}) + "\n")

    def close(self) -> None:
        """Close the file. Idempotent; never raises."""
        try:
            self._file.close()
        except OSError as error:
            self._warn(error)

    def _append(self, text: str) -> bool:
        try:
            if self._file.open() and self._run is not None:
                text = _ENCODE({"run": asdict(self._run), "sink": self.sink}) + "\n" + text
            self._file.append(text.encode("utf-8"))
            self._file.flush()
        except OSError as error:
            self._warn(error)
            return False
        return True

    def _warn(self, error: OSError) -> None:
        if not self._warned:
            self._warned = True
            _log.warning(
                "cannot write the %s spool %s (%s); records that cannot be spooled are counted "
                "as dropped in the hub report. Free disk space or choose another spool directory "
                "(further errors on this file are not logged)",
                self.sink,
                self.path,
                error,
            )


class SpoolReader:
    """Reads a spool file (or a ``jsonl`` sink's ``metrics.jsonl``) line by line.

    Iterating yields :data:`SpoolEntry` items in file order, one line at a time, so a large
    spool is never held in memory. A line that is not valid JSON or lacks a field (a torn last
    line after a kill, or damage) is skipped; its 1-based line number is appended to
    :attr:`skipped_lines` as iteration passes it.

    Args:
        path: the file to read.

    Raises:
        OSError: on iteration, when the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.skipped_lines: list[int] = []

    def __iter__(self) -> Iterator[SpoolEntry]:
        self.skipped_lines = []
        with open(self.path, "rb") as file:
            for number, raw in enumerate(file, start=1):
                if not raw.strip():
                    continue
                try:
                    yield _parse(json.loads(raw))
                except (ValueError, KeyError, TypeError):
                    self.skipped_lines.append(number)


def _parse(obj: Any) -> SpoolEntry:
    if not isinstance(obj, dict):
        raise TypeError(f"a spool line must be a JSON object; got {type(obj).__name__}")
    if "run" in obj:
        run = obj["run"]
        return RunInfo(
            name=str(run["name"]),
            dir=str(run["dir"]),
            config=dict(run.get("config", {})),
            manifest=tuple(run.get("manifest", ())),
            tags={str(k): str(v) for k, v in run.get("tags", {}).items()},
            num_layers=int(run.get("num_layers", 0)),
            num_experts=int(run.get("num_experts", 0)),
            metrics=tuple(run.get("metrics", ())),
        )
    if "config" in obj:
        return SpoolConfig(config=dict(obj["config"]))
    if "alert" in obj:
        return Alert.from_json(obj["alert"])
    return MetricRecord(
        metric=str(obj["metric"]),
        step=int(obj["step"]),
        value=MetricRecord.value_from_json(obj["value"]),
        labels=Labels.from_dict(obj.get("labels", {})),
    )
