"""A plain tensor split by hand across ranks (different local shapes, no DTensor) is refused
at construction on every rank with the placement to declare, never measured as a replica."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.axes import Topology
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

FULL = torch.arange(12.0).reshape(6, 2)


def _model(rank: int) -> torch.nn.Module:
    """Rank 0 holds rows 0-3 of FULL, rank 1 rows 4-5 (an uneven split by hand)."""
    rows = FULL[:4] if rank == 0 else FULL[4:]
    model = torch.nn.Module()
    model.proj = torch.nn.Parameter(rows.clone())
    return model


def _construct(rank: int, world: int, placements):
    topology = Topology.from_groups({"tp": dist.group.WORLD})
    try:
        metrics = TensorMetrics(_model(rank), metrics=[(build_metric("global-param-l2"), 1)], topology=topology,
                                placements=placements, timeout_s=30)
    except ConfigError as exc:
        return "error", str(exc)
    with metrics.step(1):
        pass
    (record,) = metrics.last_records
    metrics.close()
    return "value", record.value


def _undeclared(rank, world):
    return _construct(rank, world, None)


def _declared(rank, world):
    return _construct(rank, world, {"proj": {"tp": "S0"}})


def test_hand_split_tensor_without_placement_is_refused_on_every_rank():
    for kind, message in run_distributed(_undeclared, 2, timeout=60):
        assert kind == "error"
        assert "'proj' is float32 [4, 2] on rank 0 but float32 [2, 2] on rank 1" in message
        assert "placements: {'proj': {'tp': 'S0'}}" in message


def test_hand_split_tensor_with_declared_shard_is_measured_whole():
    for kind, value in run_distributed(_declared, 2, timeout=60):
        assert kind == "value"
        assert value == pytest.approx(FULL.double().norm().item(), rel=1e-9)
