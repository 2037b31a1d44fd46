"""What happened to every record a ``SinkHub`` was given, per sink.

Counts are records (one :class:`~tmetrics_core.records.MetricRecord` each), never batches.
After :meth:`SinkHub.close <tmetrics_core.hub.sink_hub.SinkHub.close>` every submitted record is in
exactly one of ``written``, ``spooled`` or ``dropped``; ``retried`` overlaps them (it counts
records whose write needed more than one attempt, whatever the outcome).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tmetrics_core.records import RunStatus

__all__ = ["HubReport", "SinkCounters", "SinkReport"]


@dataclass(frozen=True, slots=True)
class SinkReport:
    """One sink's outcome.

    Attributes:
        sink: the sink's entry-point name.
        submitted: records handed to the hub for this sink.
        written: records the sink's ``write`` accepted.
        retried: records whose write was attempted more than once (overlaps the others).
        spooled: records now in the spool file, for ``tmetrics replay``.
        dropped: records neither written nor spooled (spool disk full or failing, or the spool
            queue full); each cause is logged as a warning.
        errors: calls to the sink that raised (every attempt counts).
        last_error: ``repr`` of the last exception the sink raised, or None.
        opened: the sink's ``open`` succeeded.
        closed: the sink's ``close(status)`` returned normally.
        spool_path: the spool file when ``spooled`` > 0, else None.
    """

    sink: str
    submitted: int
    written: int
    retried: int
    spooled: int
    dropped: int
    errors: int
    last_error: str | None
    opened: bool
    closed: bool
    spool_path: str | None

    @property
    def pending(self) -> int:
        """Records not yet written, spooled or dropped (0 once the hub is closed)."""
        return self.submitted - self.written - self.spooled - self.dropped


@dataclass(frozen=True, slots=True)
class HubReport:
    """Every sink's :class:`SinkReport` at close, with the run's end status."""

    status: RunStatus
    sinks: tuple[SinkReport, ...]

    @property
    def complete(self) -> bool:
        """Every record was written: nothing spooled, dropped or pending."""
        return all(s.written == s.submitted for s in self.sinks)

    def __getitem__(self, sink: str) -> SinkReport:
        """The report of ``sink``.

        Raises:
            KeyError: no sink of that name; the message lists the names.
        """
        for report in self.sinks:
            if report.sink == sink:
                return report
        raise KeyError(f"no sink {sink!r} in this report; sinks: {[s.sink for s in self.sinks]}")

    def __str__(self) -> str:
        header = ("sink", "submitted", "written", "retried", "spooled", "dropped", "errors")
        rows = [header] + [
            (s.sink, str(s.submitted), str(s.written), str(s.retried), str(s.spooled), str(s.dropped), str(s.errors))
            for s in self.sinks
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [f"tmetrics sinks at close (run {self.status}):"]
        for row in rows:
            cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
            lines.append("  " + "  ".join(cells))
        for s in self.sinks:
            if s.spooled:
                replay = f"tmetrics replay {s.spool_path} --sink {s.sink}"
                lines.append(f"  {s.sink}: {s.spooled} records spooled; load them later with: {replay}")
            if s.dropped:
                lines.append(f"  {s.sink}: {s.dropped} records LOST (spool could not take them)")
            if not s.opened:
                lines.append(f"  {s.sink}: never opened ({s.last_error or 'the run ended before it opened'})")
            elif s.last_error:
                lines.append(f"  {s.sink}: last error {s.last_error}")
        return "\n".join(lines)


class SinkCounters:
    """Thread-safe running counts for one sink, shared by the training thread (``submitted``),
    the sink's worker (``written``, ``retried``, ``errors``) and the spool thread (``spooled``,
    ``dropped``)."""

    __slots__ = ("sink", "_lock", "_counts", "last_error", "opened", "closed", "spool_path")

    def __init__(self, sink: str) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._counts = {"submitted": 0, "written": 0, "retried": 0, "spooled": 0, "dropped": 0, "errors": 0}
        self.last_error: str | None = None
        self.opened = False
        self.closed = False
        self.spool_path: str | None = None

    def add(self, field: str, n: int) -> None:
        """Add ``n`` to the count ``field`` (``"submitted"``, ``"written"``, ...)."""
        with self._lock:
            self._counts[field] += n

    def error(self, error: BaseException) -> None:
        """Count one failed call and remember it."""
        with self._lock:
            self._counts["errors"] += 1
            self.last_error = repr(error)

    def report(self) -> SinkReport:
        """A consistent snapshot."""
        with self._lock:
            c = dict(self._counts)
            return SinkReport(
                sink=self.sink,
                submitted=c["submitted"],
                written=c["written"],
                retried=c["retried"],
                spooled=c["spooled"],
                dropped=c["dropped"],
                errors=c["errors"],
                last_error=self.last_error,
                opened=self.opened,
                closed=self.closed,
                spool_path=self.spool_path if c["spooled"] else None,
            )
