"""Graphs, graph breaks and recompiles of a model under ``torch.compile(fullgraph=True)``, with
and without tmetrics, for token metrics due every step, every 5 steps and never.

    python -m bench.compile_counts [--backend eager inductor] [--steps 7] [--model demo|mixtral]
                                   [--allow-breaks]

The model is the demo MoE transformer (tiny, fixed-shape expert dispatch so that it compiles
whole), or a tiny transformers Mixtral built from a config (routers found by the HF
integration), with the demo's metric bundle: residual stream and contribution RMS, output logits,
every router metric, gradient and parameter norms. ``never`` is an interval longer than the
run: only the first step is due (tmetrics measures the first step of every run). Counted:
graphs the backend receives in the first step (warm-up) and after it (recompiles), dynamo's
graph-break counter, warnings from the ``warnings`` module and the ``torch`` loggers; each
compiled run's records against the same run uncompiled (largest relative difference).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tmetrics_core.demo.model import MoE, ModelConfig, Transformer, fixed_shape_dispatch
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

BUNDLE = (
    "global-grad-l2", "layer-grad-l2", "layer-param-l2", "layer-residual-accumulator-rms",
    "layer-residual-contribution-rms", "output-logits-max", "output-entropy", "layer-router-logits-l2",
    "layer-router-decision-entropy", "layer-expert-tokens", "layer-expert-load-imbalance", "layer-dead-experts",
    "layer-router-z-loss",
)
"""The demo's bundle (``tmetrics_core/demo/default_config.yaml``) less the optimizer-state and
histogram metrics, which read nothing inside the compiled forward."""

BACKWARD = ("layer-residual-grad-rms", "layer-backward-gain", "output-logits-grad-l2", "layer-residual-grad-absmax")
"""Cotangent metrics: tensor hooks registered in the compiled forward, observed in its backward."""

CADENCES: dict[str, int | None] = {"every step": 1, "every 5": 5, "never": 10**9, "no tmetrics": None}
CONFIG = dict(d_model=16, n_heads=2, d_ff=16, n_experts=4, top_k=2, seq_len=8)
"""The demo model's shape (``layers`` blocks, 2 by default)."""


@dataclass
class Counts:
    """What one compiled run showed; ``records[step]`` maps (metric, layer, expert, stat) to value."""

    graphs: int = 0
    recompiles: int = 0
    breaks: int = 0
    warnings: list[str] = field(default_factory=list)
    records: dict[int, dict[tuple, Any]] = field(default_factory=dict)
    seconds: float = 0.0


class _Warnings(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"{record.name}: {record.getMessage()[:200]}")


def run(backend: str | None, interval: int | None, *, steps: int = 7, seed: int = 0, fullgraph: bool = True,
        model_name: str = "demo", layers: int = 2, device: str = "cpu", bundle: tuple[str, ...] = BUNDLE) -> Counts:
    """Train the tiny ``model_name`` (``demo``, ``mixtral`` or ``tiny``, ``layers`` blocks) ``steps`` steps,
    compiled with ``backend`` (None: eager), with the bundle due every ``interval`` steps (None:
    no tmetrics), on ``device`` (``bundle``: the metric names, :data:`BUNDLE` by default). Deprecation warnings are not counted (Python does not show them by default;
    inductor's first compile in a process raises some of its own)."""
    torch._dynamo.reset()
    counters.clear()
    out = Counts()
    torch.manual_seed(seed)
    model = MODELS[model_name](layers, seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = None if interval is None else TensorMetrics(
        model, metrics=[(build_metric(name), interval) for name in bundle], optimizer=optimizer)
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    if backend is not None:
        inner = torch._dynamo.lookup_backend(backend)

        def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            if out.records:
                out.recompiles += 1
            else:
                out.graphs += 1
            return inner(gm, example_inputs)

        forward = torch.compile(model, backend=counting, fullgraph=fullgraph)
    data = torch.Generator().manual_seed(seed + 1)
    handler = _Warnings(out.warnings)
    logging.getLogger("torch").addHandler(handler)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, steps + 1):
                tokens = torch.randint(0, 256, (2, CONFIG["seq_len"] + 1), generator=data).to(device)
                with (metrics.step(step) if metrics is not None else _nothing()):
                    logits = forward(tokens[:, :-1])
                    logits = getattr(logits, "logits", logits)  # transformers returns an output object
                    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                out.records[step] = ({(r.metric, r.layer, r.expert, r.stat): r.value for r in metrics.last_records
                                      if r.step == step} if metrics is not None else {})
        out.warnings += [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught
                         if not issubclass(w.category, DeprecationWarning)]
    finally:
        logging.getLogger("torch").removeHandler(handler)
        if metrics is not None:
            metrics.close()
    out.seconds = time.perf_counter() - start
    out.breaks = sum(counters["graph_break"].values())
    return out


class _MoEBlock(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.moe = MoE(config)
        self.moe.dispatch = fixed_shape_dispatch

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class _Tiny(torch.nn.Module):
    """Embedding, residual blocks holding only the demo's MoE layer (2 experts, top 1), head:
    every observed kind of the bundle, with few kernels for inductor to compile."""

    def __init__(self, layers: int, seed: int) -> None:
        super().__init__()
        config = ModelConfig(d_model=8, n_heads=1, d_ff=8, n_experts=2, top_k=1, n_layers=layers, seq_len=8)
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(256, 8)
        self.layers = torch.nn.ModuleList(_MoEBlock(config) for _ in range(layers))
        self.head = torch.nn.Linear(8, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _demo(layers: int, seed: int) -> torch.nn.Module:
    model = Transformer(ModelConfig(n_layers=layers, **CONFIG), seed=seed)  # type: ignore[arg-type]
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatch = fixed_shape_dispatch  # data-dependent shapes break any whole-graph compile
    return model


def _mixtral(layers: int, seed: int) -> torch.nn.Module:
    """A tiny transformers Mixtral from a config (its routers are found by tmetrics' HF integration)."""
    import transformers

    config = transformers.MixtralConfig(hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=256, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    config._experts_implementation = "batched_mm"  # no data-dependent loop over the experts hit
    return transformers.MixtralForCausalLM(config)


MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {"demo": _demo, "mixtral": _mixtral, "tiny": _Tiny}
"""Model name -> ``(layers, seed) -> model``."""


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def largest_difference(got: dict[int, dict[tuple, Any]], want: dict[int, dict[tuple, Any]]) -> float:
    """Largest relative difference between two runs' records (inf where their keys differ)."""
    worst = 0.0
    for step, records in want.items():
        if got.get(step, {}).keys() != records.keys():
            return math.inf
        for key, value in records.items():
            for a, b in zip(_flat(got[step][key]), _flat(value)):
                if a != b and not (math.isnan(a) and math.isnan(b)):
                    worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    return worst


def _flat(value: Any) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=["eager", "inductor"])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--allow-breaks", action="store_true", help="fullgraph=False: count the breaks")
    args = parser.parse_args(argv)
    shape = CONFIG if args.model == "demo" else "transformers MixtralConfig(hidden 16, 4 experts, top 2)"
    print(f"torch {torch.__version__}, {args.model} model, 2 layers, {shape}, {args.steps} steps, fullgraph={not args.allow_breaks}")
    print("| backend | token metrics due | graphs | graph breaks | recompiles after step 1 | warnings "
          "| records vs eager (max rel. diff.) | run time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in args.backend:
        for cadence, interval in CADENCES.items():
            reference = run(None, interval, steps=args.steps, model_name=args.model).records if interval else {}
            counts = run(backend, interval, steps=args.steps, fullgraph=not args.allow_breaks, model_name=args.model)
            diff = largest_difference(counts.records, reference) if interval is not None else float("nan")
            print(f"| {backend} | {cadence} | {counts.graphs} | {counts.breaks} | {counts.recompiles} | "
                  f"{len(counts.warnings)} | {diff:.1e} | {counts.seconds:.1f} |")
            for line in counts.warnings[:3]:
                print(f"|   | warning: {line} |")


if __name__ == "__main__":
    main()
