"""What tmetrics does to a training step, checked by behaviour (the timings are in bench/):
a not-due step runs no tensor operation of tmetrics and reads nothing back; a due step copies
its results to the host once; the update snapshot covers only the selected tensors, is
released with the step, and gives the reference update ratio."""

from __future__ import annotations

import math
import traceback
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.demo_variants import BUNDLE
from tmetrics_core.demo.data import ByteCorpus, stdlib_files
from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.demo.train import TrainConfig, Trainer
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, seq_len=16)


def _from_tmetrics() -> bool:
    return any("tmetrics_core" in f.filename and "/demo/" not in f.filename for f in traceback.extract_stack())


class _TmetricsOps(TorchDispatchMode):
    """Counts the torch ops issued from tmetrics code (not the demo model) and scalar reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _from_tmetrics():
            self.ops.append(str(func))
            self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_files(stdlib_files()[:10], source="ten stdlib files")


def _trainer(corpus: ByteCorpus, names: tuple[str, ...], interval: int) -> Trainer:
    def metrics(model, optimizer, mesh):
        return TensorMetrics(model, metrics=[(build_metric(n), interval) for n in names], optimizer=optimizer)
    config = TrainConfig(steps=100, batch_size=4, warmup_steps=2)
    return Trainer(parallelize(SMALL, ParallelDegrees(), seed=0, batch_size=4), corpus, config, metrics=metrics)


def test_not_due_step_runs_no_tmetrics_tensor_op(corpus):
    trainer = _trainer(corpus, BUNDLE, interval=50)
    trainer.step(1)  # the first step is always due
    with _TmetricsOps() as idle:
        trainer.step(2)
    assert idle.ops == [] and idle.reads == 0
    with _TmetricsOps() as due:  # the counter does see tmetrics when something is due
        result = trainer.step(50)
    assert len(due.ops) > 50  # 84 on this model (the demo's bench counts 102 per due step)
    assert math.isfinite(result.loss)
    assert {r.metric for r in trainer.metrics.last_records} == set(BUNDLE)


def test_due_step_copies_results_to_the_host_once(corpus, monkeypatch):
    names = ("layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio",
             "layer-residual-accumulator-rms", "layer-residual-contribution-rms")
    trainer = _trainer(corpus, names, interval=1)
    trainer.step(1)
    copies = []
    original = torch.Tensor.tolist

    def tolist(self):
        if _from_tmetrics():
            copies.append(self.numel())
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with _TmetricsOps() as due:
        trainer.step(2)
    records = trainer.metrics.last_records
    assert {r.metric for r in records} == set(names) and len(records) == 2 * len(names)
    # One transfer holds every result, merged per layer on the device first (not one value per
    # tensor): per layer, param and grad L2 1 each, absmax 2 (value, NaN flag), update ratio 2
    # (sums of squares of update and parameter), each RMS 2 (sum of squares, count).
    assert copies == [2 * (1 + 1 + 2 + 2 + 2 + 2)] and due.reads == 0


def test_update_snapshot_covers_selected_tensors_and_ends_with_the_step(monkeypatch):
    import tmetrics_core.sources.param_observer as tm

    model = Transformer(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio", select="layers.1.*"), 1)],
                            optimizer=optimizer)
    taken = []
    original = tm.snapshot
    monkeypatch.setattr(tm, "snapshot", lambda manifest, names=None: taken.append(names)
                        or original(manifest, names))
    layer1 = [(n, p) for n, p in model.named_parameters() if n.startswith("layers.1.")]
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for step in (1, 2):
        with metrics.step(step):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
            before = [p.detach().clone() for _, p in layer1]
            optimizer.step()
            optimizer.zero_grad()
        assert metrics.params._before is None  # released with the step, not kept until the next one
    assert [set(names) for names in taken] == [{n for n, _ in layer1}] * 2
    delta = torch.cat([(p.detach() - b).reshape(-1) for (_, p), b in zip(layer1, before)]).double()
    theta = torch.cat([p.detach().reshape(-1) for _, p in layer1]).double()
    (record,) = metrics.last_records
    assert (record.metric, record.layer) == ("layer-update-ratio", 1)
    assert record.value == pytest.approx((delta.norm() / theta.norm()).item(), rel=1e-6)
