"""Stacked experts (transformers 5.x layout ``[E, ...]``) as DTensors sharded Shard(0) on the
expert dim, 3 experts: over 2 gloo ranks (uneven: rank 0 holds experts 0 and 1, rank 1 expert 2)
and over a 2 x 2 mesh sharding the expert dim on both axes (nested pieces, one empty),
against float64 hand references of the unsharded tensors: per-expert parameter and gradient L2,
per-layer and global gradient L2 (every element once), update ratio (the snapshot's slices)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

EXPERTS, HIDDEN, INTER, LAYERS = 3, 6, 4, 2
NAMES = ("expert-param-l2", "expert-grad-l2", "layer-grad-l2", "global-grad-l2", "layer-update-ratio",
         "tensor-grad-l2")


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN))
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER))


class _Moe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = (getattr(self.experts, n) for n in ("gate_up_proj", "down_proj"))
        if hasattr(gate_up, "full_tensor"):
            gate_up, down = gate_up.full_tensor(), down.full_tensor()
        weights = self.gate(x).softmax(-1)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            g, u = (x @ gate_up[e].T).chunk(2, dim=-1)
            out = out + weights[:, e:e + 1] * ((torch.nn.functional.silu(g) * u) @ down[e].T)
        return out


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Moe()


class _Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))


class Model(torch.nn.Module):
    """Named as Hugging Face names Mixtral-style blocks (``model.layers.{i}.mlp.experts...``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.model = _Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = x + layer.mlp(x)
        return x


def _stacked(model: Model) -> list[tuple[int, str, torch.nn.Parameter]]:
    return [(i, n, getattr(layer.mlp.experts, n)) for i, layer in enumerate(model.model.layers)
            for n in ("gate_up_proj", "down_proj")]


def _expected(tensors: dict[tuple[int, str], torch.Tensor]) -> dict[tuple[int, int], float]:
    """Per (layer, expert): float64 L2 over that expert's gate, up and down slices."""
    return {(layer, e): math.sqrt(sum(float(tensors[(layer, n)][e].double().pow(2).sum())
                                      for n in ("gate_up_proj", "down_proj")))
            for layer in range(LAYERS) for e in range(EXPERTS)}


def _run(rank: int, world: int, shape: tuple[int, ...], axes: tuple[str, ...]) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
    model = Model()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            stored = getattr(experts, name).detach()
            placed = distribute_tensor(stored, mesh, [Shard(0)] * len(axes))
            setattr(experts, name, torch.nn.Parameter(placed))
    reference = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], optimizer=optimizer,
                            topology=Topology.from_mesh(mesh), timeout_s=30)
    held = sorted(e.name for e in metrics.manifest.entries if e.name in metrics.manifest.local
                  and e.name.startswith("layers.0.moe.experts."))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))
    with metrics.step(1):
        model(x).square().sum().backward()
        optimizer.step()
    reference(x).square().sum().backward()
    grads = {(i, n): p.grad for i, n, p in _stacked(reference)}
    before = {(i, n): p.detach().clone() for i, n, p in _stacked(reference)}
    layer_before = [[p.detach().double().clone() for p in layer.parameters()] for layer in reference.model.layers]
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    ratio = []
    for layer, then in zip(reference.model.layers, layer_before):
        now = [p.detach().double() for p in layer.parameters()]
        ratio.append(math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(now, then)))
                     / math.sqrt(sum(float(a.pow(2).sum()) for a in now)))
    records = {(r.metric, r.layer, r.expert, r.tensor): r.value for r in metrics.last_records}
    metrics.close()
    return {"records": records, "held": held, "grad": _expected(grads), "param": _expected(before),
            "global": math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters())),
            "layer": [math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in layer.parameters()))
                      for layer in reference.model.layers],
            "ratio": ratio, "up": float(grads[(1, "gate_up_proj")][2, INTER:].double().norm())}


@pytest.mark.parametrize("shape, axes, holds", [
    ((2,), ("ep",), [(0, 1), (2,)]),
    # nested: dp cuts experts [0, 2) | [2, 3), then ep cuts each piece; rank 3's piece is empty
    ((2, 2), ("dp", "ep"), [(0,), (1,), (2,), ()]),
], ids=["ep2", "dp2xep2"])
def test_expert_sharded_stacked_tensors_match_the_unsharded_reference(shape, axes, holds) -> None:
    outcomes = run_distributed(_run, math.prod(shape), shape, axes, timeout=300)
    for rank, experts in enumerate(holds):
        assert outcomes[rank]["held"] == [f"layers.0.moe.experts.{e}.{p}.weight" for e in experts
                                          for p in ("down", "gate", "up")]
    out = outcomes[0]
    records = out["records"]
    assert {k for k in records if k[0] == "expert-grad-l2"} == {
        ("expert-grad-l2", layer, e, None) for layer in range(LAYERS) for e in range(EXPERTS)}
    for (layer, e), want in out["grad"].items():
        assert math.isclose(records[("expert-grad-l2", layer, e, None)], want, rel_tol=1e-6)
        assert math.isclose(records[("expert-param-l2", layer, e, None)], out["param"][(layer, e)], rel_tol=1e-6)
    assert math.isclose(records[("global-grad-l2", None, None, None)], out["global"], rel_tol=1e-6)
    for layer in range(LAYERS):
        assert math.isclose(records[("layer-grad-l2", layer, None, None)], out["layer"][layer], rel_tol=1e-6)
        assert math.isclose(records[("layer-update-ratio", layer, None, None)], out["ratio"][layer], rel_tol=1e-5)
    # tensor scope: one value per slice, named as transformers 4.x names its per-expert tensors
    up = out["up"]
    assert math.isclose(records[("tensor-grad-l2", 1, 2, "layers.1.moe.experts.2.up.weight")], up, rel_tol=1e-6)
    assert all(o["records"] == records for o in outcomes)
