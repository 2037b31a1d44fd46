"""``compare_runs``: MLflow runs side by side, per metric and per layer (``tmetrics compare``).

Reads any tracking store ``MlflowClient`` can open (a ``sqlite:///`` file or a tracking server)
and prints one table per metric: a row per layer (or expert, tensor, ...), a column per run and
the ratio of every later run to the first. Keys are parsed back from the tmetrics key scheme
(:mod:`tmetrics_core.sinks.keys`):

===========================================  ===========================  ==================
key                                          table                        row
===========================================  ===========================  ==================
``layer-grad-l2/layer_03``                   ``layer-grad-l2``            ``layer_03``
``layer-expert-load-imbalance/layer_03/cv``  ``layer-expert-load-imbalance/cv``  ``layer_03``
``layer-expert-tokens/layer_03/expert_017``  ``layer-expert-tokens``      ``layer_03/expert_017``
``tensor-grad-l2/layers.3.attn.q.weight``    ``tensor-grad-l2``           ``layers.3.attn.q.weight``
``global-grad-l2``                           ``global``                   ``global-grad-l2``
===========================================  ===========================  ==================

With ``out_png``, each table whose rows are layers (no experts) becomes a plot: value against
layer, one line per run.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

from tmetrics_core.errors import ConfigError
from tmetrics_core.records import show_value
from tmetrics_mlflow.sink import check_tracking_uri

__all__ = ["compare_runs"]

_INDEX = re.compile(r"(layer|expert)_(\d+)")
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_NATURAL = re.compile(r"(\d+)")
_GLOBAL = "global"
_MAX_PLOTS = 24


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in _NATURAL.split(text)]


def _table_and_row(key: str) -> tuple[str, str]:
    """``(table, row)`` for a tmetrics key (see the module table)."""
    metric, *rest = key.split("/")
    if not rest:
        return _GLOBAL, metric
    indices = [s for s in rest if _INDEX.fullmatch(s)]
    texts = [s for s in rest if not _INDEX.fullmatch(s)]
    if indices:
        return "/".join([metric, *texts]), "/".join(indices)
    return metric, "/".join(texts)


def _is_layer_row(row: str) -> bool:
    match = _INDEX.fullmatch(row)
    return match is not None and match.group(1) == "layer"


def _resolve(client: Any, ref: str, tracking_uri: str) -> Any:
    from mlflow.exceptions import MlflowException

    if _RUN_ID.fullmatch(ref):
        try:
            return client.get_run(ref)
        except MlflowException:
            pass
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    quoted = ref.replace("\\", "\\\\").replace("'", "\\'")
    found = list(client.search_runs(experiment_ids, filter_string=f"attributes.run_name = '{quoted}'")) if experiment_ids else []
    if not found:
        raise ConfigError(f"no run with id or name {ref!r} in {tracking_uri}; check the name or pass the run id")
    if len(found) > 1:
        listing = ", ".join(f"{r.info.run_id} (experiment {r.info.experiment_id})" for r in found)
        raise ConfigError(f"{len(found)} runs are named {ref!r} in {tracking_uri}: {listing}; pass one run id instead")
    return found[0]


def _values(client: Any, run: Any, keys: list[str], step: int | None) -> dict[str, float]:
    if step is None:
        return {k: run.data.metrics[k] for k in keys if k in run.data.metrics}
    out: dict[str, float] = {}
    for key in keys:
        at_step = [m for m in client.get_metric_history(run.info.run_id, key) if m.step == step]
        if at_step:
            out[key] = max(at_step, key=lambda m: m.timestamp).value
    return out


def _number(value: float | None) -> str:
    return "-" if value is None else show_value(value, 6)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0 or not (math.isfinite(value) and math.isfinite(base)):
        return "-"
    return f"{value / base:.4g}"


def compare_runs(
    runs: Sequence[str],
    *,
    tracking_uri: str,
    metrics: Sequence[str] | None = None,
    step: int | None = None,
    out_png: str | os.PathLike[str] | None = None,
) -> str:
    """Tables of ``runs`` side by side, per metric and row (layer, expert, tensor).

    Args:
        runs: run ids or run names (a name must be unique in the store), at least one; the
            first is the baseline of the ratio columns (``later / first``).
        tracking_uri: the store, e.g. ``sqlite:///runs/demo/mlflow.db`` or ``http://host:5000``.
        metrics: metric names or shell patterns (``layer-*``) matched against a key's family
            (its first segment); default every metric.
        step: compare the values logged at this step; default each run's last value of each key.
        out_png: also write a PNG with one plot per per-layer table (at most 24), value against
            layer, one line per run.

    Returns:
        The text: a header naming the runs, then one aligned table per metric. Missing values
        and undefined ratios are ``-``.

    Raises:
        ConfigError: no runs, an invalid ``tracking_uri``, a run not found or a name shared
            by several runs (the ids are listed), or no key matching ``metrics``.
    """
    from mlflow import MlflowClient

    if not runs:
        raise ConfigError("compare needs at least one run id or name", path="compare.runs")
    check_tracking_uri(tracking_uri, path="compare.tracking_uri")
    client = MlflowClient(tracking_uri=tracking_uri)
    resolved = [_resolve(client, ref, tracking_uri) for ref in runs]
    names = [r.info.run_name or r.info.run_id[:8] for r in resolved]
    if len(set(names)) < len(names):
        names = [f"{n}:{r.info.run_id[:6]}" for n, r in zip(names, resolved)]

    keys = sorted({k for r in resolved for k in r.data.metrics})
    if metrics is not None:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k.split("/")[0], p) for p in metrics)]
        if not keys:
            raise ConfigError(f"no metric of these runs matches {list(metrics)!r}", path="compare.metrics")
    values = [_values(client, r, keys, step) for r in resolved]

    tables: dict[str, dict[str, list[float | None]]] = {}
    for key in keys:
        table, row = _table_and_row(key)
        tables.setdefault(table, {})[row] = [v.get(key) for v in values]
    layer_tables = [t for t in sorted(tables, key=_natural) if all(_is_layer_row(r) for r in tables[t])]

    lines = [f"step: {'last value of each key' if step is None else step}"]
    for name, run in zip(names, resolved):
        lines.append(f"  {name}: run {run.info.run_id} (experiment {run.info.experiment_id})")
    header = ["", *names, *(f"{n}/{names[0]}" for n in names[1:])]
    for table in sorted(tables, key=lambda t: (t != _GLOBAL, _natural(t))):
        rows = tables[table]
        body = [
            [row, *(_number(v) for v in vals), *(_ratio(v, vals[0]) for v in vals[1:])]
            for row, vals in sorted(rows.items(), key=lambda item: _natural(item[0]))
        ]
        widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]
        lines.append("")
        lines.append(table)
        for cells in [header, *body]:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    if out_png is not None:
        plotted = layer_tables[:_MAX_PLOTS]
        _plot(Path(out_png), plotted, tables, names,
              step="each key's last value" if step is None else f"step {step}")
        more = f" (first {_MAX_PLOTS} of {len(layer_tables)})" if len(layer_tables) > _MAX_PLOTS else ""
        lines.append("")
        lines.append(f"plot: {out_png}: {len(plotted)} per-layer tables{more}")
    return "\n".join(lines) + "\n"


def _plot(path: Path, tables: list[str], data: dict[str, dict[str, list[float | None]]], names: list[str], *,
          step: str) -> None:
    """One subplot per table: value against layer index (integer ticks), one line per run, the
    compared step in the figure's title (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    columns = min(3, max(1, len(tables)))
    rows = max(1, math.ceil(len(tables) / columns))
    figure = Figure(figsize=(5.0 * columns, 3.5 * rows), dpi=90)
    FigureCanvasAgg(figure)
    for index, table in enumerate(tables):
        axes = figure.add_subplot(rows, columns, index + 1)
        layers = sorted(data[table], key=_natural)
        x = [int(_INDEX.fullmatch(row).group(2)) for row in layers]  # type: ignore[union-attr]
        finite: list[float] = []
        for run_index, name in enumerate(names):
            y = [data[table][row][run_index] for row in layers]
            y_plot = [math.nan if v is None else v for v in y]
            finite += [v for v in y_plot if math.isfinite(v)]
            axes.plot(x, y_plot, marker="o", markersize=3, label=name)
        if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            axes.set_yscale("log")
        axes.set_title(table, fontsize=9)
        axes.set_xlabel("layer")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.legend(fontsize=7)
    if not tables:
        figure.text(0.5, 0.5, "no per-layer metrics to plot", ha="center")
    figure.suptitle(f"{' vs '.join(names)}: {step}", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
