"""Alerts: rules over a run's records on the logging rank, each alert a record routed to the sinks."""

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.alerts.engine import AlertEngine

__all__ = [
    "Alert",
    "AlertEngine",
]
