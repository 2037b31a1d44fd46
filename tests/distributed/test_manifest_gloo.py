"""Plain tensors that differ across ranks without a declared placement are refused at
construction on every rank with the fix, never measured as replicas: a tensor split by hand
(different shapes) and a model cast on one rank only (different dtypes). A hand split declared
``Shard`` gets its global shape from the ranks' shards (row and column norms need it), and one
that ``torch.chunk`` would not make is refused with the shapes."""

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


LINES = ("global-param-l2", "global-param-mean-row-l2", "global-param-mean-column-l2")


def _construct(model: torch.nn.Module, placements, names=("global-param-l2",)) -> tuple[str, object]:
    topology = Topology.from_groups({"tp": dist.group.WORLD})
    try:
        metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], topology=topology,
                                placements=placements, timeout_s=30)
    except ConfigError as exc:
        return "error", str(exc)
    with metrics.step(1):
        pass
    values = {r.metric: r.value for r in metrics.last_records}
    shape = metrics.manifest.entries[0].shape
    metrics.close()
    return ("value", values["global-param-l2"]) if len(names) == 1 else ("values", (shape, values))


def _scenarios(rank: int, world: int) -> dict[str, tuple[str, object]]:
    split = FULL[:4] if rank == 0 else FULL[4:]  # rows 0-3 on rank 0, 4-5 on rank 1 (uneven, by hand)
    chunked = FULL[:5].chunk(2)[rank]  # rows 0-2 and 3-4: uneven, as torch.chunk splits 5 rows
    columns = FULL.t().contiguous().chunk(2, dim=1)[rank]  # [2, 3] each: columns 0-2 and 3-5
    cast = FULL if rank == 0 else FULL.bfloat16()
    return {"undeclared": _construct(_model(split), None),
            "declared": _construct(_model(split), {"proj": {"tp": "S0"}}),
            "declared chunks": _construct(_model(chunked), {"proj": {"tp": "S0"}}, LINES),
            "declared columns": _construct(_model(columns), {"proj": {"tp": "S1"}}, LINES),
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


@pytest.mark.parametrize("case, full", [("declared chunks", FULL[:5]), ("declared columns", FULL.t())])
def test_hand_split_tensor_with_declared_shard_is_measured_whole(outcomes, case, full):
    """The global shape is the shards' sizes summed along the declared dim (not the first rank's
    shard), so the row and column norms count every line once, on every rank."""
    full = full.double()
    for by_case in outcomes:
        kind, (shape, values) = by_case[case]
        assert kind == "values" and shape == tuple(full.shape)
        assert values == {"global-param-l2": pytest.approx(full.norm().item(), rel=1e-9),
                          "global-param-mean-row-l2": pytest.approx(full.norm(dim=1).mean().item(), rel=1e-9),
                          "global-param-mean-column-l2": pytest.approx(full.norm(dim=0).mean().item(), rel=1e-9)}


def test_hand_split_that_torch_chunk_would_not_make_is_refused_with_the_shapes(outcomes):
    """Rows 0-3 and 4-5 declared S0: Shard means torch.chunk's split, rows 0-2 and 3-5; a
    statistic placing rows by coordinate would misplace them, so the run is refused on every rank."""
    for by_case in outcomes:
        kind, message = by_case["declared"]
        assert kind == "error"
        assert "local shapes {'tp': 0}: [4, 2]; {'tp': 1}: [2, 2], so its global shape is [6, 2]" in message
        assert "giving [3, 2] at {'tp': 0}. Split the tensor as torch.chunk does" in message


def test_model_cast_on_one_rank_is_refused_with_the_dtype_fix(outcomes):
    for by_case in outcomes:
        kind, message = by_case["cast on one rank"]
        assert kind == "error"
        assert "'proj' is float32 on rank 0 but bfloat16 on rank 1 (same shape [6, 2])" in message
        assert "Cast the model on every rank" in message and "placements" not in message
