"""``tmetrics compare``: MLflow runs side by side, per metric and layer (registered under the
entry-point group ``tmetrics.commands``)."""

from __future__ import annotations

from pathlib import Path

import click

from tmetrics_core.cli.friendly import friendly

__all__ = ["compare_command"]


@click.command("compare")
@click.argument("runs", nargs=-1, required=True)
@click.option("--tracking-uri", required=True, help="sqlite:///path/mlflow.db or http://127.0.0.1:5000")
@click.option("--metric", "metric_patterns", multiple=True, help="Metric name or glob (repeatable).")
@click.option("--step", type=int, default=None, help="Compare values at this step (default: last).")
@click.option("--out", "out_png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a PNG plot, one panel per per-layer metric.")
@friendly
def compare_command(runs: tuple[str, ...], tracking_uri: str, metric_patterns: tuple[str, ...], step: int | None,
                    out_png: Path | None) -> None:
    """Show RUNS (MLflow run ids or names) side by side, per metric and layer."""
    from tmetrics_mlflow.compare import compare_runs

    click.echo(compare_runs(runs, tracking_uri=tracking_uri, metrics=list(metric_patterns) or None, step=step,
                            out_png=out_png))
    if out_png is not None:
        click.echo(f"plot written to {out_png}")
