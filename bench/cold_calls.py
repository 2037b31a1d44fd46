"""What Python costs inside a training step on a CPU, against the same call repeated at once.

    python -m bench.cold_calls [--steps 40] [--repeats 200]

The CPU tables time tmetrics' Python between the model's own kernels, which leave the caches
(and the core's clock) as a matmul leaves them. Two side-by-side measurements, in one run:

1. one small call of a forward hook (the rows pass of a block's output, sums of squares: what
   a residual norm reads) timed back to back, right after a 1024 x 1024
   matmul, and right after writing 64 MiB (median of ``--repeats`` each);
2. the executor's pass at the step's end on the demo with the standard bundle due every step,
   timed where it runs and then again at once on the same prepared states (the second
   result is dropped; the bundle keeps no state between steps), median over ``--steps``.

The ratios say how much of a CPU figure per call is the cold state rather than the code; an
accelerator's kernels do not evict the host's caches, so they do not carry over to a GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable

import torch

from bench.demo_variants import BUNDLE, make_trainer, tmetrics_factory
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.kernels.rows import rows

__all__ = ["main"]


def _after(work: Callable[[], Any], call: Callable[[], Any], repeats: int) -> float:
    """Median microseconds of ``call`` run right after ``work``."""
    times = []
    for _ in range(repeats):
        work()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def hook_call(repeats: int) -> list[str]:
    h = torch.randn(8, 128, 256)
    a, big = torch.randn(1024, 1024), torch.empty(16 << 20)
    def call() -> Any:
        return rows([h], ("sumsq",))
    warm = _after(lambda: None, call, repeats)
    timings = [("back to back", warm), ("after a 1024^2 matmul", _after(lambda: a @ a, call, repeats)),
               ("after writing 64 MiB", _after(lambda: big.fill_(1.0), call, repeats))]
    lines = ["Table 1: one forward hook's rows pass (sums of squares of an [8, 128, 256] tensor)",
             f"{'when':<24} {'us':>8} {'x warm':>7}"]
    lines += [f"{name:<24} {us:>8.1f} {us / warm:>7.1f}" for name, us in timings]
    return lines


def step_end(steps: int) -> list[str]:
    times: dict[str, list[float]] = {"in the step": [], "again at once": []}
    original = Executor.run

    def timed(self: Executor, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        middle = time.perf_counter()
        original(self, *args, **kwargs)
        times["in the step"].append(middle - start)
        times["again at once"].append(time.perf_counter() - middle)
        return out

    trainer = make_trainer(tmetrics_factory(1, BUNDLE))
    for step in range(1, 4):
        trainer.step(step)
    Executor.run = timed  # type: ignore[method-assign]
    gc.disable()
    try:
        for step in range(4, 4 + steps):
            trainer.step(step)
    finally:
        gc.enable()
        Executor.run = original  # type: ignore[method-assign]
        trainer.metrics.close()
    cold, warm = (statistics.median(times[k]) * 1e3 for k in ("in the step", "again at once"))
    return [f"Table 2: the executor's pass at the demo's step end, standard bundle every step, {steps} due steps",
            f"{'when':<24} {'ms':>8} {'x warm':>7}",
            f"{'in the step':<24} {cold:>8.3f} {cold / warm:>7.2f}", f"{'again at once':<24} {warm:>8.3f} {1.0:>7.2f}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="due steps of the demo (table 2)")
    parser.add_argument("--repeats", type=int, default=200, help="calls per row of table 1")
    args = parser.parse_args(argv)
    print("\n".join(hook_call(args.repeats)))
    print()
    print("\n".join(step_end(args.steps)))


if __name__ == "__main__":
    main()
