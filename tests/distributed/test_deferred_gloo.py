"""Deferred token observation under data parallelism (2 gloo ranks): router outputs kept to the
step's end and residuals reduced to moments rows, over two micro-batches of which one is padded
on rank 0 only (so the ranks take different paths for it), over two steps with different
sequence lengths, equal one process that saw every token."""

from __future__ import annotations

import pytest
import torch

from tests.deferred_model import D, Model
from tests.distributed.harness import run_distributed

NAMES = ["layer-expert-tokens", "layer-expert-load-imbalance", "layer-router-decision-entropy", "layer-router-z-loss",
         "layer-router-logits-l2", "layer-router-logits-max", "layer-residual-accumulator-rms",
         "layer-residual-contribution-l2", "layer-residual-contribution-rms"]
STEPS = {1: 5, 2: 3}  # step -> sequence length


def _micro_batches(seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of 4 sequences; the first padded in sequences 0-1 only (rank 0's half)."""
    g = torch.Generator().manual_seed(seq)
    xs = [torch.randn(4, seq, D, generator=g) for _ in range(2)]
    first = torch.ones(4, seq, dtype=torch.bool)
    first[0, -2:] = False
    first[1, -1] = False
    return [(xs[0], first), (xs[1], torch.ones(4, seq, dtype=torch.bool))]


def _steps(rank: int | None, world: int) -> dict[int, dict[tuple, object]]:
    """Every step's records; ``rank`` None: one process with all sequences."""
    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    topology = None
    if rank is not None:
        import torch.distributed as dist

        topology = Topology.from_groups({"dp": dist.group.WORLD})
    model = Model()
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], topology=topology, timeout_s=30)
    out = {}
    for step, seq in STEPS.items():
        with metrics.step(step):
            for x, mask in _micro_batches(seq):
                part = slice(None) if rank is None else slice(rank * 4 // world, (rank + 1) * 4 // world)
                model(x[part], mask[part]).sum().backward()
        assert metrics.failures == [], metrics.failures
        out[step] = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
    return out


def _rank(rank: int, world: int) -> dict[int, dict[tuple, object]]:
    return _steps(rank, world)


@pytest.mark.timeout(120)
def test_data_parallel_ranks_equal_one_process() -> None:
    want = _steps(None, 1)
    for got in run_distributed(_rank, 2, timeout=100):
        for step in STEPS:
            assert got[step].keys() == want[step].keys() and want[step]
            for key, value in want[step].items():
                assert got[step][key] == pytest.approx(value, rel=1e-6), (step, key)
