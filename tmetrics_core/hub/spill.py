"""The spool thread of a ``SinkHub``: writes what sinks could not take to their spool files.

Work reaches it from three places: the training thread (a sink's queue was full), a sink's
worker (writes failed after retries, or the sink is not open), and ``SinkHub.close`` (what a
hung sink left). One thread serves every sink, so the training thread never does disk I/O.
Its queue is bounded too; a batch that finds it full is counted as dropped and logged.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Union

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.hub.report import SinkCounters
from tmetrics_core.records import MetricRecord, RunInfo
from tmetrics_core.hub.spool import SpoolWriter, spool_path

__all__ = ["Batch", "ConfigItem", "FlushMarker", "Item", "Spiller"]

_log = logging.getLogger("tmetrics.hub")


@dataclass(frozen=True, slots=True)
class Batch:
    """The records of one ``submit`` call (one step), shared read-only by every sink, and the
    alerts the rules raised on them."""

    step: int
    records: tuple[MetricRecord, ...]
    alerts: tuple[Alert, ...] = ()


@dataclass(frozen=True, slots=True)
class ConfigItem:
    """A ``log_config`` call, queued in order with the batches."""

    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FlushMarker:
    """Set once every item queued before it has been handled."""

    done: threading.Event = field(default_factory=threading.Event)


Item = Union[Batch, ConfigItem, FlushMarker]


class Spiller:
    """One thread appending batches and configs to ``<spool_dir>/<sink>.jsonl``.

    Args:
        spool_dir: directory of the spool files (created on the first spill).
        max_records: records that may wait for the disk (all sinks together); a batch that does
            not fit is dropped and counted (one larger than this is taken when the queue is empty).
    """

    def __init__(self, spool_dir: str | os.PathLike[str], *, max_records: int) -> None:
        self.spool_dir = spool_dir
        self._max_records = max_records
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[SinkCounters, Item]] = collections.deque()
        self._queued_records = 0
        self._inflight: tuple[SinkCounters, Item] | None = None
        self._closing = False
        self._abandoned = False
        self._writers: dict[str, SpoolWriter] = {}
        self._run: RunInfo | None = None
        self._warned_full = False
        self._thread = threading.Thread(target=self._loop, name="tmetrics-spool", daemon=True)

    def start(self, run: RunInfo) -> None:
        """Start the thread; ``run`` heads every new spool file."""
        self._run = run
        self._thread.start()

    def offer(self, counters: SinkCounters, item: Item) -> None:
        """Queue ``item`` for ``counters.sink``'s spool; never blocks. A batch that finds the queue
        full (or the spiller closed) is counted as dropped; a marker is set at once if the
        spiller is closed."""
        with self._cond:
            if isinstance(item, FlushMarker):
                if self._abandoned:
                    item.done.set()
                else:
                    self._queue.append((counters, item))
                    self._cond.notify()
                return
            n = len(item.records) if isinstance(item, Batch) else 0
            queued = self._queued_records
            if self._abandoned or (queued and queued + n > self._max_records):
                self._drop(counters, item, "the spool queue is full" if not self._abandoned else "the spool is closed")
                return
            self._queue.append((counters, item))
            self._queued_records = queued + n
            self._cond.notify()

    def offer_merged(self, counters: SinkCounters, items: list[Item]) -> None:
        """:meth:`offer` each of ``items``, with each run of consecutive batches joined into one,
        so the spool writes (and fsyncs) once per run instead of once per step; every record
        keeps its own step."""
        out: list[Item] = []
        for item in items:
            last = out[-1] if out else None
            if isinstance(item, Batch) and isinstance(last, Batch):
                out[-1] = Batch(item.step, last.records + item.records, last.alerts + item.alerts)
            else:
                out.append(item)
        for item in out:
            self.offer(counters, item)

    def close(self, timeout: float) -> None:
        """Write what is queued, waiting at most ``timeout`` seconds; count the rest as dropped."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            self._abandoned = True
            leftovers = list(self._queue)
            self._queue.clear()
            self._queued_records = 0
            if self._inflight is not None:
                leftovers.insert(0, self._inflight)
                self._inflight = None
            for counters, item in leftovers:
                self._drop(counters, item, f"the spool disk did not take it within {timeout:g} s")
            if not self._thread.is_alive():  # a thread stuck in a write keeps its descriptor
                for writer in self._writers.values():
                    writer.close()

    def _drop(self, counters: SinkCounters, item: Item, why: str) -> None:
        if isinstance(item, FlushMarker):
            item.done.set()
            return
        if isinstance(item, Batch):
            counters.add("dropped", len(item.records))
        if not self._warned_full or isinstance(item, ConfigItem):
            self._warned_full = True
            what = (
                "the run config" if isinstance(item, ConfigItem) else f"{len(item.records)} records of step {item.step}"
            )
            _log.warning(
                "%s for sink %s could not be spooled (%s) and are lost; they are counted as dropped "
                "in the hub report (further drops are only counted)",
                what,
                counters.sink,
                why,
            )

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing and not self._abandoned:
                    self._cond.wait()
                if self._abandoned or not self._queue:
                    return
                entry = self._queue.popleft()
                if isinstance(entry[1], Batch):
                    self._queued_records -= len(entry[1].records)
                self._inflight = entry
            counters, item = entry
            outcome = self._write(counters, item)
            with self._cond:
                if self._abandoned:
                    return  # close() already counted this item as dropped
                self._inflight = None
                if isinstance(item, Batch):
                    written = outcome
                    counters.add("spooled", written)
                    counters.add("dropped", len(item.records) - written)
                elif isinstance(item, FlushMarker):
                    item.done.set()

    def _write(self, counters: SinkCounters, item: Item) -> int:
        if isinstance(item, FlushMarker):
            return 0
        writer = self._writers.get(counters.sink)
        if writer is None:
            path = spool_path(self.spool_dir, counters.sink)
            writer = self._writers[counters.sink] = SpoolWriter(path, sink=counters.sink, run=self._run)
            counters.spool_path = str(path)
        if isinstance(item, ConfigItem):
            if not writer.write_config(item.config):
                _log.warning("the run config for sink %s could not be spooled and is lost", counters.sink)
            return 0
        started = time.monotonic()
        if item.alerts:
            writer.write_alerts(item.alerts)
        written = writer.write_records(item.records)
        _log.debug(
            "spooled %d records of step %d for %s in %.3f s",
            written,
            item.step,
            counters.sink,
            time.monotonic() - started,
        )
        return written
