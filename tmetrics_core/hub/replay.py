"""Load a spool (or a ``jsonl`` sink's ``metrics.jsonl``) into a backend after the run.

This is what ``tmetrics replay SPOOL --sink NAME`` runs. The sink is opened as the original run
(the spool's ``run`` line: same name, directory and index widths, so keys come out as they
would have during training), configs found in the spool are passed to ``log_config``, and the
records are written one step at a time, in file order.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError
from tmetrics_core.records import MetricRecord, RunInfo
from tmetrics_core.sinks.registry import MetricSink, build_sinks
from tmetrics_core.hub.spool import SpoolConfig, SpoolEntry, SpoolReader

__all__ = ["replay"]

_log = logging.getLogger("tmetrics.replay")


def replay(
    spool_path: str | os.PathLike[str],
    sink: MetricSink | str,
    *,
    options: Mapping[str, Any] | None = None,
    run: RunInfo | None = None,
) -> int:
    """Write every record of ``spool_path`` to ``sink``; returns the number of records written.

    Args:
        spool_path: a spool file (``<spool_dir>/<sink>.jsonl``) or a ``metrics.jsonl``.
        sink: a sink object, or an entry-point name built with ``options``
            (as :func:`~tmetrics_core.sinks.registry.build_sinks` would from a config).
        options: the sink's options when ``sink`` is a name.
        run: the run to open the sink as. Default: the spool's ``run`` line; for a file
            without one, ``RunInfo(name=<file stem>, dir=<file's directory>)``.

    The sink is opened once, records of consecutive lines with the same step are written in one
    ``write`` call, alerts (``alert`` lines) go to the sink's ``write_alerts`` when it has one,
    then the sink is flushed and closed with ``"finished"`` (``"failed"`` if a write raised,
    and the error propagates; records written before it stay written). Lines the reader cannot
    parse (a torn last line) are skipped and logged as a warning.

    Raises:
        ConfigError: ``options`` given with a sink object; an unknown sink name or bad options.
        OSError: the spool cannot be read.
        Exception: whatever the sink's ``open``, ``log_config`` or ``write`` raises.
    """
    path = Path(spool_path)
    if isinstance(sink, str):
        target = build_sinks({sink: dict(options or {})})[0]
    elif options is not None:
        raise ConfigError(
            f"options apply to a sink name only; got a {type(sink).__name__} object and {dict(options)!r}",
            path="replay.options",
        )
    else:
        target = sink
    reader = SpoolReader(path)
    entries = iter(reader)
    first = next(entries, None)
    if run is None:
        run = first if isinstance(first, RunInfo) else RunInfo(name=path.stem, dir=str(path.parent))
    if first is not None and not isinstance(first, RunInfo):
        entries = _chain(first, entries)

    target.open(run)
    written = 0
    try:
        step: int | None = None
        group: list[MetricRecord] = []
        for entry in entries:
            if isinstance(entry, MetricRecord):
                if entry.step != step and group:
                    target.write(group, step)  # type: ignore[arg-type]
                    written += len(group)
                    group = []
                step = entry.step
                group.append(entry)
            elif isinstance(entry, SpoolConfig):
                target.log_config(entry.config)
            elif isinstance(entry, Alert) and hasattr(target, "write_alerts"):
                if group:  # the step's records first, as during training
                    target.write(group, step)  # type: ignore[arg-type]
                    written += len(group)
                    group = []
                target.write_alerts([entry], entry.step)
        if group:
            target.write(group, step)  # type: ignore[arg-type]
            written += len(group)
        target.flush()
    except BaseException:
        target.close("failed")
        raise
    target.close("finished")
    if reader.skipped_lines:
        _log.warning(
            "replay of %s skipped %d unreadable line(s) (numbers %s); a torn last line is what a killed writer leaves",
            path,
            len(reader.skipped_lines),
            reader.skipped_lines[:10],
        )
    _log.info("replayed %d records from %s into sink %s", written, path, target.name)
    return written


def _chain(first: SpoolEntry, rest: Iterator[SpoolEntry]) -> Iterator[SpoolEntry]:
    yield first
    yield from rest
