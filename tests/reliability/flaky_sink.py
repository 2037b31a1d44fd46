"""A sink whose backend (a JSON-lines file, the ``jsonl`` format) fails a fixed share of calls.

Every call (``open``, ``log_config``, ``write``, ``flush``, ``close``) first draws from a seeded
generator and raises ``ConnectionError`` with probability ``failure_rate``, before touching the
file, so a failed call writes nothing and a successful one writes everything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

from tmetrics_core.sinks.jsonl import JsonlSink
from tmetrics_core.sinks.keys import PLAIN_RULES, KeyRules
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus

__all__ = ["FlakySink"]


class FlakySink:
    name: ClassVar[str] = "flaky"
    key_rules: ClassVar[KeyRules] = PLAIN_RULES
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, path: str, failure_rate: float = 0.3, seed: int = 0) -> None:
        self._backend = JsonlSink(path=path)
        self._random = random.Random(seed)
        self.failure_rate = failure_rate
        self.calls = 0
        self.failures = 0

    def _maybe_fail(self, what: str) -> None:
        self.calls += 1
        if self._random.random() < self.failure_rate:
            self.failures += 1
            raise ConnectionError(f"flaky backend: {what} refused")

    def open(self, run: RunInfo) -> None:
        self._maybe_fail("open")
        self._backend.open(run)

    def log_config(self, config: dict[str, Any]) -> None:
        self._maybe_fail("log_config")

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        self._maybe_fail(f"write of step {step}")
        self._backend.write(records, step)

    def flush(self) -> None:
        self._maybe_fail("flush")
        self._backend.flush()

    def close(self, status: RunStatus) -> None:
        self._maybe_fail("close")
        self._backend.close(status)
