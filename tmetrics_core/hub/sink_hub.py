"""``SinkHub``: the logging rank's fan-out from the training thread to every sink.

The training thread only enqueues: :meth:`SinkHub.submit` appends one shared, read-only batch
to each sink's bounded queue (a few microseconds per sink, whatever the number of records).
Each sink has its own worker thread (``tmetrics_core.hub.worker``), so a slow, failing or hung
tracker delays only itself. What a sink cannot take goes to its spool file
``<spool_dir>/<sink>.jsonl`` through one spool thread (``tmetrics_core.hub.spill``), and
``tmetrics replay`` loads it later. Nothing is dropped silently: every record ends written,
spooled or dropped (spool disk failing), counted per sink in the :class:`HubReport` that
:meth:`SinkHub.close` returns and logs.

Ranks that do not log get a :class:`NullHub`, so the training loop has no rank checks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.alerts.engine import AlertEngine
from tmetrics_core.errors import ConfigError, SinkError
from tmetrics_core.hub import exits
from tmetrics_core.hub.report import HubReport, SinkReport
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus
from tmetrics_core.hub.worker import SinkWorker
from tmetrics_core.sinks.registry import MetricSink
from tmetrics_core.hub.spill import Batch, ConfigItem, FlushMarker, Spiller

__all__ = ["HubReport", "NullHub", "SinkHub", "SinkReport"]

_log = logging.getLogger("tmetrics.hub")


class SinkHub:
    """Bounded queues and worker threads between the training thread and the sinks.

    Call :meth:`open` once, then :meth:`submit` every step, and :meth:`close` at the end (on
    normal exit, on an exception and on SIGTERM; close is thread-safe and idempotent). If the
    process exits without ``close``, the exit hook (``tmetrics_core.hub.exits``) closes with
    status ``"failed"``, or ``"killed"`` after Ctrl-C.

    Args:
        sinks: the sinks, each with a distinct ``name``.
        spool_dir: directory for spool files, created only when something spills.
        queue_size: records that may wait in each sink's queue (default 2**18, about 14 steps of
            18k records); a step that does not fit goes to the spool instead of waiting. Batches
            are shared by the sinks, so memory is bounded by about ``queue_size +
            spool_queue_size`` records in all, plus one in-flight step per sink.
        retries: extra attempts for a failing sink call before its batch is spooled.
        backoff: first wait between attempts, seconds; doubles per attempt (plus jitter).
        backoff_max: the longest wait between attempts, between background ``open`` retries
            and between probes of a sink that keeps failing, seconds.
        close_timeout: how long :meth:`close` waits for the sinks to drain and close, seconds
            (the config's ``run.close_timeout_s``). Half of it goes to draining the queues: what
            a sink has not written by then (or, at its average write time, would not have) is
            spooled and the sink is closed; a sink still busy
            at the end is left (not closed) and its rest spooled. Also the default bound of
            :meth:`flush`.
        interrupt_timeout: the same bound for :meth:`close_interrupted` (Ctrl-C), seconds, so
            that an interrupted job exits promptly (the config's ``run.interrupt_timeout_s``).
        probe_timeout: seconds one probe of a remote sink's server may take
            (:class:`~tmetrics_core.sinks.registry.RemoteSink`): an unreachable server is said
            within it.
        spool_timeout: how long :meth:`close` then waits for the spool disk, seconds. ``close``
            returns within ``close_timeout + spool_timeout`` seconds.
        spool_queue_size: records that may wait for the spool disk (all sinks together); a step
            that does not fit is dropped and counted.
        alerts: the run's alert rules; :meth:`submit` runs them on each step's records (on the
            training thread, no collective) and the alerts travel with the records to every sink
            that has a ``write_alerts`` method. ``None``: no alerts.

    Raises:
        ConfigError: no sinks are fine, but duplicate names or a non-positive size are not.
    """

    def __init__(
        self,
        sinks: Sequence[MetricSink],
        *,
        spool_dir: str | os.PathLike[str],
        queue_size: int = 2**18,
        retries: int = 3,
        backoff: float = 0.5,
        backoff_max: float = 30.0,
        close_timeout: float = 30.0,
        interrupt_timeout: float = 2.0,
        probe_timeout: float = 2.0,
        spool_timeout: float = 10.0,
        spool_queue_size: int = 2**20,
        alerts: AlertEngine | None = None,
    ) -> None:
        names = [sink.name for sink in sinks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"each sink may appear once; got {duplicates} more than once", path="sinks")
        for option, value, least in (
            ("queue_size", queue_size, 1),
            ("retries", retries, 0),
            ("spool_queue_size", spool_queue_size, 1),
        ):
            if value < least:
                raise ConfigError(f"got {value}; need an integer >= {least}", path=f"hub.{option}")
        for option, seconds in (
            ("backoff", backoff),
            ("backoff_max", backoff_max),
            ("close_timeout", close_timeout),
            ("interrupt_timeout", interrupt_timeout),
            ("probe_timeout", probe_timeout),
            ("spool_timeout", spool_timeout),
        ):
            if not seconds >= 0:
                raise ConfigError(f"got {seconds}; need seconds >= 0", path=f"hub.{option}")
        self.spool_dir = spool_dir
        self.alerts = alerts
        self._close_timeout = close_timeout
        self._interrupt_timeout = interrupt_timeout
        self._spool_timeout = spool_timeout
        self._spiller = Spiller(spool_dir, max_records=spool_queue_size)
        self._workers = [
            SinkWorker(
                sink,
                spiller=self._spiller,
                queue_size=queue_size,
                retries=retries,
                backoff=backoff,
                backoff_max=backoff_max,
                on_open=self._exit_hook_last,
                probe_timeout=probe_timeout,
            )
            for sink in sinks
        ]
        self._lock = threading.RLock()
        self._state = "new"  # new -> open -> closing -> closed
        self._report: HubReport | None = None
        self._late_warned = False

    def open(self, run: RunInfo) -> None:
        """Start the workers; each opens its sink in the background (retrying on failure).
        Returns at once.

        Raises:
            SinkError: the hub was already opened.
        """
        with self._lock:
            if self._state != "new":
                raise SinkError(f"SinkHub.open called twice (state {self._state!r}); open it once per run")
            self._state = "open"
            self._spiller.start(run)
            for worker in self._workers:
                worker.start(run)
            exits.close_at_exit(self._close_at_exit)

    def log_config(self, config: dict[str, Any]) -> None:
        """Queue the run config for every sink, in order with the records; a sink that cannot
        take it gets it in its spool.

        Raises:
            SinkError: the hub is not open.
        """
        self._require_open("log_config")
        item = ConfigItem(config)
        for worker in self._workers:
            worker.offer_control(item)

    def submit(self, records: Sequence[MetricRecord], step: int) -> None:
        """Hand one step's records, and the alerts the rules raise on them, to every sink.
        Training thread; never waits for a sink or the disk. The records are copied into a tuple
        once and shared by the sinks.

        After :meth:`close`, records are not taken: a warning is logged once.

        Raises:
            SinkError: the hub was never opened.
        """
        if self._state != "open":
            if self._state == "new":
                raise SinkError("SinkHub.submit called before open(run); open the hub first")
            if not self._late_warned:
                self._late_warned = True
                _log.warning("SinkHub.submit after close: %d records of step %d are not logged", len(records), step)
            return
        raised = self._alerts_of(records, step) if self.alerts is not None else ()
        batch = Batch(step, records if isinstance(records, tuple) else tuple(records), raised)
        for worker in self._workers:
            worker.offer(batch)

    def _alerts_of(self, records: Sequence[MetricRecord], step: int) -> tuple[Alert, ...]:
        """The alert rules on one step's records; a failure of the rules is logged once and
        turns them off, so it never reaches the training loop."""
        assert self.alerts is not None
        try:
            return tuple(self.alerts.observe(records, step))
        except Exception:
            _log.exception("tmetrics alert rules failed at step %d; alerts are off for the rest of the run", step)
            self.alerts = None
            return ()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written (and each sink's ``flush`` called)
        or spooled (and fsynced). Returns False when ``timeout`` seconds (default: the hub's
        ``close_timeout``) pass first, e.g. because a sink hangs.

        Raises:
            SinkError: the hub is not open.
        """
        self._require_open("flush")
        deadline = time.monotonic() + (self._close_timeout if timeout is None else timeout)
        markers = []
        for worker in self._workers:
            marker = FlushMarker()
            worker.offer_control(marker)
            markers.append(marker)
        return all(m.done.wait(max(deadline - time.monotonic(), 0.0)) for m in markers)

    def close(self, status: RunStatus = "finished", *, timeout: float | None = None) -> HubReport:
        """Drain every sink, close it with ``status``, spool what could not be written, and
        return (and log) the report. Thread-safe and idempotent: later calls return the first
        report. Returns within ``timeout`` (default ``close_timeout``) + ``spool_timeout``
        seconds even when a sink hangs; that sink is then not closed (``closed=False``). The
        queues drain for half of ``timeout``; what is left then is spooled and each sink closed.
        A call re-entering from a signal handler while a close runs returns a snapshot."""
        with self._lock:
            if self._report is not None:
                return self._report
            if self._state == "closing":
                return self._snapshot(status)
            if self._state == "new":
                self._state = "closed"
                self._report = self._snapshot(status)
                return self._report
            self._state = "closing"
            self._report = self._close(status, self._close_timeout if timeout is None else timeout)
            self._state = "closed"
            exits.release(self._close_at_exit)
            return self._report

    def close_interrupted(self) -> HubReport:
        """:meth:`close` with ``"killed"`` within ``interrupt_timeout``: Ctrl-C wants the
        process gone in seconds; what the sinks have not written by then is spooled."""
        return self.close("killed", timeout=self._interrupt_timeout)

    def report(self) -> HubReport:
        """The counts so far (records still queued show as ``pending``)."""
        return self._report if self._report is not None else self._snapshot("finished")

    def _close(self, status: RunStatus, timeout: float) -> HubReport:
        start = time.monotonic()
        deadline = start + timeout
        for worker in self._workers:
            worker.request_close(status, drain_until=start + timeout / 2)
        for worker in self._workers:
            finished = worker.join(deadline - time.monotonic())
            handed = worker.abandon()
            if not finished:
                _log.warning(
                    "sink %s did not finish within %g s; %d unwritten records go to the spool and the "
                    "sink is not closed",
                    worker.sink.name,
                    timeout,
                    handed,
                )
        self._spiller.close(self._spool_timeout)
        report = self._snapshot(status)
        _log.log(logging.INFO if report.complete else logging.WARNING, "%s", report)
        return report

    def _snapshot(self, status: RunStatus) -> HubReport:
        return HubReport(status=status, sinks=tuple(w.counters.report() for w in self._workers))

    def _require_open(self, method: str) -> None:
        if self._state != "open":
            raise SinkError(f"SinkHub.{method} needs an open hub; its state is {self._state!r}")

    def _exit_hook_last(self) -> None:
        """After a sink opened its run, move the exit hook after the tracker library's own
        (:func:`~tmetrics_core.hub.exits.hook_last`), to close the run while the library still
        works. Not under the hub's lock, which ``close`` holds while it waits for the workers."""
        if self._state == "open":
            exits.hook_last()

    def _close_at_exit(self) -> None:
        if self._report is None:
            interrupted = exits.exiting_on_interrupt()
            _log.warning("tmetrics was not closed (call TensorMetrics.close() after the last step, or use it as a "
                         "context manager); closing its sinks at interpreter exit with status %r",
                         "killed" if interrupted else "failed")
            if interrupted:
                self.close_interrupted()
            else:
                self.close("failed")


class NullHub:
    """The hub of a rank that does not log: every method accepts its arguments and does
    nothing, so training code needs no ``if rank == 0``."""

    def open(self, run: RunInfo) -> None:
        """Does nothing."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Does nothing."""

    def submit(self, records: Sequence[MetricRecord], step: int) -> None:
        """Does nothing: records on a non-logging rank are never built for sinks."""

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing to wait for: True."""
        return True

    def close(self, status: RunStatus = "finished", *, timeout: float | None = None) -> HubReport:
        """An empty report."""
        return HubReport(status=status, sinks=())

    def close_interrupted(self) -> HubReport:
        """An empty report."""
        return HubReport(status="killed", sinks=())

    def report(self) -> HubReport:
        """An empty report."""
        return HubReport(status="finished", sinks=())
