"""Ranks that number their steps differently (a user's bug: one rank's counter two ahead) get a
``TMetricsError`` on every rank at their first due step, from the failure agreement every due
step runs anyway (two more elements); before, rank 0's step 2 was silently combined with rank
1's step 4 (layer-grad-l2 7.746 where either step alone gives 4.899 or 9.798)."""

from __future__ import annotations

import torch

from tests.distributed.harness import run_distributed
from tmetrics_core.errors import TMetricsError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology


def _run(rank: int, world: int, skew: int) -> list[tuple[int, object]]:
    import torch.distributed as dist

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(3, 1, bias=False)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 2)], optimizer=optimizer,
                            topology=Topology.from_groups({"dp": dist.group.WORLD}), timeout_s=30,
                            placements={"layers.0.weight": {"dp": "S0"}})
    out: list[tuple[int, object]] = []
    for step in range(2 + skew * rank, 6 + skew * rank, 2):
        model.layers[0].weight.grad = torch.full((1, 3), float(step))
        try:
            with metrics.step(step):
                optimizer.step()
            out.append((step, metrics.last_records[0].value))
        except TMetricsError as exc:
            out.append((step, str(exc)))
    metrics.close()
    return out


def test_ranks_at_different_steps_are_refused_on_every_rank():
    for rank, steps in enumerate(run_distributed(_run, 2, 2, timeout=120)):
        assert [s for s, _ in steps] == ([2, 4] if rank == 0 else [4, 6])
        for _, said in steps:
            assert isinstance(said, str) and "ranks measured different step numbers in one due step" in said
            assert "every rank must enter metrics.step(n) with the same n" in said


def test_ranks_at_the_same_step_are_measured():
    for steps in run_distributed(_run, 2, 0, timeout=120):
        # The weight is declared split over dp (a row per rank here: the full tensor [2, 3]).
        assert steps == [(2, (2 * 3 * 4.0) ** 0.5), (4, (2 * 3 * 16.0) ** 0.5)]
