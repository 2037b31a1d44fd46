"""Router logits split by expert over tp (``observe(..., shard_dim=1)``, 2 gloo ranks): the
normalized decision entropy and the z-loss equal one process with all experts."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

LOGITS = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
NAMES = ["layer-router-decision-entropy", "layer-router-z-loss"]


def _model(experts: int):
    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(8, experts, bias=False)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].moe = MoE()
    return model


def _run(model, logits, topology=None, shard_dim=None):
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.observe import observe
    from tmetrics_core.tensor_metrics import TensorMetrics

    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], topology=topology, timeout_s=30)
    with metrics.step(1):
        observe(model.layers[0].moe, "router_logits", logits, kind="router_logits", shard_dim=shard_dim)
    return {r.metric: r.value for r in metrics.last_records}


def _rank(rank, world):
    import torch.distributed as dist

    from tmetrics_core.topology import Topology

    topology = Topology.from_groups({"tp": dist.group.WORLD})
    return _run(_model(2), LOGITS[:, 2 * rank:2 * rank + 2], topology, shard_dim=1)


def test_expert_split_logits_equal_one_process():
    want = _run(_model(4), LOGITS)
    assert 0 < want["layer-router-decision-entropy"] <= 1
    for got in run_distributed(_rank, 2, timeout=90):
        for name in NAMES:
            assert got[name] == pytest.approx(want[name], rel=1e-6), name
