"""Typed errors raised by tmetrics.

Every error says what was wrong, the valid choices where there are any, and how to fix it.
Callers branch on the class, never on the message text.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "PlacementError",
    "PlanMismatchError",
    "SinkError",
    "TMetricsError",
]


class TMetricsError(Exception):
    """Base class of every error tmetrics raises on purpose."""


class ConfigError(TMetricsError, ValueError):
    """The configuration is invalid; raised at start-up, before any step runs.

    ``path`` names the offending config entry (``"metrics[2].interval"``), or is empty.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class PlacementError(TMetricsError, ValueError):
    """A placement is malformed, or a metric cannot handle it."""


class PlanMismatchError(TMetricsError, RuntimeError):
    """Ranks built different collective plans; raised on every rank instead of hanging.

    ``metric`` and ``axis`` name where the plans differ, ``ranks`` the global ranks that disagree
    with the lowest rank of the axis.
    """

    def __init__(self, message: str, *, metric: str = "", axis: str = "", ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.metric = metric
        self.axis = axis
        self.ranks = ranks


class SinkError(TMetricsError, RuntimeError):
    """A sink could not be found, loaded or opened. ``sink`` is its entry-point name."""

    def __init__(self, message: str, *, sink: str = "") -> None:
        super().__init__(message)
        self.sink = sink
