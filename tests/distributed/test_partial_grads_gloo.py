"""A replicated DTensor weight fed by sequence-parallel activations gets a Partial(sum)
gradient on tp: its norm is taken after the partial sums are added (2 gloo ranks), and equals
the gradient's full_tensor() norm on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed


def _rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp_norm = torch.nn.Module()
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    model.layers[0].mlp_norm.weight = weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 1), (build_metric("global-grad-l2"), 1)],
                            optimizer=optimizer, topology=Topology.from_mesh(mesh), timeout_s=30)
    x = DTensor.from_local(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) * (rank + 1), mesh,
                           [Shard(0)])
    with metrics.step(1):
        (x * weight).sum().backward()
        placements = str(weight.grad.placements)
        want = weight.grad.full_tensor().norm().item()
        optimizer.step()
    return placements, want, {r.metric: r.value for r in metrics.last_records}


def test_partial_gradient_is_summed_before_the_norm():
    for placements, want, got in run_distributed(_rank, 2, timeout=90):
        assert "Partial" in placements
        assert got["layer-grad-l2"] == pytest.approx(want, rel=1e-6)
        assert got["global-grad-l2"] == pytest.approx(want, rel=1e-6)
