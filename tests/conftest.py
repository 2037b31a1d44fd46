"""Fixtures shared across the test suite: fake sinks and sample records.

The fake sinks are real ``MetricSink`` implementations with controlled misbehaviour:

- ``recording_sink``: keeps every call (records are kept as handed over, not copied).
- ``failing_sink``: raises ``ConnectionError`` on every call (``fail_open=True``: open too).
- ``hanging_sink``: ``write`` blocks for 10 s (released at teardown so no thread lingers).
- ``unreachable_sink``: ``open`` connects to a TCP port on 127.0.0.1 that refuses connections
  (a real socket, bound but not listening) until ``make_reachable()`` starts listening.

Each fixture returns a factory taking ``name=`` so one test can hold several of a kind.
"""

from __future__ import annotations

import math
import socket
import threading
from typing import Any, Callable, Iterator, Sequence

import pytest

from tmetrics_core.sinks.keys import PLAIN_RULES, KeyRules
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo, RunStatus

LAYERS = 4
EXPERTS = 3


class RecordingSink:
    """Keeps every call; thread-safe. ``batches`` holds ``(step, records)`` per ``write``."""

    key_rules: KeyRules = PLAIN_RULES
    requires: tuple[str, ...] = ()

    def __init__(self, name: str = "recording") -> None:
        self.name = name
        self.lock = threading.Lock()
        self.runs: list[RunInfo] = []
        self.configs: list[dict[str, Any]] = []
        self.batches: list[tuple[int, Sequence[MetricRecord]]] = []
        self.flushes = 0
        self.statuses: list[RunStatus] = []
        self.threads: set[int] = set()

    @property
    def records(self) -> list[MetricRecord]:
        with self.lock:
            return [r for _, batch in self.batches for r in batch]

    def _note_thread(self) -> None:
        self.threads.add(threading.get_ident())

    def open(self, run: RunInfo) -> None:
        with self.lock:
            self._note_thread()
            self.runs.append(run)

    def log_config(self, config: dict[str, Any]) -> None:
        with self.lock:
            self._note_thread()
            self.configs.append(config)

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        with self.lock:
            self._note_thread()
            self.batches.append((step, records))

    def flush(self) -> None:
        with self.lock:
            self._note_thread()
            self.flushes += 1

    def close(self, status: RunStatus) -> None:
        with self.lock:
            self._note_thread()
            self.statuses.append(status)


class FailingSink(RecordingSink):
    """Raises ``ConnectionError`` on every call (``open`` too when ``fail_open``); counts calls."""

    def __init__(self, name: str = "failing", *, fail_open: bool = False) -> None:
        super().__init__(name)
        self.fail_open = fail_open
        self.calls = 0

    def _fail(self) -> None:
        with self.lock:
            self.calls += 1
        raise ConnectionError(f"{self.name}: backend down")

    def open(self, run: RunInfo) -> None:
        if self.fail_open:
            self._fail()
        super().open(run)

    def log_config(self, config: dict[str, Any]) -> None:
        self._fail()

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        self._fail()

    def flush(self) -> None:
        self._fail()

    def close(self, status: RunStatus) -> None:
        self._fail()


class HangingSink(RecordingSink):
    """``write`` blocks ``hang_s`` seconds (or until :meth:`release`), then records normally."""

    def __init__(self, name: str = "hanging", *, hang_s: float = 10.0) -> None:
        super().__init__(name)
        self.hang_s = hang_s
        self.entered = threading.Event()
        self.returned = 0
        self._release = threading.Event()

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        self.entered.set()
        self._release.wait(self.hang_s)
        super().write(records, step)
        with self.lock:
            self.returned += 1

    def release(self) -> None:
        self._release.set()


class UnreachableSink(RecordingSink):
    """``open`` makes a real TCP connection to 127.0.0.1; refused until :meth:`make_reachable`."""

    def __init__(self, name: str = "unreachable") -> None:
        super().__init__(name)
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        self.port = self._server.getsockname()[1]
        self.open_attempts = 0

    def open(self, run: RunInfo) -> None:
        with self.lock:
            self.open_attempts += 1
        socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        super().open(run)

    def make_reachable(self) -> None:
        self._server.listen(16)

    def shutdown(self) -> None:
        self._server.close()


def make_step_records(step: int) -> list[MetricRecord]:
    """One step of every record shape: global, per layer, per layer and stat, per layer and
    expert, per tensor, vectors, histograms, and NaN and infinities."""
    s = step
    out = [MetricRecord("global-grad-l2", s, 1.5 * s), MetricRecord("output-entropy", s, math.nan)]
    for i in range(LAYERS):
        out.append(MetricRecord("layer-grad-l2", s, s + i / 10, labels=Labels(layer=i)))
        out.append(MetricRecord("layer-expert-load-imbalance", s, 1 + i / 10, labels=Labels(layer=i, stat="max_over_mean")))
        out.append(
            MetricRecord("layer-expert-tokens", s, tuple(float(10 * s + e + i) for e in range(EXPERTS)), labels=Labels(layer=i))
        )
        out.append(
            MetricRecord(
                "layer-grad-histogram",
                s,
                Histogram(edges=(1e-3, 1e-2, 1e-1, 1.0), counts=(i, 2, 3 + s), zeros=1, nan=i % 2, posinf=1),
                labels=Labels(layer=i),
            )
        )
        for e in range(EXPERTS):
            out.append(MetricRecord("layer-router-expert-bias", s, s * 0.5 + e - i, labels=Labels(layer=i, expert=e)))
    out.append(MetricRecord("tensor-grad-l2", s, math.inf, labels=Labels(tensor="layers.0.attn.q.weight")))
    out.append(MetricRecord("family-grad-l2", s, -math.inf, labels=Labels(tensor="layers.*.attn.q.weight")))
    return out


def rows(records: Sequence[MetricRecord]) -> list[tuple[Any, ...]]:
    """Records as comparable tuples (NaN compares equal through its JSON form)."""
    return [(r.step, r.metric, tuple(r.labels.as_dict().items()), repr(r.value_json())) for r in records]


@pytest.fixture
def step_records() -> Callable[[int], list[MetricRecord]]:
    """``step_records(step)``: about 50 records of every shape (see :func:`make_step_records`)."""
    return make_step_records


@pytest.fixture
def record_rows() -> Callable[[Sequence[MetricRecord]], list[tuple[Any, ...]]]:
    """``record_rows(records)``: records as comparable tuples, NaN included."""
    return rows


@pytest.fixture
def sample_run(tmp_path) -> RunInfo:
    """A run in ``tmp_path/run`` with the layer and expert counts of :func:`make_step_records`."""
    return RunInfo(name="test-run", dir=str(tmp_path / "run"), num_layers=LAYERS, num_experts=EXPERTS)


@pytest.fixture
def recording_sink() -> Callable[..., RecordingSink]:
    return RecordingSink


@pytest.fixture
def failing_sink() -> Callable[..., FailingSink]:
    return FailingSink


@pytest.fixture
def hanging_sink() -> Iterator[Callable[..., HangingSink]]:
    made: list[HangingSink] = []

    def make(*args: Any, **kwargs: Any) -> HangingSink:
        made.append(HangingSink(*args, **kwargs))
        return made[-1]

    yield make
    for sink in made:
        sink.release()


@pytest.fixture
def unreachable_sink() -> Iterator[Callable[..., UnreachableSink]]:
    made: list[UnreachableSink] = []

    def make(*args: Any, **kwargs: Any) -> UnreachableSink:
        made.append(UnreachableSink(*args, **kwargs))
        return made[-1]

    yield make
    for sink in made:
        sink.shutdown()
