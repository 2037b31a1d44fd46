"""The demo with tmetrics attached: the metrics factory every rank calls, and the closing note
that says where the run is and how to open it.

Config: ``--config FILE`` or the packaged ``default_config.yaml``; ``--sink a,b`` replaces its
sinks; ``--run-dir`` replaces its ``run.dir``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from tmetrics_core.cli.alerts_table import read_alerts
from tmetrics_core.config.schema import load_config
from tmetrics_core.demo.launch import DemoArgs, run_demo
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["DEFAULT_CONFIG", "make_metrics", "run_instrumented_demo"]

DEFAULT_CONFIG = Path(__file__).with_name("default_config.yaml")
"""Headline per-layer metrics to TensorBoard, MLflow (sqlite), W&B (offline) and JSONL."""


def make_metrics(args: DemoArgs, model: Any, optimizer: Any, mesh: Any) -> TensorMetrics:
    """Build the metrics object of one rank (a module-level function: ranks import it).

    A ``--run-dir`` other than the default also names the run after its directory, so two demo
    runs in one tracker (``runs/lr3e-3``, ``runs/lr1e-2``) are told apart by name; MLflow keeps
    them in one experiment named after the config's run name.
    """
    config = load_config(args.config or DEFAULT_CONFIG)
    if args.run_dir != DemoArgs().run_dir:
        sinks = {name: ({"experiment": config.run.name, **options} if name == "mlflow" else options)
                 for name, options in config.sinks.items()}
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, name=args.run_dir.name),
                                     sinks=sinks)
    return TensorMetrics.from_config(config, model=model, optimizer=optimizer, mesh=mesh,
                                     sinks=",".join(args.sink) or None, run_dir=args.run_dir)


def run_instrumented_demo(options: dict[str, Any]) -> None:
    """``tmetrics demo``: train with metrics, then print where everything is."""
    args = DemoArgs(**options)
    run_demo(args, metrics=functools.partial(make_metrics, args))
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank runs this
        mlflow = load_config(args.config or DEFAULT_CONFIG).sinks.get("mlflow") or {}
        click.echo(where(args.run_dir, mlflow_uri=mlflow.get("tracking_uri")))


def where(run_dir: Path, *, mlflow_uri: str | None = None) -> str:
    """The closing note: the files of the run and the exact commands to open them
    (``mlflow_uri``: the MLflow store when the config names one)."""
    lines = [f"run directory: {run_dir}"]
    if (run_dir / "tb").exists():
        lines.append(f"  TensorBoard:  {_tool('tensorboard')} --logdir {run_dir / 'tb'}")
    if mlflow_uri:
        lines.append(f"  MLflow:       {_tool('mlflow')} ui --backend-store-uri {mlflow_uri}   (run {run_dir.name!r})")
    elif (run_dir / "mlflow.db").exists():
        lines.append(f"  MLflow:       {_tool('mlflow')} ui --backend-store-uri sqlite:///{run_dir / 'mlflow.db'}")
    offline = sorted((run_dir / "wandb").glob("offline-run-*")) if (run_dir / "wandb").exists() else []
    if offline:
        lines.append(f"  W&B:          {_tool('wandb')} sync {offline[-1]}")
    if (run_dir / "metrics.jsonl").exists():
        lines.append(f"  JSONL:        {run_dir / 'metrics.jsonl'}")
    lines += alert_note(run_dir)
    if (run_dir / "spool").exists() and any((run_dir / "spool").iterdir()):
        lines.append(f"  spooled (tracker was down): {_tool('tmetrics')} replay {run_dir / 'spool'}/<sink>.jsonl "
                     "--sink <sink>")
    return "\n".join(lines)


def alert_note(run_dir: Path) -> list[str]:
    """Lines on the run's alerts (from ``alerts.jsonl``): how many opened and, for a run with
    ``--inject``, the first alert at or after the injection step that names the injected layer
    (and expert), else the first alert of the run."""
    opened = [a for a in read_alerts(run_dir) if a.state == "open"] if run_dir.is_dir() else []
    if not opened:  # the jsonl sink writes alerts.jsonl; without it the run's alerts are not on disk
        return ["  alerts:       none"] if (run_dir / "metrics.jsonl").exists() else []
    lines = [f"  alerts:       {len(opened)} opened; {_tool('tmetrics')} alerts {run_dir}"]
    record = run_dir / "demo.json"
    inject = json.loads(record.read_text())["train"].get("inject") if record.exists() else None
    if inject:
        expert = inject["expert"] if inject["kind"] == "dead-expert" else None
        match = next((a for a in opened if a.step >= inject["start_step"] and a.labels.layer == inject["layer"]
                      and (expert is None or a.labels.expert == expert)), None)
        where = f"layer {inject['layer']}" + (f" expert {expert}" if expert is not None else "")
        lines.append(f"  injected {inject['kind']} at step {inject['start_step']} in {where}; "
                     + (f"alert: {match.describe()}" if match else "no alert named it"))
    else:
        lines.append(f"  first alert:  {opened[0].describe()}")
    return lines


def _tool(name: str) -> str:
    """``name`` as a command that runs from here: the copy next to this Python (a virtual
    environment that is not activated) when the shell would not find one on PATH."""
    beside = Path(sys.executable).parent / name
    if shutil.which(name) is None and beside.exists():
        relative = os.path.relpath(beside)
        return str(beside) if relative.startswith("..") else relative
    return name
