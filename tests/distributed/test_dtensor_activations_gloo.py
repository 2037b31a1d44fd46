"""DTensor activations observed under tensor parallelism (2 gloo ranks): a Partial output of a
row-parallel linear, a feature-sharded output of a column-parallel linear and a sequence-
sharded (sequence parallel) tensor each give the unsharded value."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Shard, distribute_tensor, DTensor

from tests.distributed.harness import run_distributed
from tmetrics_core.topology import Topology
from tmetrics_core.metrics.norms import L2Norm, Max
from tmetrics_core.observe import observe
from tmetrics_core.tensor_metrics import TensorMetrics


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


FULL = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))


def _rank(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = Holder()
    metrics = TensorMetrics(model, metrics=[(L2Norm(name="l2", source_kinds=["activation"], scope="tensor"), 1),
                                            (Max(name="max", source_kinds=["activation"], scope="tensor"), 1)],
                            topology=Topology.from_mesh(mesh), timeout_s=30)
    block = model.layers[0]
    partial = DTensor.from_local(FULL / world, mesh, [Partial()])           # row-parallel output
    cols = distribute_tensor(FULL, mesh, [Shard(2)])                         # column-parallel output
    seq = distribute_tensor(FULL, mesh, [Shard(1)])                          # sequence parallel
    with metrics.step(1):
        observe(block, "partial", partial, kind="activation")
        observe(block, "cols", cols, kind="activation")
        observe(block, "seq", seq, kind="activation")
    return {(r.metric, r.tensor): r.value for r in metrics.last_records}


def test_dtensor_activations_equal_full_tensor():
    want_l2 = FULL.double().norm().item()
    want_max = FULL.max().item()
    for got in run_distributed(_rank, 2, timeout=90):
        for site in ("layers.0.partial", "layers.0.cols", "layers.0.seq"):
            assert got[("l2", site)] == pytest.approx(want_l2, rel=1e-6), site
            assert got[("max", site)] == pytest.approx(want_max, rel=1e-6), site
