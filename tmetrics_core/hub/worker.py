"""One sink's bounded queue and worker thread inside a ``SinkHub``.

The worker owns every call to its sink. Its life:

1. **open**: ``sink.open(run)`` is retried with capped exponential backoff until it succeeds or
   the hub closes; meanwhile queued batches go to the spool, so an unreachable backend costs
   neither memory nor training time. A sink with a ``probe`` method
   (:class:`~tmetrics_core.sinks.registry.RemoteSink`) is probed before each attempt, with a short
   timeout and no retries, so an unreachable server is said (a warning) within that timeout rather
   than after its client library's own retries.
2. **deliver**: each batch is written with up to ``retries`` retries and backoff. A batch that
   still fails goes to the spool and the sink is marked *down*: later batches go straight to
   the spool until a probe time, when one attempt is made (success makes it healthy again;
   failure doubles the probe interval up to ``backoff_max``). A sink that raises on every call
   thus costs one attempt per probe interval, not ``retries`` attempts per step.
3. **close**: after the queue is drained, ``sink.close(status)`` (retried like a write). The
   drain has a deadline: what is still queued then goes to the spool, and the sink is closed.
   A backlog that the sink's measured write time says cannot be written by the deadline goes
   to the spool at once, so a sink that is behind (a Ctrl-C with a slow tracker) does not hold
   the close for the whole drain only to spool the rest anyway.

Ownership of each item is decided under one lock: an item is in the queue, in flight in the
worker, or handed to the spool, never two of these. When ``SinkHub.close`` gives up on a worker
(a sink hung past the close timeout) it calls :meth:`SinkWorker.abandon`, which takes the
queue and the in-flight batch for the spool; if the hung call later returns, the worker stops
without counting or touching anything. Delivery is therefore at least once: a hung write that
completes after being abandoned leaves its batch both in the backend and in the spool.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from tmetrics_core.hub.attempts import Abandoned, RetryCallState, call_counted, retrying
from tmetrics_core.hub.report import SinkCounters
from tmetrics_core.records import RunInfo, RunStatus
from tmetrics_core.sinks.registry import MetricSink
from tmetrics_core.hub.spill import Batch, ConfigItem, FlushMarker, Item, Spiller

__all__ = ["SinkWorker"]

_log = logging.getLogger("tmetrics.hub")


class SinkWorker:
    """A bounded queue and one daemon thread calling one sink.

    Args:
        sink: the sink; only this worker's thread calls it.
        spiller: where batches the sink cannot take go.
        queue_size: records that may wait for the sink; a batch that does not fit spills to the
            spool (a batch larger than this is still taken when the queue is empty).
        retries: extra attempts for a failing call before its batch is spooled.
        backoff: first wait between attempts, in seconds; doubles each time, with up to
            ``backoff`` seconds of random jitter.
        backoff_max: longest wait between attempts and between probes of a down sink, seconds.
        on_open: called on the worker's thread once the sink has opened.
        probe_timeout: seconds one ``probe`` of a remote sink may take.
    """

    def __init__(
        self,
        sink: MetricSink,
        *,
        spiller: Spiller,
        queue_size: int,
        retries: int,
        backoff: float,
        backoff_max: float,
        on_open: Callable[[], None],
        probe_timeout: float,
    ) -> None:
        self.sink = sink
        self._on_open = on_open
        self._probe_timeout = probe_timeout
        self._drain_until = float("inf")
        self._write_s: float | None = None  # moving average of one successful write, seconds
        self.counters = SinkCounters(sink.name)
        self._spiller = spiller
        self._queue_size = queue_size
        self._retries = retries
        self._backoff = backoff
        self._backoff_max = backoff_max
        self._cond = threading.Condition()
        self._queue: collections.deque[Item] = collections.deque()
        self._queued_records = 0
        self._inflight: Item | None = None
        self._closing = threading.Event()
        self._abandoned = threading.Event()
        self._status: RunStatus = "finished"
        self._down_until: float | None = None
        self._probe_delay = backoff
        self._warned_full = False
        self._thread = threading.Thread(target=self._run, name=f"tmetrics-sink-{sink.name}", daemon=True)
        self._run_info: RunInfo | None = None

    # ---- called from other threads -------------------------------------------------------

    def start(self, run: RunInfo) -> None:
        """Start the thread, which opens the sink for ``run``."""
        self._run_info = run
        self._thread.start()

    def offer(self, batch: Batch) -> None:
        """Queue ``batch`` (training thread): a deque append under a lock, never I/O. A full
        queue sends the batch to the spool instead of waiting."""
        n = len(batch.records)
        self.counters.add("submitted", n)
        with self._cond:
            queued = self._queued_records
            if not self._abandoned.is_set() and (queued == 0 or queued + n <= self._queue_size):
                self._queue.append(batch)
                self._queued_records = queued + n
                self._cond.notify()
                return
            warn = not self._warned_full
            self._warned_full = True
        if warn:
            _log.warning(
                "sink %s is behind (its queue of %d records is full); step %d and later overflow go "
                "to the spool instead of waiting",
                self.sink.name,
                self._queue_size,
                batch.step,
            )
        self._spiller.offer(self.counters, batch)

    def offer_control(self, item: ConfigItem | FlushMarker) -> None:
        """Queue a config or a flush marker in order with the batches (not bounded)."""
        with self._cond:
            if not self._abandoned.is_set():
                self._queue.append(item)
                self._cond.notify()
                return
        self._spiller.offer(self.counters, item)

    def request_close(self, status: RunStatus, *, drain_until: float) -> None:
        """Ask the worker to drain its queue until ``drain_until`` (``time.monotonic()``
        seconds), spool what is left then, and close the sink with ``status``."""
        with self._cond:
            self._status = status
            self._drain_until = drain_until
            self._closing.set()
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True when it has ended."""
        if self._thread.is_alive():
            self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()

    def abandon(self) -> int:
        """Give up on the worker: hand its queued and in-flight items to the spool. Returns the
        number of records handed over. The thread, if still inside a sink call, stops touching
        anything when that call returns."""
        with self._cond:
            self._abandoned.set()
            leftovers = list(self._queue)
            self._queue.clear()
            self._queued_records = 0
            if self._inflight is not None:
                leftovers.insert(0, self._inflight)
                self._inflight = None
            self._cond.notify_all()
            for item in leftovers:
                self._spiller.offer(self.counters, item)
        return sum(len(item.records) for item in leftovers if isinstance(item, Batch))

    # ---- the worker thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._open()
            while (item := self._take()) is not None:
                self._handle(item)
            self._close_sink()
        except Abandoned:
            return
        except BaseException:
            _log.exception(
                "tmetrics worker for sink %s crashed; its queued records go to the spool at close", self.sink.name
            )

    def _take(self) -> Item | None:
        with self._cond:
            while True:
                if self._abandoned.is_set():
                    raise Abandoned
                if self._closing.is_set() and self._queue and self._misses_drain_deadline():
                    self._spool_at_deadline()
                if self._queue:
                    item = self._queue.popleft()
                    if isinstance(item, Batch):
                        self._queued_records -= len(item.records)
                    self._inflight = item
                    return item
                if self._closing.is_set():
                    return None
                self._cond.wait()

    def _misses_drain_deadline(self) -> bool:
        """The close's drain deadline has passed, or the queue would not be written by then at
        the sink's average write time (the caller holds the lock)."""
        now = time.monotonic()
        expected = 0.0 if self._write_s is None else self._write_s * len(self._queue)
        return now + expected > self._drain_until

    def _spool_at_deadline(self) -> None:
        """The queue would not be written by the close's drain deadline (the caller holds the
        lock): it goes to the spool, and the sink is closed next."""
        left = list(self._queue)
        self._queue.clear()
        self._queued_records = 0
        self._spiller.offer_merged(self.counters, left)
        took = f" of about {self._write_s:.3f} s" if self._write_s is not None else ""  # none measured yet
        _log.warning("sink %s: %d queued records would not be written by the close's drain deadline (%d writes%s); "
                     "they go to the spool and the sink is closed now", self.sink.name,
                     sum(len(i.records) for i in left if isinstance(i, Batch)), len(left), took)

    def _release(self, *, spill: bool, written: int = 0, retried: int = 0) -> None:
        """End ownership of the in-flight item: spill it when asked, count what was written.
        Under the lock, so :meth:`abandon` sees either the item or its counts, never neither."""
        with self._cond:
            if self._abandoned.is_set():
                raise Abandoned
            item, self._inflight = self._inflight, None
            if spill and item is not None:
                self._spiller.offer(self.counters, item)
            if written:
                self.counters.add("written", written)
            if retried:
                self.counters.add("retried", retried)

    def _open(self) -> None:
        assert self._run_info is not None
        run = self._run_info
        policy = retrying(backoff=self._backoff, backoff_max=self._backoff_max, sleep=self._spill_while_waiting,
                          before_sleep=self._log_open_retry, until=self._closing)
        probe = getattr(self.sink, "probe", None)

        def probe_then_open() -> None:
            if probe is not None:
                probe(self._probe_timeout)
            self.sink.open(run)

        try:
            call_counted(policy, probe_then_open, self.counters, self._abandoned)
        except Abandoned:
            raise
        except Exception as error:
            _log.error(
                "sink %s could not be opened (%r); every record for it goes to the spool",
                self.sink.name,
                error,
            )
            return
        if self._abandoned.is_set():  # an open that hung past the close timeout came back too late
            raise Abandoned
        self.counters.opened = True
        self._on_open()
        _log.info("sink %s opened", self.sink.name)

    def _log_open_retry(self, state: RetryCallState) -> None:
        _log.log(logging.WARNING if state.attempt_number == 1 else logging.DEBUG,
                 "sink %s failed to open (%r); retrying in the background (waits of up to %.3g s); records go to "
                 "the spool meanwhile", self.sink.name, state.outcome.exception() if state.outcome else None,
                 self._backoff_max)

    def _spill_while_waiting(self, seconds: float) -> None:
        """tenacity's sleep while the sink is not open: spool what arrives, wake on close."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while True:
                if self._abandoned.is_set():
                    raise Abandoned
                while self._queue:
                    item = self._queue.popleft()
                    if isinstance(item, Batch):
                        self._queued_records -= len(item.records)
                    self._spiller.offer(self.counters, item)
                remaining = deadline - time.monotonic()
                if self._closing.is_set() or remaining <= 0:
                    return
                self._cond.wait(remaining)

    def _handle(self, item: Item) -> None:
        if isinstance(item, FlushMarker):
            if self.counters.opened and self._down_until is None:
                self._try(lambda: self.sink.flush(), attempts=1, what="flush", then="nothing to spool")
            self._release(spill=True)  # the spool thread sets the marker after earlier spills
            return
        if not self.counters.opened:
            self._release(spill=True)
            return
        if self._down_until is not None and time.monotonic() < self._down_until:
            self._release(spill=True)
            return
        attempts = 1 if self._down_until is not None else self._retries + 1
        if isinstance(item, Batch):
            records, step = item.records, item.step
            started = time.monotonic()
            ok, retried = self._try(
                lambda: self.sink.write(records, step),
                attempts=attempts,
                what=f"write of step {step}",
                then=self._spool_note(),
            )
            if ok and not retried:
                took = time.monotonic() - started
                self._write_s = took if self._write_s is None else 0.8 * self._write_s + 0.2 * took
            if ok and item.alerts:
                self._write_alerts(item)
        else:
            config = item.config
            ok, retried = self._try(
                lambda: self.sink.log_config(config), attempts=attempts, what="log_config", then=self._spool_note()
            )
        if ok:
            if self._down_until is not None:
                _log.info("sink %s recovered; writing again", self.sink.name)
            self._down_until, self._probe_delay = None, self._backoff
        else:
            self._down_until = time.monotonic() + self._probe_delay
            self._probe_delay = min(2 * self._probe_delay, self._backoff_max)
        n = len(item.records) if isinstance(item, Batch) else 0
        self._release(spill=not ok, written=n if ok else 0, retried=n if retried else 0)

    def _write_alerts(self, batch: Batch) -> None:
        """Give the batch's alerts (its records are written) to the sink's optional
        ``write_alerts``; a sink without one ignores alerts. Alerts it fails to take after the
        retries go to the spool alone, as ``alert`` lines; the records stay written."""
        write_alerts = getattr(self.sink, "write_alerts", None)
        if write_alerts is None:
            return
        alerts, step = batch.alerts, batch.step
        ok, _ = self._try(lambda: write_alerts(alerts, step), attempts=self._retries + 1,
                          what=f"write_alerts of step {step}", then="the alerts go to the spool")
        if not ok:
            self._spiller.offer(self.counters, Batch(step, (), alerts))

    def _close_sink(self) -> None:
        if not self.counters.opened:
            return
        ok, _ = self._try(
            lambda: self.sink.close(self._status),
            attempts=self._retries + 1,
            what=f"close({self._status!r})",
            then="the backend run may be left open",
        )
        self.counters.closed = ok

    def _spool_note(self) -> str:
        return f"it goes to the spool; the sink is probed again in {self._probe_delay:.3g} s"

    def _sleep(self, seconds: float) -> None:
        """tenacity's sleep between attempts: wakes early when the hub abandons this worker."""
        self._abandoned.wait(seconds)

    def _try(self, call: Callable[[], Any], *, attempts: int, what: str, then: str) -> tuple[bool, bool]:
        """``(succeeded, needed a retry)``; exceptions are counted and logged, never raised
        (except :class:`Abandoned`)."""
        retried = False

        def note_retry(state: RetryCallState) -> None:
            nonlocal retried
            retried = True

        policy = retrying(backoff=self._backoff, backoff_max=self._backoff_max, sleep=self._sleep,
                          before_sleep=note_retry, attempts=attempts)
        try:
            call_counted(policy, call, self.counters, self._abandoned)
        except Abandoned:
            raise
        except Exception as error:
            level = logging.WARNING if self._down_until is None else logging.DEBUG
            _log.log(
                level, "sink %s: %s failed after %d attempt(s) (%r); %s", self.sink.name, what, attempts, error, then
            )
            return False, retried
        return True, retried
