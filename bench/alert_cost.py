"""Cost of the alert rules per due step, as a ratio to the training step.

    python -m bench.alert_cost [--rounds 30] [--layers 96] [--experts 64]

1. Demo bundle: the records of a due step of the demo (its default config, ``alerts: default``)
   are taken from a real run of 5 steps; the rules then see them once per round, interleaved with
   bare demo training steps (no metrics), and the paired ratio is rules / step.
2. ``--layers`` x ``--experts``: the same metric set synthesized for a model that size (per layer:
   the demo bundle's scalars, tokens per expert as a vector of ``--experts``, two load-imbalance
   stats), values drawn around 1 so no rule trips; the rules' seconds per due step are printed,
   with the ratio to the demo step as an upper bound (a model that size steps far slower).

Every series is past its warm-up before timing (the steady state: a full baseline window).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from tmetrics_core.alerts import AlertEngine
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.config.schema import load_config
from tmetrics_core.demo.data import ByteCorpus
from tmetrics_core.demo.instrument import DEFAULT_CONFIG
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.train import TrainConfig, Trainer
from tmetrics_core.records import Labels, MetricRecord
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.demo.topology import Topology


def _trainer(metrics) -> Trainer:
    parallel = parallelize(ModelConfig(), Topology.for_world(1), seed=0, batch_size=8)
    return Trainer(parallel, ByteCorpus.from_stdlib(), TrainConfig(steps=10_000), metrics=metrics)


def demo_records() -> list[MetricRecord]:
    """The records of step 5 (a due step of every interval-5 metric) of the demo's default config."""
    config = load_config(DEFAULT_CONFIG).to_dict() | {"sinks": {}}
    holder: list[TensorMetrics] = []

    def factory(model, optimizer, mesh):
        holder.append(TensorMetrics.from_config(config, model=model, optimizer=optimizer,
                                                run_dir=tempfile.mkdtemp(prefix="alert-cost-")))
        return holder[0]

    trainer = _trainer(factory)
    for step in range(1, 6):
        trainer.step(step)
    records = list(holder[0].last_records)
    holder[0].close()
    return records


def synthetic_records(layers: int, experts: int, step: int, rng: random.Random) -> list[MetricRecord]:
    scalars = ("layer-grad-l2", "layer-param-l2", "layer-update-ratio", "layer-grad-absmax",
               "layer-residual-accumulator-rms", "layer-residual-contribution-rms", "layer-router-logits-l2",
               "layer-router-decision-entropy", "layer-dead-experts", "layer-router-z-loss")
    out = [MetricRecord("global-grad-l2", step, 1 + 0.1 * rng.random())]
    for layer in range(layers):
        out += [MetricRecord(name, step, 1 + 0.1 * rng.random(), labels=Labels(layer=layer)) for name in scalars]
        out += [MetricRecord("layer-grad-nonfinite", step, 0.0, labels=Labels(layer=layer, stat=s)) for s in ("nan", "inf")]
        out.append(MetricRecord("layer-expert-tokens", step, tuple(100 + 10 * rng.random() for _ in range(experts)),
                                labels=Labels(layer=layer)))
        out += [MetricRecord("layer-expert-load-imbalance", step, 1.1, labels=Labels(layer=layer, stat=s))
                for s in ("max_over_mean", "cv")]
    return out


def _warm(engine: AlertEngine, stream) -> int:
    for step in range(1, 25):
        engine.observe(stream(step), step)
    return 25


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rules = parse_alerts("default")

    records = demo_records()
    demo = AlertEngine(rules)
    step = _warm(demo, lambda s: [MetricRecord(r.metric, s, r.value, r.layer, r.expert, r.tensor, r.stat)
                                  for r in records])
    big_rng = random.Random(0)
    big = AlertEngine(rules)
    big_step = _warm(big, lambda s: synthetic_records(args.layers, args.experts, s, big_rng))
    big_batches = [synthetic_records(args.layers, args.experts, big_step + i, big_rng) for i in range(args.rounds)]

    trainer = _trainer(None)
    train_step = 1
    ratios, demo_s, big_s, step_s = [], [], [], []
    for round_ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.step(train_step)
            train_step += 1
        one_step = (time.perf_counter() - start) / args.steps
        batch = [MetricRecord(r.metric, step, r.value, r.layer, r.expert, r.tensor, r.stat) for r in records]
        start = time.perf_counter()
        alerts = demo.observe(batch, step)
        rules_s = time.perf_counter() - start
        step += 1
        start = time.perf_counter()
        alerts += big.observe(big_batches[round_], big_step + round_)
        big_s.append(time.perf_counter() - start)
        assert not alerts, alerts  # steady values: the timing is of rules that do not trip
        ratios.append(rules_s / one_step)
        demo_s.append(rules_s)
        step_s.append(one_step)
    n_big = len(big_batches[0])
    series_big = big.watched
    print(f"demo bundle: {len(records)} records per due step, {demo.watched} (rule, series) "
          f"pairs; rules {statistics.median(demo_s) * 1e3:.3f} ms per due step; bare demo step "
          f"{statistics.median(step_s) * 1e3:.1f} ms; paired ratio {statistics.median(ratios):.5f} "
          f"({statistics.median(ratios) * 100:.3f}% of the step) over {args.rounds} rounds")
    print(f"{args.layers} layers x {args.experts} experts: {n_big} records per due step "
          f"({args.layers * args.experts} tokens-per-expert elements), {series_big} (rule, series) pairs; rules "
          f"{statistics.median(big_s) * 1e3:.2f} ms per due step = "
          f"{statistics.median(big_s) / statistics.median(step_s):.5f} x the demo step (an upper bound: a model that "
          f"size steps far slower)")


if __name__ == "__main__":
    main()
