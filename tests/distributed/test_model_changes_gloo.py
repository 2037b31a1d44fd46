"""A model that changes after start-up is re-planned: a layer appended and given to the optimizer
with ``add_param_group`` before step 3, or a frozen layer unfrozen then. The step that first sees
the change (3) was read with the old plan: its parameter-side metrics write no record, on every
rank, with the reason (the failure agreement); the change rides on that agreement, and at the next
due step (4) every rank re-plans and the records equal float64 references over the model as it
is. Before, the new parameters were left out of every record without a word (global-grad-l2
read the old layers' norm; the new layer had no update ratio). Two data-parallel replicas fed
the same batch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-update-ratio")


def _both(rank: int, world: int) -> dict:
    return {change: _run(rank, world, change) for change in ("append", "unfreeze")}


def _run(rank: int, world: int, change: str) -> list:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    if change == "unfreeze":
        model.layers[1].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    topology = Topology.from_groups({"dp": dist.group.WORLD}) if world > 1 else None
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in METRICS], optimizer=optimizer,
                            topology=topology, timeout_s=60)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tmetrics").addHandler(handler)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = []
    for step in range(1, 5):
        if step == 3:
            if change == "append":
                model.layers.append(torch.nn.Linear(8, 8))
                optimizer.add_param_group({"params": list(model.layers[2].parameters())})
            else:
                model.layers[1].requires_grad_(True)
                optimizer.add_param_group({"params": list(model.layers[1].parameters())})
        with metrics.step(step):
            y = x
            for layer in model.layers:
                y = torch.tanh(layer(y))
            y.pow(2).sum().backward()
            trained = [i for i, layer in enumerate(model.layers) if layer.weight.requires_grad]
            grads = {i: sum(float(p.grad.double().pow(2).sum()) for p in model.layers[i].parameters()) for i in trained}
            before = {i: [p.detach().double().clone() for p in model.layers[i].parameters()] for i in trained}
            optimizer.step()
            optimizer.zero_grad()
        ratios = {}
        for i, old in before.items():
            new = [p.detach().double() for p in model.layers[i].parameters()]
            ratios[i] = (sum(float((a - b).pow(2).sum()) for a, b in zip(new, old))
                         / sum(float(a.pow(2).sum()) for a in new)) ** 0.5
        want = {("global-grad-l2", None): sum(grads.values()) ** 0.5,
                **{("layer-grad-l2", i): grads.get(i, 0.0) ** 0.5 for i in range(len(model.layers))},  # frozen: 0
                **{("layer-update-ratio", i): v for i, v in ratios.items()}}
        out.append(({(r.metric, r.layer): r.value for r in metrics.last_records}, want))
    metrics.close()
    logging.getLogger("tmetrics").removeHandler(handler)
    return [out, warnings if rank == 0 else None]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """One 2-rank run for both cases (spawning ranks is most of the cost)."""
    return run_distributed(_both, 2, timeout=150)


@pytest.mark.parametrize("change", ["append", "unfreeze"])
def test_a_changed_model_is_replanned_at_the_next_due_step(change, two_ranks):
    ranks = [rank[change] for rank in two_ranks]
    for steps, _ in ranks:
        for step, (got, want) in enumerate(steps, start=1):
            if step == 3:
                assert got == {}, got  # read with the old plan: left out on every rank, with the reason
                continue
            assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}, step
        assert len(steps[3][1]) == len(steps[0][1]) + (2 if change == "append" else 1)  # the new layer counts
    warnings = ranks[0][1]
    assert any("skipped at step 3" in w and "parameters changed since tmetrics planned them" in w for w in warnings)
    assert any("re-planned at step 4" in w for w in warnings)
