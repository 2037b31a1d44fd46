"""Start the demo: in this process, on ``--nproc N`` local ranks, or under ``torchrun``.

- ``run_demo(args)`` with ``nproc == 1`` trains in this process.
- With ``nproc > 1`` it starts N ranks through torch's own launcher (the programmatic API behind
  ``torchrun``: ``torch.distributed.launcher.api.elastic_launch``) on 127.0.0.1 with a free port
  chosen here (``--master-port=0`` hangs on this kind of machine), gloo backend.
- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) it is one rank:
  ``torchrun --standalone --nproc-per-node 4 -m tmetrics_core.demo.launch --dp 2 --tp 2``.

The flags are declared once, in :func:`demo_options`, for this module's own command and for the
``tmetrics demo`` command; they parse into :class:`DemoArgs`. ``--config`` and ``--sink`` are
carried for the metrics object, which the caller builds through ``metrics`` (a
:class:`~tmetrics_core.demo.train.MetricsFactory`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import click
import torch
import torch.distributed as dist

from tmetrics_core.demo.data import ByteCorpus
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.demo.train import INJECTIONS, Injection, MetricsFactory, TrainConfig, Trainer
from tmetrics_core.errors import ConfigError

__all__ = ["DemoArgs", "DemoSummary", "demo_options", "main", "parse", "run_demo"]

F = TypeVar("F", bound=Callable[..., Any])
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(kw_only=True, slots=True)
class DemoArgs:
    """The demo's command-line flags (names kept stable for scripts and docs)."""

    steps: int = 300
    """``--steps N``: optimizer steps."""
    seed: int = 0
    """``--seed S``: seed of initialisation and batches."""
    run_dir: Path = Path("runs/demo")
    """``--run-dir DIR``: where the run writes (``demo.json`` here; sinks below it)."""
    config: Path | None = None
    """``--config FILE``: metrics and sinks config, for the metrics object."""
    sink: tuple[str, ...] = ()
    """``--sink a,b``: sink names overriding the config's, for the metrics object."""
    nproc: int = 1
    """``--nproc N``: ranks to launch on this machine."""
    dp: int | None = None
    """``--dp N``: data-parallel degree (default: what the other degrees leave of nproc)."""
    tp: int = 1
    """``--tp N``: tensor-parallel degree."""
    ep: int = 1
    """``--ep N``: expert-parallel degree."""
    fsdp: bool = False
    """``--fsdp``: shard over the data-parallel axis with FSDP2."""
    pp: int = 1
    """``--pp N``: pipeline stages."""
    lr: float = 3e-3
    """``--lr X``: peak learning rate."""
    inject: str | None = None
    """``--inject KIND``: one of ``lr-spike``, ``dead-expert``, ``nan-grad``."""
    data: Path | None = None
    """``--data PATH``: a text file or directory instead of the standard library sources."""


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """What a finished run reports (from global rank 0)."""

    run_dir: Path
    world_size: int
    topology: str
    steps: int
    first_loss: float
    final_loss: float
    skipped_steps: tuple[int, ...]
    tokens_per_second: float
    """Median over steps of global tokens (batch_size * seq_len) per second of wall time."""


def _split_sinks(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(s.strip() for s in value.split(",") if s.strip()) if value else ()


def demo_options(func: F) -> F:
    """Add the demo flags to a click command; the command receives :class:`DemoArgs` fields."""
    options = [
        click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True, help="Optimizer steps."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of init and batches."),
        click.option("--run-dir", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True,
                     help="Directory for everything the run writes."),
        click.option("--config", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
                     help="Metrics and sinks config (YAML, TOML or JSON)."),
        click.option("--sink", callback=_split_sinks, default=None, metavar="A,B",
                     help="Sinks to write to, overriding the config (e.g. tensorboard,mlflow)."),
        click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Ranks to launch on this machine (gloo on 127.0.0.1)."),
        click.option("--dp", type=click.IntRange(min=1), default=None,
                     help="Data-parallel degree [default: nproc / (tp * ep * pp)]."),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel degree."),
        click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True, help="Expert-parallel degree."),
        click.option("--fsdp", is_flag=True, default=False, help="Shard the data-parallel axis with FSDP2."),
        click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=3e-3, show_default=True,
                     help="Peak learning rate."),
        click.option("--inject", type=click.Choice(INJECTIONS), default=None,
                     help="Inject a failure the metrics should show."),
        click.option("--data", type=click.Path(path_type=Path, exists=True), default=None,
                     help="Text file or directory to train on [default: Python's standard library]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def parse(argv: Sequence[str]) -> DemoArgs:
    """Parse demo flags into :class:`DemoArgs` (click's usage errors propagate)."""
    command = click.command()(demo_options(lambda **kwargs: DemoArgs(**kwargs)))
    return command.main(list(argv), standalone_mode=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(args: DemoArgs, metrics: MetricsFactory | None) -> DemoSummary:
    """Train as one rank (or the only process); returns the summary on every rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=_COLLECTIVE_TIMEOUT)
    try:
        topology = ParallelDegrees.for_world(world, dp=args.dp, tp=args.tp, ep=args.ep, pp=args.pp, fsdp=args.fsdp)
        model_config = ModelConfig()
        train_config = TrainConfig(
            steps=args.steps, lr=args.lr, seed=args.seed,
            inject=Injection.default(args.inject, model_config, steps=args.steps) if args.inject else None,
        )
        corpus = ByteCorpus.from_path(args.data) if args.data else ByteCorpus.from_stdlib()
        parallel = parallelize(model_config, topology, seed=args.seed, batch_size=train_config.batch_size)
        results = Trainer(parallel, corpus, train_config, metrics=metrics).run()
        tokens = train_config.batch_size * model_config.seq_len
        summary = DemoSummary(
            run_dir=args.run_dir, world_size=world, topology=str(topology), steps=len(results),
            first_loss=results[0].loss, final_loss=results[-1].loss,
            skipped_steps=tuple(r.step for r in results if r.skipped),
            tokens_per_second=statistics.median(tokens / r.seconds for r in results),
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            _write_record(args, summary, model_config, train_config, corpus.source, [r.loss for r in results])
        return summary
    finally:
        if created:
            dist.destroy_process_group()


def _write_record(args: DemoArgs, summary: DemoSummary, model: ModelConfig, train: TrainConfig,
                  source: str, losses: list[float]) -> None:
    args.run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(args).items()},
        "summary": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(summary).items()},
        "model": dataclasses.asdict(model),
        "train": {k: v for k, v in dataclasses.asdict(train).items() if k != "inject"}
        | {"inject": None if train.inject is None else dataclasses.asdict(train.inject)},
        "data": source,
        "losses": losses,
    }
    (args.run_dir / "demo.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"demo: {summary.steps} steps on {summary.world_size} rank(s) [{summary.topology}], "
          f"loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
          f"{summary.tokens_per_second:,.0f} tokens/s; run record: {args.run_dir / 'demo.json'}")


def run_demo(args: DemoArgs, *, metrics: MetricsFactory | None = None) -> DemoSummary:
    """Run the demo as described in the module docstring; returns rank 0's summary.

    ``metrics`` must be picklable (a module-level function) when ``nproc > 1``.

    Raises:
        ConfigError: the degrees do not fit the ranks, model or batch.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a launched rank failed.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc not in (1, world):
            raise ConfigError(f"--nproc {args.nproc} but the launcher started {world} ranks; drop --nproc "
                              "under torchrun", path="--nproc")
        return _run_rank(args, metrics)
    if args.nproc == 1:
        return _run_rank(args, metrics)
    ParallelDegrees.for_world(args.nproc, dp=args.dp, tp=args.tp, ep=args.ep, pp=args.pp, fsdp=args.fsdp)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = _free_port()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"tmetrics-demo-{port}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, monitor_interval=0.2,
        start_method="spawn", local_addr="127.0.0.1",
    )
    results = elastic_launch(config, _run_rank)(args, metrics)
    return results[0]


@click.command(name="demo")
@demo_options
def main(**kwargs: Any) -> None:
    """Train the demo MoE transformer on Python's own source code (also one rank under torchrun)."""
    try:
        run_demo(DemoArgs(**kwargs))
    except ConfigError as err:
        raise click.UsageError(str(err)) from err


if __name__ == "__main__":
    main()
