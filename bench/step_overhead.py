"""What tmetrics costs a training step of the demo model, next to the usual alternatives.

    python -m bench.step_overhead [--rounds 30] [--steps 5] [--pairs 300] [--threads 2] [--no-ddp] [--no-memory]
                                  [--bundle NAMES] [--compare BUNDLE=INTERVAL ...]

Table 1, one process (``--threads`` intra-op threads): the demo model's full step (forward,
backward, clipping, AdamW) with the standard bundle (``bench.demo_variants.BUNDLE``) every 1,
10 and 100 steps and on steps where nothing is due, the bundle plus ``layer-grad-histogram``
every step (the histogram's cost next to the bundle's), against the same loop without tmetrics,
``wandb.watch(model, log="all", log_freq=1)`` (offline) and a per-parameter ``.norm().item()``
loop. Variants alternate in short rounds (``bench.rounds``); ratios are to the bare loop. One
more trainer runs with its metrics object switched off and on each round (:data:`SWITCHED`):
the same pair on one model, free of the few percent that separate model copies differ by
(shown by a second bare copy, :data:`SECOND_BARE`). The same trainer then runs ``--pairs``
pairs of single steps, off and on in alternating order (``bench.rounds.alternate``): the mean of
the paired step differences with its standard error, the sharpest measure of the every-step cost
(rounds of several steps resolve about 1.5% of a step, several hundred single-step pairs a few
tenths of a percent).
Interval rows also give the mean over all their steps and the mean expected from the due
overhead and the idle one: ``1 + (due + (N - 1) idle) / N``, where the idle cost is the tmetrics
code a not-due step runs (step scope, optimizer hooks, ``observe_gradients``) timed directly,
far below what paired rounds can resolve; the torch operations and host reads of that step are
counted too (both should be zero). A due step's tmetrics code is also timed directly, with the
part of it spent in passes over tensor elements (``bench.due_step_time``). ``--bundle``
measures other metrics (names, or a bundle of ``bench.demo_variants.BUNDLES``).

``--compare backward=1 attention=100 low-precision=1`` adds each named bundle of
``bench.demo_variants.BUNDLES`` to the same rounds, beside the bundle's rows: ``<name> every 1``
(its cost when due, also as a ratio over ``tmetrics every 1``) and, for another interval,
``<name> every N`` with its expected mean; under the table, per compared bundle, the torch ops
and host reads of a due step and its tmetrics code timed directly, next to the model's own
attention kernels of that step (the forward the attention metrics re-read).

Table 2, two gloo ranks under DDP (1 thread each): the bundle every step against the bare loop
and the per-parameter loop with one ``all_reduce`` per norm; collective calls per step.

Table 3, peak memory: each variant in its own process; the peak of the C heap during three
steps (see ``bench.peak_memory``) above the heap before the model existed, and max RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.demo_variants import (
    BUNDLE, BUNDLES, NEVER, make_trainer, norm_loop_factory, tmetrics_factory, wandb_factory,
)
from bench.due_step_time import DueStepTime, due_step_time
from bench.peak_memory import HeapPeak, heap_in_use, max_rss_bytes
from bench.rounds import PairedSteps, Rounds, alternate, interleave
from tmetrics_core.demo.data import ByteCorpus
from tmetrics_core.demo.train import NullMetrics, StepMetrics, Trainer

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
MEMORY = ("bare", "tmetrics every 1", "wandb.watch all/1", "norm().item() loop")
SECOND_BARE = "bare, second copy"
HISTOGRAM = "tmetrics+grad hist 1"
"""The bundle and ``layer-grad-histogram`` every step: its ratio over ``tmetrics every 1`` is the
histogram's own cost, shown next to the bundle's (issue 35: +24 ms on a 24 ms step while it
binned one tensor at a time)."""
"""The bare loop again, on a model built last: its ratio to ``bare`` is how far two copies of one
loop differ by where their tensors sit in memory, the error of every separate-copy ratio."""


def _compared(compare: dict[str, int]) -> dict[str, Any]:
    """Variant name -> metrics factory of each compared bundle (name -> interval): every step,
    and at its interval when that is another."""
    out = {}
    for name, interval in compare.items():
        for every in dict.fromkeys((1, interval)):
            out[f"{name} every {every}"] = tmetrics_factory(every, BUNDLES[name])
    return out


@dataclass(frozen=True)
class Compared:
    """What one compared bundle's due step does, beside its rows in the rounds."""

    name: str
    ops: tuple[int, int]
    """Torch ops issued by tmetrics and host reads, one due step."""
    time: DueStepTime


def _variants(bundle: tuple[str, ...]) -> dict[str, Any]:
    """Variant name -> metrics factory (None: the bare loop)."""
    return {
        "bare": None,
        "tmetrics every 1": tmetrics_factory(1, bundle),
        "tmetrics every 10": tmetrics_factory(10, bundle),
        "tmetrics every 100": tmetrics_factory(100, bundle),
        "tmetrics not due": tmetrics_factory(NEVER, bundle),
        HISTOGRAM: tmetrics_factory(1, tuple(dict.fromkeys((*bundle, "layer-grad-histogram")))),
        "wandb.watch all/1": wandb_factory,
        "norm().item() loop": norm_loop_factory(),
        SECOND_BARE: None,
    }


class _TmetricsOps(TorchDispatchMode):
    """Counts torch ops dispatched from tmetrics code (not the demo model), and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        frames = traceback.extract_stack()
        if any("tmetrics_core" in f.filename and "/demo/" not in f.filename for f in frames):
            self.ops += 1
            self.host_reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _stepper(trainer: Trainer) -> Callable[[int], None]:
    count = [0]

    def run(steps: int) -> None:
        for _ in range(steps):
            count[0] += 1
            trainer.step(count[0])
    run.count = count  # type: ignore[attr-defined]
    return run


SWITCHED = ("same model, tmetrics off", "same model, tmetrics every 1")
"""One trainer whose metrics object is switched each round: the bare loop and the bundle
every step on the same model, optimizer and memory, so that the placement of separate model
copies (a few percent of step time either way) cannot bias the pair."""


def _switched(trainer: Trainer) -> dict[str, Callable[[int], None]]:
    """Runners of :data:`SWITCHED` over ``trainer`` (built with the bundle every step): the
    first swaps in a metrics object that does nothing; the optimizer hooks and the forward hooks
    of the bundle stay registered and return at once outside a step scope (counted against the
    bare side)."""
    count = [0]

    def runner(metrics: StepMetrics) -> Callable[[int], None]:
        def run(steps: int) -> None:
            trainer.metrics = metrics
            for _ in range(steps):
                count[0] += 1
                trainer.step(count[0])
        return run
    return dict(zip(SWITCHED, (runner(NullMetrics()), runner(trainer.metrics))))


def _idle_code_us(trainer: Trainer, first_step: int, repeats: int = 20000) -> float:
    """Microseconds of tmetrics code per idle step: the step scope, both optimizer hooks and
    ``observe_gradients``, timed directly (``observe()`` sites run in the bare model too)."""
    metrics, optimizer = trainer.metrics, trainer.optimizer
    pre = list(optimizer._optimizer_step_pre_hooks.values())
    post = list(optimizer._optimizer_step_post_hooks.values())
    start = time.perf_counter()
    for i in range(repeats):
        with metrics.step(first_step + i):
            metrics.observe_gradients()
            for hook in pre:
                hook(optimizer, (), {})
            for hook in post:
                hook(optimizer, (), {})
    return (time.perf_counter() - start) / repeats * 1e6


def _ops_of_step(trainer: Trainer, step: int) -> tuple[int, int]:
    with _TmetricsOps() as counter:
        trainer.step(step)
    return counter.ops, counter.host_reads


def single_process(rounds: int, steps: int, bundle: tuple[str, ...], *, alternatives: bool = True,
                   pairs: int = 300, compare: dict[str, int] | None = None) -> list[str]:
    corpus = ByteCorpus.from_stdlib()
    variants = {n: f for n, f in _variants(bundle).items()
                if alternatives or n in ("bare", SECOND_BARE) or n.startswith("tmetrics")}
    variants.update(_compared(compare or {}))
    trainers = {name: make_trainer(factory, corpus=corpus) for name, factory in variants.items()}
    runners = {name: _stepper(t) for name, t in trainers.items()}
    switched = _switched(make_trainer(tmetrics_factory(1, bundle), corpus=corpus))
    runners.update(switched)
    for run in runners.values():
        run(2)  # warm-up; spends the always-due first step of "not due"
    result = interleave(runners, rounds=rounds, steps=steps)
    off, on = (switched[name] for name in SWITCHED)
    stepwise = alternate(lambda: off(1), lambda: on(1), pairs=pairs) if pairs else None
    idle = trainers["tmetrics not due"]
    idle_run = runners["tmetrics not due"]
    due_run = runners["tmetrics every 1"]
    idle_ops = _ops_of_step(idle, idle_run.count[0] + 1)  # type: ignore[attr-defined]
    due_ops = _ops_of_step(trainers["tmetrics every 1"], due_run.count[0] + 1)  # type: ignore[attr-defined]
    idle_us = _idle_code_us(idle, idle_run.count[0] + 2)  # type: ignore[attr-defined]
    compared = [Compared(name, _ops_of_step(trainers[f"{name} every 1"],
                                            runners[f"{name} every 1"].count[0] + 1),  # type: ignore[attr-defined]
                         due_step_time(BUNDLES[name]))
                for name in compare or {}]
    return _single_table(result, rounds, steps, idle_us, idle_ops, due_ops, due_step_time(bundle), stepwise,
                         compared)


def _single_table(r: Rounds, rounds: int, steps: int, idle_us: float, idle_ops: tuple[int, int],
                  due_ops: tuple[int, int], due_time: DueStepTime, stepwise: PairedSteps | None,
                  compared: Sequence[Compared] = ()) -> list[str]:
    base = "bare"
    due = r.paired("tmetrics every 1", base) - 1
    idle = idle_us / (r.median_ms(base) * 1e3)  # timed directly: below the noise of paired rounds
    lines = [f"Table 1: demo step, one process, {torch.get_num_threads()} threads, {rounds} rounds x {steps} steps "
             f"per variant (bare step {r.median_ms(base):.1f} ms)",
             f"{'variant':<22} {'ms/step':>8} {'wall x':>7} {'cpu x':>7} {'mean x':>7} {'expected x':>10}"]
    for name in (n for n in r.wall if n not in SWITCHED):
        label, every, interval_text = name.rpartition(" every ")
        interval = int(interval_text) if every else None
        own = r.paired(f"{label} every 1", base) - 1 if interval else 0.0  # this bundle's due overhead
        expected = f"{1 + (own + (interval - 1) * idle) / interval:>10.4f}" if interval else f"{'':>10}"
        lines.append(f"{name:<22} {r.median_ms(name):>8.1f} {r.paired(name, base):>7.3f} "
                     f"{r.paired(name, base, cpu=True):>7.3f} {r.mean(name, base):>7.3f} {expected}")
    lines += [
        "wall x / cpu x: median over rounds of the paired ratio to bare (wall time / process CPU time); mean x:",
        "mean of the per-round ratios, 10% trimmed each side (the average over steps); expected x: 1 + (due +",
        "(N-1) idle) / N with due the 'every 1' overhead and idle the directly timed not-due cost below.",
        *([f"'{HISTOGRAM}': the bundle with layer-grad-histogram every step; over 'tmetrics every 1': "
           f"{r.paired(HISTOGRAM, 'tmetrics every 1'):.3f} (the histogram's own cost)."] if HISTOGRAM in r.wall else []),
        "Noise: about 1.5% (MACHINE-NOTES); 'bare, second copy' (the same loop, another model copy) shows",
        "how far separate copies differ, which the same-model pair below does not see.",
        f"same model, tmetrics switched off and on each round (bare step {r.median_ms(SWITCHED[0]):.1f} ms): "
        f"every 1 wall x {r.paired(SWITCHED[1], SWITCHED[0]):.3f}, cpu x {r.paired(SWITCHED[1], SWITCHED[0], cpu=True):.3f}, "
        f"mean x {r.mean(SWITCHED[1], SWITCHED[0]):.3f}",
        *([f"same model, tmetrics switched off and on every step ({len(stepwise.differences)} pairs, order "
           f"alternating; bare step {stepwise.first_mean * 1e3:.1f} ms): every 1 {stepwise.overhead():+.2%} "
           f"+- {stepwise.standard_error():.2%} (mean paired step difference +- standard error)"] if stepwise else []),
        f"not-due step, timed directly: {idle_us:.1f} us of tmetrics code per step "
        f"({idle_us / (r.median_ms(base) * 1e3):.4%} of a bare step); torch ops issued by tmetrics: "
        f"{idle_ops[0]}, host reads: {idle_ops[1]}",
        f"due step: torch ops issued by tmetrics: {due_ops[0]}, item()-style host reads: {due_ops[1]}",
        f"due step, timed directly (median of 20): {due_time.total_ms:.2f} ms of tmetrics code "
        f"({due_time.total_ms / r.median_ms(base):.1%} of a bare step), {due_time.passes_ms:.2f} ms of it in "
        "passes over tensor elements (C kernels, update snapshot copy)",
    ]
    if "wandb.watch all/1" in r.wall:
        watch = r.paired("wandb.watch all/1", base) - 1
        ratio = watch / due if due > 0 else float("inf")
        lines.append(f"wandb.watch overhead / tmetrics-every-1 overhead: {ratio:.1f}x")
    return lines + [line for c in compared for line in _compared_lines(r, c, due_time)]


def _compared_lines(r: Rounds, c: Compared, standard: DueStepTime) -> list[str]:
    """The lines of one compared bundle under table 1."""
    own = f"{c.name} every 1"
    t = c.time
    return [
        f"'{c.name}' bundle ({', '.join(BUNDLES[c.name])}): every 1 wall x {r.paired(own, 'bare'):.3f} over bare, "
        f"{r.paired(own, 'tmetrics every 1'):.3f} over 'tmetrics every 1'",
        f"  '{c.name}' ops per due step: {c.ops[0]} torch ops issued by tmetrics, {c.ops[1]} item()-style host reads; "
        f"tmetrics code per due step timed directly (median of 20): {t.total_ms:.2f} ms "
        f"({t.total_ms / r.median_ms('bare'):.1%} of a bare step; standard bundle {standard.total_ms:.2f} ms), "
        f"{t.passes_ms:.2f} ms of it in passes over tensor elements; the model's attention kernels (SDPA forward, "
        f"all layers) {t.attention_ms:.2f} ms per step, x{t.total_ms / t.attention_ms if t.attention_ms else math.nan:.2f} "
        "of them",
    ]


def _ddp_rank(rank: int, world: int, rounds: int, steps: int, bundle: tuple[str, ...]) -> dict[str, Any]:
    corpus = ByteCorpus.from_stdlib()
    factories = {"bare": None, "tmetrics every 1": tmetrics_factory(1, bundle),
                 "norm + all_reduce each": norm_loop_factory(all_reduce=True)}
    trainers = {name: make_trainer(f, dp=world, corpus=corpus) for name, f in factories.items()}
    runners = {name: _stepper(t) for name, t in trainers.items()}
    for run in runners.values():
        run(2)
    stats = trainers["tmetrics every 1"].metrics.executor.stats
    loop = trainers["norm + all_reduce each"].metrics
    before = (stats.total_calls, stats.seconds, loop.collectives, loop.seconds)
    result = interleave(runners, rounds=rounds, steps=steps)
    n = rounds * steps
    calls = {"bare": (0.0, 0.0),
             "tmetrics every 1": ((stats.total_calls - before[0]) / n, (stats.seconds - before[1]) / n * 1e3),
             "norm + all_reduce each": ((loop.collectives - before[2]) / n, (loop.seconds - before[3]) / n * 1e3)}
    return {"wall": result.wall, "cpu": result.cpu, "calls": calls}


def ddp(rounds: int, steps: int, bundle: tuple[str, ...]) -> list[str]:
    from tests.distributed.harness import run_distributed

    out = run_distributed(_ddp_rank, 2, rounds, steps, bundle, timeout=3600, collective_timeout=300)[0]
    r = Rounds(out["wall"], out["cpu"])
    lines = [f"Table 2: demo step, DDP on 2 gloo ranks (1 thread each), {rounds} rounds x {steps} steps "
             f"(bare step {r.median_ms('bare'):.1f} ms on rank 0)",
             f"{'variant':<24} {'ms/step':>8} {'wall x':>7} {'cpu x':>7} {'collectives/step':>17} {'comm ms/step':>13}"]
    for name in out["wall"]:
        calls, comm = out["calls"][name]
        lines.append(f"{name:<24} {r.median_ms(name):>8.1f} {r.paired(name, 'bare'):>7.3f} "
                     f"{r.paired(name, 'bare', cpu=True):>7.3f} {calls:>17.1f} {comm:>13.2f}")
    lines.append("collectives: issued for metrics (tmetrics: executor calls incl. control; DDP's own gradient "
                 "all-reduce not counted); comm: wall time inside the metric data collectives")
    return lines


def _memory_variant(name: str, threads: int, bundle: tuple[str, ...]) -> dict[str, float]:
    torch.set_num_threads(threads)
    corpus = ByteCorpus.from_stdlib()
    base = heap_in_use()
    trainer = make_trainer(_variants(bundle)[name], corpus=corpus)
    for step in range(1, 4):
        trainer.step(step)
    with HeapPeak() as peak:
        for step in range(4, 7):
            trainer.step(step)
    trainer.metrics.close()
    return {"peak": peak.peak - base, "rss": max_rss_bytes()}


def memory(threads: int, bundle: tuple[str, ...]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    got = {}
    for name in MEMORY:
        proc = subprocess.run([sys.executable, "-m", "bench.step_overhead", "--memory-variant", name,
                               "--threads", str(threads), "--bundle", ",".join(bundle)], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True)
        got[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = got["bare"]
    lines = ["Table 3: peak memory over 3 steps (after 3 warm-up steps), each variant in a fresh process",
             f"{'variant':<22} {'peak MiB':>9} {'x bare':>7} {'max RSS MiB':>12}"]
    for name, m in got.items():
        lines.append(f"{name:<22} {m['peak'] / 2**20:>9.2f} {m['peak'] / base['peak']:>7.4f} {m['rss'] / 2**20:>12.0f}")
    lines.append("peak: C-heap high-water mark sampled after every torch op, above the heap before the model "
                 "was built (all tensors: parameters, gradients, Adam state, activations, tmetrics)")
    return lines


def _parse_compare(parser: argparse.ArgumentParser, given: list[str]) -> dict[str, int]:
    """``--compare`` items (``BUNDLE=INTERVAL``, interval 1 when left out) as name -> interval;
    a name not in ``BUNDLES`` or an interval below 1 exits with a usage error."""
    out = {}
    for item in given:
        name, _, interval = item.partition("=")
        if name not in BUNDLES or not (interval or "1").isdigit() or int(interval or "1") < 1:
            parser.error(f"--compare {item!r}: need BUNDLE=INTERVAL with BUNDLE one of {', '.join(BUNDLES)} "
                         "and INTERVAL a positive integer, e.g. attention=100")
        out[name] = int(interval or "1")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant and round (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads, one process (default 2)")
    parser.add_argument("--pairs", type=int, default=300,
                        help="steps switched off and on one at a time on one model, in pairs (default 300; 0 skips)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-rank DDP table")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory table")
    parser.add_argument("--no-alternatives", action="store_true",
                        help="table 1 without wandb.watch and the norm loop (to compare metric choices)")
    parser.add_argument("--bundle", default=",".join(BUNDLE),
                        help="comma-separated metric names (name:recipe+recipe for layer-*-quant), or a bundle "
                             f"name ({', '.join(BUNDLES)}), to measure instead of the standard bundle")
    parser.add_argument("--compare", nargs="*", default=[], metavar="BUNDLE=INTERVAL",
                        help=f"named bundles ({', '.join(BUNDLES)}) added to table 1 every 1 and at INTERVAL")
    parser.add_argument("--memory-variant", choices=MEMORY, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bundle = BUNDLES.get(args.bundle) or tuple(n.strip() for n in args.bundle.split(",") if n.strip())
    compare = _parse_compare(parser, args.compare)
    if args.memory_variant:
        print(json.dumps(_memory_variant(args.memory_variant, args.threads, bundle)))
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
          f"bundle: {', '.join(bundle)}")
    for line in single_process(args.rounds, args.steps, bundle, alternatives=not args.no_alternatives,
                               pairs=args.pairs, compare=compare):
        print(line)
    if not args.no_ddp:
        print()
        for line in ddp(args.rounds, args.steps, bundle):
            print(line)
    if not args.no_memory:
        print()
        for line in memory(args.threads, bundle):
            print(line)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
