"""How long the training thread is blocked per step: each sink behind the SinkHub vs the backend called directly.

Run ``python -m bench.sink_blocking`` (``--help`` for options). Each step logs 96 layers x 64
experts x 3 statistics = 18,432 scalar records (one ``MetricRecord`` each, the worst case for a
hub: the most objects per step). A step is a fixed amount of matrix work (about
``--train-ms``) followed by the logging call; the variants are:

- ``baseline``: the work alone (many small ops, one thread: like the CPU side of a training
  step, where each kernel launch needs the GIL, so a busy worker thread shows up here);
- ``hub <sink>``: ``SinkHub.submit(records, step)``; the sink writes on the hub's worker thread
  while the next steps compute, so any contention it causes shows in the step time;
- ``direct <sink>``: what a user would write without tmetrics, on the training thread:
  TensorBoard ``SummaryWriter.add_scalar`` per value, MLflow ``MlflowClient.log_batch`` in chunks
  of 1,000, W&B one ``run.log`` of a dict with every value (keys prepared beforehand).

Variants run interleaved in short rounds (order rotated each round), because this machine's
speed drifts; after each variant the hub is drained outside the timed region, so one variant's
backlog never slows the next. Ratios are paired: a variant's median step time in a round over
the baseline's in the same round, then the median over rounds. Target: under 5 ms blocked per
step behind the hub.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tmetrics_core.hub.sink_hub import SinkHub
from tmetrics_core.sinks.keys import MLFLOW_RULES, TENSORBOARD_RULES, WANDB_RULES, KeyBook
from tmetrics_core.records import Labels, MetricRecord, RunInfo

__all__ = ["main"]

LAYERS, EXPERTS, STATS = 96, 64, ("rms", "absmax", "mean")
METRIC = "layer-expert-activation"


def make_records(step: int) -> list[MetricRecord]:
    """18,432 scalar records of one step."""
    return [
        MetricRecord(METRIC, step, step + layer * 0.01 + expert * 1e-4 + s, labels=Labels(layer=layer, expert=expert, stat=stat))
        for layer in range(LAYERS)
        for expert in range(EXPERTS)
        for s, stat in enumerate(STATS)
    ]


class Work:
    """A fixed amount of matrix work standing in for a training step (torch releases the GIL)."""

    def __init__(self, target_ms: float) -> None:
        self.x = torch.randn(256, 256)
        self.repeats = 1
        start = time.perf_counter()
        for _ in range(20):
            self()
        per_repeat = (time.perf_counter() - start) / 20
        self.repeats = max(1, round(target_ms / 1000 / per_repeat))

    def __call__(self) -> None:
        y = self.x
        for _ in range(self.repeats):
            y = torch.tanh(y @ self.x)


def direct_tensorboard(root: Path) -> tuple[Callable[[list[MetricRecord], int], None], Callable[[], None]]:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(root / "direct-tb"))
    keys = [KeyBook(TENSORBOARD_RULES).add(r.metric, r.labels) for r in make_records(0)]

    def log(records: list[MetricRecord], step: int) -> None:
        for key, record in zip(keys, records):
            writer.add_scalar(key, record.value, step)

    return log, writer.close


def direct_mlflow(root: Path) -> tuple[Callable[[list[MetricRecord], int], None], Callable[[], None]]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'direct-mlflow.db'}")
    experiment = client.create_experiment("direct", artifact_location=(root / "direct-artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    keys = [KeyBook(MLFLOW_RULES).add(r.metric, r.labels) for r in make_records(0)]

    def log(records: list[MetricRecord], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(record.value), now, step) for key, record in zip(keys, records)]  # type: ignore[arg-type]
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start : start + 1000], synchronous=True)

    return log, lambda: client.set_terminated(run_id)


def direct_wandb(root: Path) -> tuple[Callable[[list[MetricRecord], int], None], Callable[[], None]]:
    import wandb

    run = wandb.init(project="bench", dir=str(root), mode="offline", reinit="create_new", settings=wandb.Settings(console="off"))
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    keys = [KeyBook(WANDB_RULES).add(r.metric, r.labels) for r in make_records(0)]

    def log(records: list[MetricRecord], step: int) -> None:
        data: dict[str, Any] = {key: record.value for key, record in zip(keys, records)}
        data["step"] = step
        run.log(data)

    return log, run.finish


def hub_sink(name: str, root: Path) -> Any:
    if name == "tensorboard":
        from tmetrics_tb import TensorBoardSink

        return TensorBoardSink(log_dir=str(root / "hub-tb"), expert_scalars=True)
    if name == "mlflow":
        from tmetrics_mlflow import MlflowSink

        return MlflowSink(tracking_uri=f"sqlite:///{root / 'hub-mlflow.db'}", experiment="hub", expert_scalars=True)
    from tmetrics_wandb import WandbSink

    return WandbSink(mode="offline", dir=str(root / "hub-wandb"), heatmap_every=0, expert_scalars=True)


DIRECT = {"tensorboard": direct_tensorboard, "mlflow": direct_mlflow, "wandb": direct_wandb}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sink_blocking", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sinks", default="tensorboard,wandb,mlflow", help="comma-separated: tensorboard, wandb, mlflow")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round (default 3)")
    parser.add_argument("--train-ms", type=float, default=100.0, help="matrix work per step, ms (default 100)")
    parser.add_argument("--drain-s", type=float, default=120.0, help="longest wait for a hub to drain between variants")
    args = parser.parse_args(argv)
    sinks = [s.strip() for s in args.sinks.split(",") if s.strip()]
    unknown = sorted(set(sinks) - set(DIRECT))
    if unknown:
        parser.error(f"unknown sinks {unknown}; choose from {', '.join(DIRECT)}")
    os.environ.setdefault("WANDB_SILENT", "true")
    # One intra-op thread: the work stands for the CPU side of a training step (kernel launches,
    # each needing the GIL), and OpenMP threads spinning on a shared 2-core machine would swamp
    # the effect being measured.
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="tmetrics-bench-") as tmp:
        root = Path(tmp)
        run = RunInfo(name="bench", dir=str(root / "run"), num_layers=LAYERS, num_experts=EXPERTS, metrics=(METRIC,))
        work = Work(args.train_ms)
        hubs = {name: SinkHub([hub_sink(name, root)], spool_dir=root / f"spool-{name}") for name in sinks}
        for hub in hubs.values():
            hub.open(run)
        directs = {name: DIRECT[name](root) for name in sinks}
        for hub in hubs.values():
            hub.flush(args.drain_s)  # opened (MLflow creates its database here), outside timing

        variants: list[tuple[str, Callable[[list[MetricRecord], int], None], Callable[[], None]]] = [
            ("baseline", lambda records, step: None, lambda: None)
        ]
        for name in sinks:
            hub = hubs[name]
            variants.append((f"hub {name}", hub.submit, lambda hub=hub: hub.flush(args.drain_s)))
            variants.append((f"direct {name}", directs[name][0], lambda: None))

        blocked: dict[str, list[float]] = {v[0]: [] for v in variants}
        step_ms: dict[str, list[list[float]]] = {v[0]: [] for v in variants}
        step = 0
        for round_index in range(args.rounds):
            order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
            for label, log, drain in order:
                times = []
                for _ in range(args.steps):
                    step += 1
                    records = make_records(step)
                    start = time.perf_counter()
                    work()
                    logged = time.perf_counter()
                    log(records, step)
                    end = time.perf_counter()
                    blocked[label].append((end - logged) * 1000)
                    times.append((end - start) * 1000)
                step_ms[label].append(times)
                drain()
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)

        reports = {name: hub.close("finished", timeout=args.drain_s) for name, hub in hubs.items()}
        for _, finish in directs.values():
            finish()

    base_rounds = [statistics.median(r) for r in step_ms["baseline"]]
    print(f"\n{LAYERS} layers x {EXPERTS} experts x {len(STATS)} stats = {LAYERS * EXPERTS * len(STATS)} values per step; "
          f"{args.rounds} rounds x {args.steps} steps per variant; work per step ~{args.train_ms:g} ms\n")
    header = ("variant", "blocked ms/step (median)", "blocked ms (max)", "step ms (median)", "step / baseline")
    rows = []
    for label, _, _ in variants:
        paired = [statistics.median(r) / b for r, b in zip(step_ms[label], base_rounds)]
        rows.append((
            label,
            f"{statistics.median(blocked[label]):.3f}",
            f"{max(blocked[label]):.3f}",
            f"{statistics.median([t for r in step_ms[label] for t in r]):.1f}",
            f"{statistics.median(paired):.3f}",
        ))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print()
    for name in sinks:
        hub_ms = statistics.median(blocked[f"hub {name}"])
        direct_ms = statistics.median(blocked[f"direct {name}"])
        sink_report = reports[name].sinks[0]
        print(f"{name}: blocked behind the hub / direct = {hub_ms / direct_ms:.2e} "
              f"({hub_ms:.3f} ms vs {direct_ms:.1f} ms); hub report: submitted {sink_report.submitted}, "
              f"written {sink_report.written}, spooled {sink_report.spooled}, dropped {sink_report.dropped}")
    worst = max(statistics.median(blocked[f"hub {name}"]) for name in sinks)
    print(f"\ntarget < 5 ms blocked per step behind the hub: {'met' if worst < 5 else 'NOT met'} (worst median {worst:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
