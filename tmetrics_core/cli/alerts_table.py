"""Printing a run's alerts (`tmetrics alerts RUN_DIR`): read ``alerts.jsonl``, print a table.

The table has one row per alert event in file order: ``step``, ``state``, ``rule``, ``metric``,
``where`` (layer, expert, tensor, stat), ``value``, ``baseline``, ``jump`` and ``first`` (the
first alert of its cluster, when that is another one).
"""

from __future__ import annotations

import json
from pathlib import Path

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError
from tmetrics_core.records import show_value

__all__ = ["format_alerts", "read_alerts"]

_HEADER = ("step", "state", "rule", "metric", "where", "value", "baseline", "jump", "first")


def read_alerts(run_dir: str | Path) -> list[Alert]:
    """The alert events of a run, from ``<run_dir>/alerts.jsonl`` (written by the ``jsonl`` sink);
    empty when the run raised none. A torn last line (a killed writer) is skipped.

    Raises:
        ConfigError: ``run_dir`` is not a directory.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"got {str(run_dir)!r}; need a run directory (the run's run.dir)", path="RUN_DIR")
    alerts = []
    file = path / "alerts.jsonl"
    if file.exists():
        for line in file.read_text(encoding="utf-8").splitlines():
            try:
                alerts.append(Alert.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue
    return alerts


def format_alerts(alerts: list[Alert]) -> str:
    """An aligned text table of ``alerts`` (see the module docstring), or a one-line note when
    there are none."""
    if not alerts:
        return "no alerts"
    rows = [_HEADER] + [_row(a) for a in alerts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _row(alert: Alert) -> tuple[str, ...]:
    row = alert.row()
    first = "(this)" if alert.is_first() else row[-1]
    base = "-" if alert.baseline is None else show_value(alert.baseline)
    return (str(alert.step), alert.state, alert.rule, alert.metric, alert.where(), show_value(alert.value), base,
            f"{alert.jump:.3g}", first)
