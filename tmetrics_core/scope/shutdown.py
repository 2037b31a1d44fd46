"""Closing a :class:`~tmetrics_core.tensor_metrics.TensorMetrics`: ``close()``, the context
manager, a ``close()`` asked for inside a step scope, Ctrl-C, and SIGTERM.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from tmetrics_core.distributed.executor import Pending
from tmetrics_core.errors import TMetricsError
from tmetrics_core.hub.exits import on_sigterm
from tmetrics_core.records import RunStatus

__all__ = ["Shutdown"]

log = logging.getLogger("tmetrics")


class Shutdown:
    """Closing and the calls refused after it, mixed into
    :class:`~tmetrics_core.tensor_metrics.TensorMetrics` (whose state they read)."""

    hub: Any
    _closed: bool
    _closed_by_signal: bool
    _interrupted: bool
    _in_scope: bool
    _close_at_step_end: RunStatus | None
    _report: Any
    _observed: list[Any]
    _hooks: list[Any]
    _in_flight: tuple[int, Pending] | None
    _deliver: Callable[[int, Pending], None]
    """Reads and submits a launched step's results (:meth:`~tmetrics_core.scope.step_end.StepEnd._deliver`)."""

    def _check_open(self, call: str) -> None:
        """Raise after :meth:`close`, unless SIGTERM closed this object: a job shutting down
        gracefully may finish its step, and its ranks must keep running the same collectives
        (the records then go nowhere; the hub warns once)."""
        if self._closed and not self._closed_by_signal:
            raise TMetricsError(
                f"TensorMetrics.{call} called after close(): its optimizer hooks are removed and its "
                "sinks have ended their runs. Call close() once, after the last step; to measure "
                "another run, create a new TensorMetrics (e.g. TensorMetrics.from_config(...))"
            )

    def close(self, status: RunStatus = "finished") -> Any:
        """Remove hooks, flush every sink and end the tracker runs with ``status``; returns the
        hub's report (counts written, retried, spooled, dropped per sink; None without a hub).
        Idempotent: a later call returns the same report (the status of the first close
        stands). Called inside an open step scope, it returns None and closes at the scope's
        end, after that step is measured and logged (its optimizer hooks and observations still
        run), with the first status asked for (``"failed"`` where the scope's body raised and
        ``"finished"`` was asked); ``close()`` after the scope returns that report. SIGTERM
        closes at once."""
        if self._closed:
            return self._report
        if self._in_scope and not self._closed_by_signal:
            if self._close_at_step_end is None:
                self._close_at_step_end = status
            return None
        self._closed = True
        for h in [*self._observed, *self._hooks]:
            h.remove()
        try:
            if self._in_flight is not None:  # read_results: next-step; the last due step's results
                earlier, self._in_flight = self._in_flight, None
                self._deliver(*earlier)
        finally:  # what the sinks already have is flushed even if that step cannot be read
            self._report = (None if self.hub is None else self.hub.close_interrupted() if self._interrupted
                            else self.hub.close(status))
        return self._report

    def _close_deferred(self, failed: bool) -> None:
        """The :meth:`close` asked for inside the scope that just ended: ``"failed"`` instead
        of ``"finished"`` when the scope's body raised; a close that raises then is logged, so
        the body's own exception is the one that propagates."""
        status, self._close_at_step_end = self._close_at_step_end, None
        assert status is not None  # called only with a close pending
        try:
            self.close("failed" if failed and status == "finished" else status)
        except Exception:
            if not failed:
                raise
            log.exception("tmetrics: close() asked for inside the step scope failed at the scope's end")

    def _close_interrupted(self) -> None:
        """Ctrl-C (``KeyboardInterrupt``) left a step scope: close with ``"killed"`` now, while
        the tracker libraries still work (a loop with no ``with`` and no ``finally`` otherwise
        closes at interpreter exit, after some have torn down). As after SIGTERM, later step
        scopes still run and log nothing, so a loop that catches the interrupt goes on."""
        self._closed_by_signal = self._interrupted = True
        try:
            self.close("killed")
        except Exception:
            log.exception("tmetrics: closing after KeyboardInterrupt failed")

    def _install_signal_handler(self) -> None:
        def closed_by_sigterm() -> None:
            self._closed_by_signal = not self._closed
            self.close("killed")

        on_sigterm(closed_by_sigterm)
