"""The ``MetricSink`` protocol and entry-point discovery of sinks.

A sink is one small class with a ``name`` and five methods. Sinks are registered under the
entry-point group ``tmetrics.sinks``; only the sinks a config names are imported, so a broken,
merely installed plugin cannot stop training.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from tmetrics_core.records import MetricRecord, RunInfo, RunStatus

__all__ = ["MetricSink"]


@runtime_checkable
class MetricSink(Protocol):
    """Writes finished records to one backend. Runs on the logging rank only, on its own worker
    thread (see ``tmetrics_core.hub``), so a method may block without stalling training.

    Construction takes the sink's options from the config (``sinks: {tensorboard: {...}}``) as
    keyword arguments and raises :class:`~tmetrics_core.errors.ConfigError` for an unknown or
    invalid option; it must not touch the backend yet (that happens in ``open``).
    """

    name: str
    """The entry-point name, e.g. ``"tensorboard"``."""

    def open(self, run: RunInfo) -> None:
        """Start the backend run (import the backend library here). May raise; the hub retries."""
        ...

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run config once (params, hyper-parameters). Secrets are already redacted."""
        ...

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Write every record of one step. Raising means none of them was written."""
        ...

    def flush(self) -> None:
        """Push buffered data to durable storage."""
        ...

    def close(self, status: RunStatus) -> None:
        """Flush and end the backend run with ``status``."""
        ...
