"""Plain tensors that differ across ranks without a declared placement are refused at
construction on every rank with the fix, never measured as replicas: a tensor split by hand
(different shapes) and a model cast on one rank only (different dtypes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.topology import Topology
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

FULL = torch.arange(12.0).reshape(6, 2)


def _model(rows: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.Module()
    model.proj = torch.nn.Parameter(rows.clone())
    return model


def _construct(model: torch.nn.Module, placements) -> tuple[str, object]:
    topology = Topology.from_groups({"tp": dist.group.WORLD})
    try:
        metrics = TensorMetrics(model, metrics=[(build_metric("global-param-l2"), 1)], topology=topology,
                                placements=placements, timeout_s=30)
    except ConfigError as exc:
        return "error", str(exc)
    with metrics.step(1):
        pass
    (record,) = metrics.last_records
    metrics.close()
    return "value", record.value


def _scenarios(rank: int, world: int) -> dict[str, tuple[str, object]]:
    split = FULL[:4] if rank == 0 else FULL[4:]  # rows 0-3 on rank 0, 4-5 on rank 1 (uneven, by hand)
    cast = FULL if rank == 0 else FULL.bfloat16()
    return {"undeclared": _construct(_model(split), None),
            "declared": _construct(_model(split), {"proj": {"tp": "S0"}}),
            "cast on one rank": _construct(_model(cast), None)}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_distributed(_scenarios, 2, timeout=90)


def test_hand_split_tensor_without_placement_is_refused_on_every_rank(outcomes):
    for by_case in outcomes:
        kind, message = by_case["undeclared"]
        assert kind == "error"
        assert "'proj' is float32 [4, 2] on rank 0 but float32 [2, 2] on rank 1" in message
        assert "placements: {'proj': {'tp': 'S0'}}" in message


def test_hand_split_tensor_with_declared_shard_is_measured_whole(outcomes):
    for by_case in outcomes:
        assert by_case["declared"] == ("value", pytest.approx(FULL.double().norm().item(), rel=1e-9))


def test_model_cast_on_one_rank_is_refused_with_the_dtype_fix(outcomes):
    for by_case in outcomes:
        kind, message = by_case["cast on one rank"]
        assert kind == "error"
        assert "'proj' is float32 on rank 0 but bfloat16 on rank 1 (same shape [6, 2])" in message
        assert "Cast the model on every rank" in message and "placements" not in message
