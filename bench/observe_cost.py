"""Cost of observation: ``observe()`` per call, due and not due, and the demo model's forward
with tmetrics attached on due and idle steps, against a bare forward.

    python -m bench.observe_cost [--rounds 30]

Variants alternate in short rounds (order rotated) so machine drift cancels; ratios are medians
of per-round ratios to the bare forward, from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.norms import L2Norm, Rms
from tmetrics_core.observe import observe
from tmetrics_core.observer import _ACTIVE
from tmetrics_core.tensor_metrics import TensorMetrics


class _Idle:
    kinds = frozenset({"something_else"})

    def record(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError


def per_call() -> dict[str, float]:
    module = torch.nn.Linear(2, 2)
    x = torch.randn(256, 4)
    n = 200_000
    out = {"observe(), no step scope (ns)": timeit.timeit(
        lambda: observe(module, "router_logits", x, kind="router_logits"), number=n) / n * 1e9}
    token = _ACTIVE.set(_Idle())
    out["observe(), scope active, kind not due (ns)"] = timeit.timeit(
        lambda: observe(module, "router_logits", x, kind="router_logits"), number=n) / n * 1e9
    _ACTIVE.reset(token)
    return out


def _forward(model, tokens):
    with torch.no_grad():
        model(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    for label, value in per_call().items():
        print(f"{label:<46} {value:8.0f}")
    config = ModelConfig()
    model = Transformer(config, seed=0)
    bare = Transformer(config, seed=0)  # tmetrics' hooks stay on `model` between steps: a copy without them
    tokens = torch.randint(0, 256, (8, config.seq_len))
    bundle = [(Rms(name="layer-residual-accumulator-rms", source_kinds=["residual_accumulator"], scope="layer"), 1),
              (Rms(name="layer-residual-contribution-rms", source_kinds=["residual_contribution"], scope="layer"), 1),
              (L2Norm(name="layer-router-logits-l2", source_kinds=["router_logits"], scope="layer"), 1),
              (L2Norm(name="global-output-logits-l2", source_kinds=["logits"]), 1)]
    due = TensorMetrics(model, metrics=bundle)
    idle_metrics = [(m, 10**9) for m, _ in bundle]
    idle = TensorMetrics(model, metrics=idle_metrics)
    with idle.step(10**9):  # spend the first (always due) step
        pass
    step = [0]

    def run(variant: str) -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            step[0] += 1
            if variant == "bare":
                _forward(bare, tokens)
            elif variant == "idle step":
                with idle.step(step[0]):
                    _forward(model, tokens)
            else:
                with due.step(step[0]):
                    _forward(model, tokens)
        return (time.perf_counter() - start) / args.steps

    names = ["bare", "idle step", "due step"]
    per_round = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % 3:] + names[:r % 3]:
            per_round[n].append(run(n))
    base = per_round["bare"]
    print(f"\ndemo model forward (d_model {config.d_model}, {config.n_layers} layers, batch 8 x {config.seq_len}), "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<12} {'ms/forward':>10} {'ratio':>7}")
    for n in names:
        ratio = statistics.median(v / b for v, b in zip(per_round[n], base))
        print(f"{n:<12} {statistics.median(per_round[n]) * 1e3:>10.2f} {ratio:>7.3f}")
    print("due step: residual accumulator and contribution RMS, router-logit L2, output-logit L2 on every layer")


if __name__ == "__main__":
    main()
