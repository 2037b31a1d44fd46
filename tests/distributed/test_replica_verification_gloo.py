"""Replica verification on real gloo ranks (world 2 and 4): a tensor placed Replica whose copies
differ is a PlacementError on every rank, at the moment it can first be seen (start-up for
parameters, the first due step for gradients, a later due step under ``always`` for a replica
that drifted), naming the tensor, the axis, the ranks and the fix; correct replicas (real DDP,
experts numbered globally) pass and are recorded as verified."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

Q = torch.arange(1.0, 13.0).reshape(4, 3)  # full q weight, split by rows across tp (Megatron column parallel)
O = torch.arange(1.0, 9.0).reshape(2, 4)    # full o weight, split by columns (row parallel)
NORM = torch.tensor([1.0, 2.0, 3.0])        # a true replica


def _attempt(build, steps=(), between=None) -> tuple:
    """``("error", step, message)`` where a PlacementError came from (0: construction), else
    ``("ok", records of the last step, verified)``."""
    try:
        metrics = build()
    except PlacementError as exc:
        return "error", 0, str(exc)
    try:
        for step in steps:
            if between is not None:
                between(metrics, step)
            with metrics.step(step):
                metrics.model.train_step()
    except PlacementError as exc:
        metrics.close()
        return "error", step, str(exc)
    records = {(r.metric, r.tensor): r.value for r in metrics.last_records}
    verified = {e.name: e.verified for e in metrics.manifest.entries}
    metrics.close()
    return "ok", records, verified


class _Model(torch.nn.Module):
    """Parameters from ``tensors``; a step puts ``grads`` (or the parameter itself) into .grad
    and runs SGD with lr 0 (parameters unchanged)."""

    def __init__(self, tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        for name, value in tensors.items():
            module = self.layers[0]
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(value.clone()))
        self.grads = grads or {}
        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.0)

    def train_step(self) -> None:
        for name, p in self.named_parameters():
            p.grad = self.grads.get(name.removeprefix("layers.0."), p.detach()).clone()
        self.optimizer.step()


def _metrics(model: _Model, topology: Topology, *names: str, mode: str = "first", **kwargs) -> TensorMetrics:
    return TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], optimizer=model.optimizer,
                         topology=topology, timeout_s=30, verify_replicas=mode, **kwargs)


def _world2(rank: int, world: int) -> dict:
    tp = Topology.from_groups({"tp": dist.group.WORLD})
    ep = Topology.from_groups({"ep": dist.group.WORLD})
    out = {}
    sharded = {"attn.q.weight": Q.chunk(2, 0)[rank], "attn.o.weight": O.chunk(2, 1)[rank], "attn_norm.weight": NORM}
    out["tp shards"] = _attempt(lambda: _metrics(_Model(sharded), tp, "global-param-l2"))
    out["tp shards, never"] = _attempt(lambda: _metrics(_Model(sharded), tp, "global-param-l2", mode="never"), (1,))
    out["tp shards, declared"] = _attempt(lambda: _metrics(
        _Model(sharded), tp, "global-param-l2", placements={"layers.0.attn.q.weight": {"tp": "S0"},
                                                             "layers.0.attn.o.weight": {"tp": "S1"}}), (1,))
    # Two experts per ep rank, numbered 0 and 1 on both (local numbering), different values.
    local = {f"moe.experts.{e}.up.weight": torch.full((2, 2), float(1 + 2 * rank + e)) for e in range(2)}
    out["local experts"] = _attempt(lambda: _metrics(_Model(local), ep, "layer-param-l2"))
    out["global experts"] = _attempt(lambda: _metrics(_Model(local), ep, "layer-param-l2", expert_offset=2 * rank),
                                     (1,))
    # Equal parameters, gradients never all-reduced: seen at the first due step of the gradients.
    unsynced = _Model({"attn_norm.weight": NORM}, grads={"attn_norm.weight": NORM * (rank + 1)})
    out["unsynced grads"] = _attempt(lambda: _metrics(unsynced, tp, "global-param-l2", "global-grad-l2"), (1, 2))
    out["unsynced grads, startup"] = _attempt(
        lambda: _metrics(_Model({"attn_norm.weight": NORM}, grads={"attn_norm.weight": NORM * (rank + 1)}), tp,
                         "global-grad-l2", mode="startup"), (1,))

    def drift(metrics: TensorMetrics, step: int) -> None:
        if step == 3 and rank == 1:
            with torch.no_grad():
                metrics.model.layers[0].attn_norm.weight[0] += 1e-6
    for mode in ("first", "always"):
        out[f"drift, {mode}"] = _attempt(
            lambda: _metrics(_Model({"attn_norm.weight": NORM}), tp, "global-param-l2", mode=mode), (1, 2, 3), drift)
    out["ddp"] = _ddp(rank)
    return out


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def _ddp(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in
                                            ("global-grad-l2", "global-param-l2", "layer-optimizer-state-rms")],
                            optimizer=optimizer, topology=Topology.from_groups({"dp": dist.group.WORLD}),
                            timeout_s=30, verify_replicas="always")
    for step in (1, 2):
        with metrics.step(step):
            model(torch.full((2, 3), float(rank + step))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    verified = {e.name: sorted(e.verified) for e in metrics.manifest.entries}
    metrics.close()
    return verified


def _world4(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    topology = Topology.from_mesh(mesh)
    tp = mesh.get_local_rank("tp")
    sharded = {"attn.q.weight": Q.chunk(2, 0)[tp], "attn_norm.weight": NORM}
    return {"tp shards": _attempt(lambda: _metrics(_Model(sharded), topology, "global-param-l2")),
            "declared": _attempt(lambda: _metrics(_Model(sharded), topology, "global-param-l2",
                                                  placements={"layers.0.attn.q.weight": {"tp": "S0"}}), (1,))}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_world2, 2, timeout=120)


def test_tp_shards_of_equal_shape_are_refused_at_start_up_on_every_rank(world2):
    messages = set()
    for out in world2:
        kind, step, message = out["tp shards"]
        assert (kind, step) == ("error", 0)
        assert "'layers.0.attn.q.weight' [param] inferred Replica on axis 'tp', local shape [2, 3], differs on " \
               "global ranks [0, 1]" in message
        assert "declare placements: {'layers.0.attn.q.weight': {'tp': 'S0'}}" in message
        assert "full shape [4, 3]" in message
        assert "{'layers.0.attn.o.weight': {'tp': 'S1'}}" in message and "full shape [2, 4]" in message
        assert "attn_norm" not in message  # the true replica passed
        messages.add(message)
    assert len(messages) == 1


def test_never_skips_the_check_and_declared_shards_are_measured_whole(world2):
    full = (Q.double().square().sum() + O.double().square().sum() + NORM.double().square().sum()).sqrt().item()
    for out in world2:
        kind, records, _ = out["tp shards, never"]
        assert kind == "ok" and records[("global-param-l2", None)] != pytest.approx(full)
        kind, records, verified = out["tp shards, declared"]
        assert kind == "ok" and records[("global-param-l2", None)] == pytest.approx(full, rel=1e-12)
        assert verified == {"layers.0.attn.o.weight": (), "layers.0.attn.q.weight": (),
                            "layers.0.attn_norm.weight": (("tp", "param"),)}


def test_locally_numbered_experts_are_refused_with_expert_offset_as_the_fix(world2):
    for out in world2:
        kind, step, message = out["local experts"]
        assert (kind, step) == ("error", 0)
        assert "'layers.0.moe.experts.0.up.weight' [param] inferred Replica on axis 'ep'" in message
        assert "'layers.0.moe.experts.1.up.weight'" in message
        assert "pass expert_offset=" in message
        kind, records, verified = out["global experts"]
        assert kind == "ok"
        assert records[("layer-param-l2", None)] == pytest.approx(2.0 * (1 + 4 + 9 + 16) ** 0.5, rel=1e-12)


def test_gradients_that_differ_are_refused_at_their_first_due_step(world2):
    for out in world2:
        kind, step, message = out["unsynced grads"]
        assert (kind, step) == ("error", 1)
        assert "differ across ranks (at step 1)" in message
        assert "'layers.0.attn_norm.weight' [grad] inferred Replica on axis 'tp'" in message
        assert "rank 0: sum=6 sumsq=14 " in message and "rank 1: sum=12 sumsq=56 " in message
        kind, _, verified = out["unsynced grads, startup"]  # only the parameters are checked, at start-up
        assert kind == "ok" and verified == {"layers.0.attn_norm.weight": (("tp", "param"),)}


def test_a_replica_that_drifts_later_is_caught_under_always_only(world2):
    for out in world2:
        kind, step, message = out["drift, always"]
        assert (kind, step) == ("error", 3)
        assert "'layers.0.attn_norm.weight' [param] inferred Replica on axis 'tp'" in message
        assert "differ across ranks (at step 3)" in message
        kind, _, verified = out["drift, first"]
        assert kind == "ok" and verified == {"layers.0.attn_norm.weight": (("tp", "param"),)}


def test_real_ddp_replicas_pass_and_are_recorded_verified(world2):
    for out in world2:
        verified = out["ddp"]
        expected = [("dp", "exp_avg"), ("dp", "exp_avg_sq"), ("dp", "grad"), ("dp", "param")]
        assert verified == {"layers.0.bias": expected, "layers.0.weight": expected}


def test_world4_refuses_on_every_rank_of_every_group():
    outcomes = run_distributed(_world4, 4, timeout=120)
    for out in outcomes:
        kind, step, message = out["tp shards"]
        assert (kind, step) == ("error", 0)
        assert "'layers.0.attn.q.weight' [param] inferred Replica on axis 'tp'" in message
        assert "global ranks [0, 1]" in message and "global ranks [2, 3]" in message
        kind, records, verified = out["declared"]
        assert kind == "ok"
        assert records[("global-param-l2", None)] == pytest.approx((Q.double().square().sum() + NORM.double().square().sum()).sqrt().item(),
                                                                   rel=1e-12)
        assert verified["layers.0.attn.q.weight"] == (("dp", "param"),)
        assert verified["layers.0.attn_norm.weight"] == (("dp", "param"), ("tp", "param"))
