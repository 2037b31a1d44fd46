"""Where a due step's tmetrics time goes: the tensor passes against everything else.

:func:`due_step_time` builds the demo trainer with a bundle every step and times, over a few
steps, the tmetrics code the training thread runs (step scope exit, optimizer hooks,
``observe_gradients``, forward-hook observations, the attention observations and the cotangent
hooks of the backward) and, inside it, the passes over tensor elements: the rows passes
(:func:`tmetrics_core.kernels.rows.rows`), the update snapshot copy, the attention metrics' chunked recompute of the
scores and the low-precision emulation. The rest is per-tensor and per-observation Python and
small torch ops. Beside it, the model's own attention kernel (``F.scaled_dot_product_attention``
in the forward), the work the attention metrics re-read. Timed directly with
``time.perf_counter`` around those functions, so the figures are the in-step costs (slower
than the same code in a warm loop: the model's kernels evict the caches between calls).

``python -m bench.due_step_time [--steps N]`` prints the figures of the standard bundle.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from bench.demo_variants import BUNDLE, make_trainer, tmetrics_factory
from tmetrics_core import tensor_metrics
import torch.nn.functional as F

from tmetrics_core.metrics import attention_heads, vectors
from tmetrics_core.metrics.quant import metric as quant_metric
from tmetrics_core.sources import param_observer, param_program, tokens

__all__ = ["DueStepTime", "due_step_time", "main"]

_ENTRIES = ((tensor_metrics.TensorMetrics, "_pre_step"), (tensor_metrics.TensorMetrics, "_post_step"),
            (tensor_metrics.TensorMetrics, "observe_gradients"), (tensor_metrics.TensorMetrics, "_finish_step"),
            (tokens.TokenObserver, "record"), (tokens.TokenObserver, "record_residual"),
            (tokens.TokenObserver, "record_attention"), (tokens.TokenObserver, "tap"),
            (tokens.TokenObserver, "cotangent"))
"""The tmetrics code of a step (never nested in one another)."""

_PASSES = ((vectors, "rows"), (param_program, "moments_rows"), (param_observer, "snapshot"),
           (attention_heads, "query_parts"), (quant_metric, "quant_rows"))
"""The passes over tensor elements (called only from inside the entries)."""

_ATTENTION = ((F, "scaled_dot_product_attention"),)
"""The model's attention kernel (called by the demo model, never by tmetrics)."""


@dataclass(frozen=True)
class DueStepTime:
    """Milliseconds per due step: all tmetrics code, its passes over tensor elements, and the
    model's attention kernels in the forward (not tmetrics code: the scale of the attention
    metrics' recompute)."""

    total_ms: float
    passes_ms: float
    attention_ms: float = 0.0


@contextlib.contextmanager
def _timed(targets: tuple[tuple[Any, str], ...], clock: list[float]) -> Iterator[None]:
    """Add the seconds spent in each ``(owner, attribute)`` function to ``clock[0]``."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets]

    def timed(f: Any) -> Any:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - start
        return run

    try:
        for owner, name, f in saved:
            setattr(owner, name, timed(f))
        yield
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)


def due_step_time(bundle: tuple[str, ...], steps: int = 20) -> DueStepTime:
    """Median over ``steps`` due steps (after 3 warm-up steps) of the tmetrics time and of its
    tensor passes, in ms, with the bundle every step on a fresh demo trainer."""
    total, passes, attention = [0.0], [0.0], [0.0]
    with _timed(_ENTRIES, total), _timed(_PASSES, passes), _timed(_ATTENTION, attention):
        # Built inside: the optimizer hooks bind the wrapped methods.
        trainer = make_trainer(tmetrics_factory(1, bundle))
        for step in range(1, 4):
            trainer.step(step)
        per_step = []
        for step in range(4, 4 + steps):
            before = (total[0], passes[0], attention[0])
            trainer.step(step)
            per_step.append((total[0] - before[0], passes[0] - before[1], attention[0] - before[2]))
    trainer.metrics.close()
    return _median(per_step)


def _median(per_step: Sequence[tuple[float, ...]]) -> DueStepTime:
    """Each column's median over the steps, in ms."""
    return DueStepTime(*(sorted(column)[len(column) // 2] * 1e3 for column in zip(*per_step)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="due steps timed (default 40)")
    args = parser.parse_args()
    t = due_step_time(BUNDLE, args.steps)
    print(f"due step of the standard bundle, tmetrics code timed directly, median of {args.steps} steps")
    print(f"tmetrics code {t.total_ms:6.2f} ms  (passes over tensor elements {t.passes_ms:5.2f} ms; "
          f"the model's attention kernels {t.attention_ms:5.2f} ms)")


if __name__ == "__main__":
    main()
