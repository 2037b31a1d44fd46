"""DTensor parameters on a SUB-mesh with the other axes inferred (issue 16 item 1), on 4 gloo
ranks against the unsharded values: expert weights on the ``tp`` sub-mesh of an ``(ep, tp)``
mesh, pipeline stages holding tensor-parallel DTensors on ``mesh["tp"]`` with ``pp`` inferred,
FSDP2-style ``Shard(0)`` over ``mesh["fsdp"]`` with ``pp`` inferred; and the same with the owner
axis declared in ``placements:``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

METRICS = ("global-grad-l2", "layer-grad-l2", "global-param-l2", "tensor-grad-l2")


def _full(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameter and gradient of the tensor held by owner ``index``: distinct, exact in float32."""
    param = torch.arange(1.0, 9.0).reshape(4, 2) + 10 * index
    return param, torch.arange(1.0, 9.0).reshape(4, 2) * (index + 1) / 2


def _layout(case: str) -> tuple[tuple[str, str], str, str]:
    """Mesh dim names (owner axis, inner axis), the name template and the inner placement."""
    return {"ep": (("ep", "tp"), "layers.0.moe.experts.{i}.up.weight", "S0"),
            "pp": (("pp", "tp"), "layers.{i}.mlp.up.weight", "S0"),
            "fsdp": (("pp", "fsdp"), "layers.{i}.mlp.up.weight", "S0")}[case]


def _run(rank: int, world: int, case: str, declared: bool) -> dict:
    names, template, _ = _layout(case)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    owner_axis, inner = names
    owner = mesh.get_local_rank(owner_axis)
    inner_mesh = mesh[inner]
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    param, grad = _full(owner)
    holder = torch.nn.Module()
    weight = torch.nn.Parameter(distribute_tensor(param, inner_mesh, [Shard(0)]))
    weight.grad = distribute_tensor(grad, inner_mesh, [Shard(0)])
    # A tensor every owner-axis rank holds (replicated there, inferred), sharded on the inner axis.
    shared = torch.nn.Parameter(distribute_tensor(torch.full((2, 2), 3.0), inner_mesh, [Shard(0)]))
    shared.grad = distribute_tensor(torch.full((2, 2), 0.5), inner_mesh, [Replicate()]).redistribute(
        inner_mesh, [Shard(0)])
    offsets = {}
    if case == "ep":
        holder.moe = torch.nn.Module()
        holder.moe.experts = torch.nn.ModuleList([torch.nn.Module()])
        holder.moe.experts[0].up = torch.nn.Module()
        holder.moe.experts[0].up.weight = weight
        holder.attn_norm = torch.nn.Module()
        holder.attn_norm.weight = shared
        model.layers.append(holder)
        offsets["expert_offset"] = owner
    else:
        holder.mlp = torch.nn.Module()
        holder.mlp.up = torch.nn.Module()
        holder.mlp.up.weight = weight
        model.layers.append(holder)
        model.head = torch.nn.Module()
        model.head.weight = shared
        offsets["layer_offset"] = owner
    placements = None
    if declared:
        placements = {template.format(i=i): {owner_axis: f"O{i}"} for i in range(2)}
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in METRICS],
                            topology=Topology.from_mesh(mesh), placements=placements, timeout_s=30, **offsets)
    with metrics.step(1):
        pass
    out = {(r.metric, r.layer, r.tensor): r.value for r in metrics.last_records}
    metrics.close()
    return out


def _expected(case: str) -> dict:
    _, template, _ = _layout(case)
    grads = [_full(i)[1].double() for i in range(2)]
    params = [_full(i)[0].double() for i in range(2)]
    shared_grad, shared_param = torch.full((2, 2), 0.5).double(), torch.full((2, 2), 3.0).double()
    total = sum(g.square().sum() for g in grads) + shared_grad.square().sum()
    out = {("global-grad-l2", None, None): total.sqrt().item(),
           ("global-param-l2", None, None): (sum(p.square().sum() for p in params)
                                             + shared_param.square().sum()).sqrt().item()}
    for i in range(2):
        out[("tensor-grad-l2", 0 if case == "ep" else i, template.format(i=i))] = grads[i].norm().item()
    return out


CASES = [(case, declared) for case in ("ep", "pp", "fsdp") for declared in (False, True)]


def _all(rank: int, world: int) -> dict:
    return {key: _run(rank, world, *key) for key in CASES}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_distributed(_all, 4, timeout=240)


@pytest.mark.parametrize("case,declared", CASES, ids=[f"{c}-{'declared' if d else 'inferred'}" for c, d in CASES])
def test_submesh_dtensor_gradients_equal_the_unsharded_values(outcomes, case, declared):
    expected = _expected(case)
    for by_case in outcomes:
        out = by_case[(case, declared)]
        for key, value in expected.items():
            assert out[key] == pytest.approx(value, rel=1e-12), key
