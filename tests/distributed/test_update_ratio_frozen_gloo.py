"""``layer-update-ratio`` runs over the layer's trainable tensors: a frozen parameter
(``requires_grad`` False, as LoRA's base weights; not in the optimizer) is left out of
``||θ||`` as well as of the update, and a layer with no trainable tensor writes no record.
Before, the frozen weight's norm sat in the denominator (0.0026 for 0.0724 on a 64 x 64 frozen
weight beside a trained 16 x 16 Linear). Worlds 1 and 2 (data-parallel replicas), against
float64 references; a trainable tensor that got no gradient still counts, with update 0."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)])
    model.layers[0].base = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)  # frozen, as LoRA's
    model.layers[1].requires_grad_(False)  # a whole layer frozen
    return model


def _run(rank: int, world: int) -> tuple[dict[int, float], dict[int, float]]:
    model = _model()
    trained = [model.layers[0].weight, model.layers[0].bias, model.layers[2].weight, model.layers[2].bias]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    topology = Topology.from_groups({"dp": dist.group.WORLD}) if world > 1 else None
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1)], optimizer=optimizer,
                            topology=topology, timeout_s=60)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with metrics.step(1):
        model.layers[0](x).pow(2).sum().backward()  # layer 2 gets no gradient: AdamW skips it
        before = {i: [p.detach().double().clone() for p in model.layers[i].parameters() if p.requires_grad]
                  for i in (0, 2)}
        optimizer.step()
    want = {}
    for i, old in before.items():
        new = [p.detach().double() for p in model.layers[i].parameters() if p.requires_grad]
        update = sum(float((a - b).pow(2).sum()) for a, b in zip(new, old))
        want[i] = (update / sum(float(a.pow(2).sum()) for a in new)) ** 0.5
    got = {r.layer: r.value for r in metrics.last_records}
    metrics.close()
    return got, want


@pytest.mark.parametrize("world", [1, 2])
def test_update_ratio_leaves_frozen_tensors_out(world):
    for got, want in run_distributed(_run, world, timeout=120):
        assert want[2] == 0.0 and want[0] > 0.05
        assert got == {0: pytest.approx(want[0], rel=1e-6), 2: 0.0}  # no record for the frozen layer 1
