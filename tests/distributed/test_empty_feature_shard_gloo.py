"""Logits split along the vocabulary over 4 tensor-parallel ranks where ``torch.chunk`` leaves
the last rank nothing (V = 5: widths 2, 2, 1, 0), observed as plain tensors with
``shard_dim=1`` and as DTensors ``Shard(1)``: the empty shard joins the reductions and the
values equal the whole logits' in float64 (an empty shard used to raise into the forward)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tmetrics_core as tm
from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

NAMES = ("global-output-logits-l2", "output-logits-max", "output-entropy")
ROWS, VOCAB = 5, 5


def _logits() -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


def _run(rank: int, world: int) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    full = _logits()
    parts = torch.chunk(full, world, dim=1)
    local = parts[rank] if rank < len(parts) else full[:, :0]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for how in ("plain", "dtensor"):
        model = torch.nn.Module()
        model.head = torch.nn.Linear(1, 1, bias=False)
        if how == "plain":
            topology, x, shard_dim = Topology.from_groups({"tp": dist.group.WORLD}), local, 1
        else:
            topology, shard_dim = Topology.from_mesh(mesh), None
            x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=full.shape, stride=full.stride())
        metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], topology=topology, timeout_s=60)
        with metrics.step(1):
            tm.observe(model.head, "", x, kind="logits", shard_dim=shard_dim)
        assert metrics.failures == []
        out[how] = {r.metric: r.value for r in metrics.last_records}
        metrics.close()
    return out


def test_an_empty_vocabulary_shard_is_measured_with_the_others():
    z = _logits().double()
    p = z.softmax(-1)
    want = {"global-output-logits-l2": pytest.approx(z.norm().item(), rel=1e-6),
            "output-logits-max": pytest.approx(z.max().item(), rel=1e-6),
            "output-entropy": pytest.approx((-(p * p.log()).sum(-1)).mean().item(), rel=1e-6)}
    assert [len(c) for c in torch.chunk(torch.empty(VOCAB), 4)] == [2, 2, 1]  # rank 3 holds nothing
    for by_how in run_distributed(_run, 4, timeout=120):
        assert by_how == {"plain": want, "dtensor": want}
