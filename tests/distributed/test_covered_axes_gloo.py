"""Axes that lie inside a DTensor's own mesh (torchtitan's dense and expert meshes over the same
ranks), on 4 gloo ranks: a DTensor Shard(0) on the ``fsdp`` sub-mesh of a ``(fsdp, tp)`` mesh, with a second
axis ``efsdp`` bound to the same ranks as ``fsdp`` (covered: no placement, no Replica claim,
its norm counted once) and a world-wide axis ``all`` that lies partly in the mesh (refused)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.distributed.harness import run_distributed
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

FULL = torch.arange(1.0, 17.0).reshape(8, 2)


def _both(rank: int, world: int) -> tuple[dict, str]:
    """The covered run, then the message of the refused one (one spawn for both)."""
    covered = _run(rank, world, False)
    try:
        _run(rank, world, True)
    except PlacementError as exc:
        return covered, str(exc)
    return covered, ""


def _run(rank: int, world: int, partly: bool) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(distribute_tensor(FULL, mesh["fsdp"], [Shard(0)]))
    model.weight.grad = distribute_tensor(FULL * 0.5, mesh["fsdp"], [Shard(0)])
    groups = {"fsdp": mesh.get_group("fsdp"), "tp": mesh.get_group("tp")}
    # efsdp: the fsdp ranks again, from a group of its own (as torchtitan's expert mesh)
    fsdp_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    groups["efsdp"] = fsdp_groups[rank % 2]
    if partly:
        groups["all"] = dist.group.WORLD
    topology = Topology.from_groups(groups, population_axes=["fsdp"])
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1), (build_metric("global-param-l2"), 1)],
                            topology=topology)
    entry = metrics.manifest.entries[0]
    with metrics.step(1):
        metrics.observe_gradients()
    out = {"origins": dict(entry.origins), "placements": entry.placements,
           "records": {r.metric: r.value for r in metrics.last_records}}
    metrics.close()
    return out


def test_an_axis_inside_the_mesh_is_covered_and_counted_once_and_one_partly_inside_is_refused():
    for result, refused in run_distributed(_both, 4, timeout=120):
        # tp meets the sub-mesh in this rank only: independent of it, a replica there (checked)
        assert result["origins"] == {"fsdp": "dtensor", "tp": "inferred", "efsdp": "covered"}
        assert [a for a, _ in result["placements"]] == ["fsdp"]
        assert result["records"]["global-grad-l2"] == pytest.approx((FULL * 0.5).norm().item(), rel=1e-7)
        assert result["records"]["global-param-l2"] == pytest.approx(FULL.norm().item(), rel=1e-7)
        assert "axis 'all'" in refused and "lies partly inside that mesh" in refused
