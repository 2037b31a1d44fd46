"""A :meth:`TensorMetrics.step` scope held open across a framework's callbacks.

Frameworks call back at a step's start and end from different places (``on_step_begin`` and
``on_step_end``, a forward pre-hook and an optimizer post-hook), so the ``with`` block of a hand
written loop becomes an explicit open and close here.
"""

from __future__ import annotations

from typing import Any, ContextManager

from tmetrics_core.errors import TMetricsError
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["OpenScope"]


class OpenScope:
    """The step scope of ``metrics`` between :meth:`open` and :meth:`close` (at most one open)."""

    def __init__(self, metrics: TensorMetrics) -> None:
        self.metrics = metrics
        self.step: int | None = None
        self._scope: ContextManager[Any] | None = None

    @property
    def is_open(self) -> bool:
        return self._scope is not None

    def open(self, step: int) -> None:
        """Enter ``metrics.step(step)``.

        Raises:
            TMetricsError: a scope is already open (the framework skipped the call that ends a step).
        """
        if self._scope is not None:
            raise TMetricsError(f"step {step} begins while step {self.step} is still open; the framework "
                                "skipped the callback that ends a step")
        scope = self.metrics.step(step)
        scope.__enter__()
        self._scope, self.step = scope, step

    def close(self) -> None:
        """Leave the open scope: the due metrics are reduced and their records go to the sinks."""
        scope, self._scope, self.step = self._scope, None, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def abandon(self, reason: BaseException) -> None:
        """Leave the open scope without records: training raised ``reason`` inside the step."""
        scope, self._scope, self.step = self._scope, None, None
        if scope is not None:
            scope.__exit__(type(reason), reason, reason.__traceback__)
