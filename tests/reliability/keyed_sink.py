"""A third-party style sink that takes credentials as options (``api_key``, ``endpoint``,
``password``), as a hosted tracker's sink would. Its backend is never reachable: ``open``
raises, so everything it is given goes to its spool; what it was handed is also kept in
``<run dir>/keyed-calls.json`` so a test can check that no secret reached it either."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from tmetrics_core.sinks.keys import PLAIN_RULES, KeyRules
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus

__all__ = ["KeyedSink"]


class KeyedSink:
    name: ClassVar[str] = "keyed"
    key_rules: ClassVar[KeyRules] = PLAIN_RULES
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, api_key: str, endpoint: str, password: str) -> None:
        self._credentials = (api_key, endpoint, password)  # used to connect, never logged

    def open(self, run: RunInfo) -> None:
        path = Path(run.dir) / "keyed-calls.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_config": run.config, "tags": run.tags}, default=str))
        raise ConnectionError("keyed tracker unreachable")

    def log_config(self, config: dict[str, Any]) -> None:
        raise ConnectionError("keyed tracker unreachable")

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        raise ConnectionError("keyed tracker unreachable")

    def flush(self) -> None:
        raise ConnectionError("keyed tracker unreachable")

    def close(self, status: RunStatus) -> None:
        raise ConnectionError("keyed tracker unreachable")
