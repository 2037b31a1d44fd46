"""Fault scenarios that run on real gloo ranks (spawned by ``run_distributed``), and the same
training on one process for reference.

Module-level functions only, so spawned ranks can import them. Records come back as plain
dicts ``{step: {(metric, layer, expert, tensor, stat): value}}``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tmetrics_core.topology import Axis, Topology
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees as DemoTopology
from tmetrics_core.errors import PlanMismatchError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.norms import L2Norm
from tmetrics_core.observe import observe
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = [
    "NONFINITE_INJECTED",
    "TINY",
    "UNEVEN",
    "RaisesOnRank1",
    "four_rank_uneven",
    "train",
    "two_rank_faults",
]

TINY: dict[str, Any] = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 12, "n_experts": 4, "top_k": 2,
                        "dense_layers": (1,), "seq_len": 16}
UNEVEN: dict[str, Any] = {**TINY, "d_ff": 9, "n_experts": 3}
BATCH = 8
METRICS = {
    "metrics": ["global-grad-l2", "layer-grad-l2", "layer-grad-absmax", "layer-grad-nonfinite",
                "layer-param-l2", "layer-expert-tokens", "layer-router-logits-l2"],
}

NONFINITE_INJECTED = {
    # step 2: (rank, tensor, flat index, value) on each rank's LOCAL shard
    2: [(0, "layers.0.attn.q.weight", 0, math.nan), (0, "layers.0.attn.q.weight", 1, math.inf),
        (1, "layers.0.attn.q.weight", 0, -math.inf), (1, "layers.1.mlp.up.weight", 0, math.nan),
        (1, "layers.1.mlp.up.weight", 1, math.nan), (1, "layers.1.mlp.up.weight", 2, math.nan)],
}
"""Non-finite values written into gradients: per layer at step 2, layer 0 has one NaN, one +Inf
and one -Inf; layer 1 three NaN (on different ranks' shards of FSDP2)."""

Records = dict[int, dict[tuple[Any, ...], Any]]


def _batch(step: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(100 + step))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def train(topology: dict[str, Any], config: dict[str, Any], steps: int, *, run_dir: str,
          inject: dict[int, list[tuple[int, str, int, float]]] | None = None,
          metric_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train the demo model ``steps`` steps under ``topology`` with TensorMetrics from a config
    (jsonl sink on the logging rank); gradients are read before the optimizer as the demo loop
    does, and a step whose gradients are not finite skips the optimizer (they are still measured).
    Returns the records of every step, the failures and, on the logging rank, the hub report."""
    torch.manual_seed(0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    parallel = parallelize(ModelConfig(**config), DemoTopology(**topology), seed=3, batch_size=BATCH)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-2)
    cfg = {**(metric_config or METRICS), "sinks": {"jsonl": {}}, "distributed": {"collective_timeout_s": 30}}
    metrics = TensorMetrics.from_config(cfg, model=parallel.model, optimizer=optimizer, mesh=parallel.mesh,
                                        run_dir=run_dir)
    params = dict(parallel.model.named_parameters())
    records: Records = {}
    for step in range(1, steps + 1):
        with metrics.step(step):
            parallel.forward_backward(_batch(step, config["seq_len"]))
            with torch.no_grad():
                for where, name, index, value in (inject or {}).get(step, ()):
                    if where == rank and name in params:
                        _local(params[name].grad).view(-1)[index] = value
            metrics.observe_gradients()
            if math.isfinite(parallel.clip_grad_norm_(None)):
                optimizer.step()
            optimizer.zero_grad()
        records[step] = {(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records}
    report = metrics.close()
    return {"records": records, "failures": [(f.metric, f.ranks) for f in metrics.failures],
            "report": report["jsonl"] if report is not None and report.sinks else None,
            "empty_shards": sorted(n for n, p in params.items() if _local(p.detach()).numel() == 0)}


class RaisesOnRank1(L2Norm):
    """``layer-grad-l2`` that raises on global rank 1 while :attr:`failing` is true."""

    failing = False
    planned = False  # its prepare does more than compute the statistics: no planned path may skip it

    def prepare(self, sites, tensors, topology, memo):
        if topology.global_rank == 1 and self.failing:
            raise ValueError("injected failure on rank 1")
        return super().prepare(sites, tensors, topology, memo)


def _dp_world(rank: int, world: int) -> Topology:
    return Topology([Axis("dp", world, rank, dist.group.WORLD, tuple(range(world)))], global_rank=rank,
                    world_size=world)


def _replicated_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model


def _backward(model: torch.nn.Module, scale: float = 1.0) -> None:
    """The same gradients on every rank: the model is a data-parallel replica (replica
    verification checks that it is)."""
    model.zero_grad()
    model(torch.ones(3, 4) * scale).sum().backward()


def _metric_raising_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Steps 1-5; the flaky metric raises on rank 1 at steps 2 and 3 only."""
    captured: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: captured.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tmetrics").addHandler(handler)
    model = _replicated_model()
    flaky = RaisesOnRank1(name="flaky-grad-l2", source_kinds=["grad"])
    good = L2Norm(name="good-grad-l2", source_kinds=["grad"])
    metrics = TensorMetrics(model, metrics=[(flaky, 1), (good, 1)], topology=_dp_world(rank, world), timeout_s=20)
    names = {}
    for step in range(1, 6):
        flaky.failing = step in (2, 3)
        with metrics.step(step):
            _backward(model)
            metrics.observe_gradients()
        names[step] = sorted({r.metric for r in metrics.last_records})
    metrics.close()
    logging.getLogger("tmetrics").removeHandler(handler)
    return {"names": names, "failures": [(f.metric, f.ranks) for f in metrics.failures],
            "warnings": [m for m in captured if "skipped" in m]}


def _asymmetric_plan(rank: int, world: int) -> dict[str, Any]:
    """FSDP2, and a rank-dependent config: rank 1 selects fewer sharded tensors than rank 0, so
    its collective plan over ``dp`` differs. Both ranks must raise, fast."""
    parallel = parallelize(ModelConfig(**TINY), DemoTopology(dp=2, fsdp=True), seed=3, batch_size=BATCH)
    metric = L2Norm(name="layer-grad-l2", source_kinds=["grad"], scope="layer",
                    select="layers.0.*" if rank else "layers.*")
    metrics = TensorMetrics(parallel.model, metrics=[(metric, 1)], topology=Topology.from_mesh(parallel.mesh),
                            timeout_s=20)
    start = time.monotonic()
    try:
        with metrics.step(1):
            parallel.forward_backward(_batch(1, TINY["seq_len"]))
            metrics.observe_gradients()
    except PlanMismatchError as exc:
        return {"error": type(exc).__name__, "metric": exc.metric, "axis": exc.axis, "ranks": exc.ranks,
                "message": str(exc), "seconds": time.monotonic() - start}
    finally:
        metrics.close()
    return {"error": None}


def _absent_rank(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Rank 1 never enters the step; rank 0's step must fail within ``timeout_s`` (plus slack)."""
    model = _replicated_model()
    metrics = TensorMetrics(model, metrics=[(L2Norm(name="global-grad-l2", source_kinds=["grad"]), 1)],
                            topology=_dp_world(rank, world), timeout_s=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 4)  # alive and connected, just never joining
        return {"error": None}
    start = time.monotonic()
    try:
        with metrics.step(1):
            _backward(model)
            metrics.observe_gradients()
    except Exception as exc:  # noqa: BLE001 - the test checks the type and the time
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 4)


class _TensorParallelRouter(torch.nn.Module):
    """One MoE layer (4 experts) whose router outputs are split by expert over ``tp`` (each rank
    observes its half of the logits, and of the top-2 ids, with ``shard_dim=1``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(4, 4, bias=False)
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        logits = self.router(x)
        observe(self, "router_logits", logits[:, 2 * rank:2 * rank + 2], kind="router_logits", shard_dim=1)
        observe(self, "expert_indices", logits.topk(2, dim=-1).indices[:, rank:rank + 1], kind="router_topk",
                shard_dim=1)
        return logits


class _RouterLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].moe = _TensorParallelRouter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0].moe(x)


def _router_split_by_expert(rank: int, world: int) -> dict[str, Any]:
    """Expert counts need each token's whole top-k row; here the ids are split over ``tp``. The
    metric is skipped on every rank with the placement named; the logits norm (a sum over the
    split) is computed as usual."""
    captured: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: captured.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tmetrics").addHandler(handler)
    model = _RouterLayers()
    topology = Topology([Axis("tp", world, rank, dist.group.WORLD, tuple(range(world)))], global_rank=rank,
                        world_size=world)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-expert-tokens"), 1),
                                            (build_metric("layer-router-logits-l2"), 1)], topology=topology,
                            timeout_s=20)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with metrics.step(1):
        full_logits = model(x)
    metrics.close()
    logging.getLogger("tmetrics").removeHandler(handler)
    return {"records": {(r.metric, r.layer): r.value for r in metrics.last_records},
            "failures": [(f.metric, f.ranks, f.error) for f in metrics.failures],
            "reference_l2": float(full_logits.detach().double().norm()), "warnings": captured}


def two_rank_faults(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every two-rank scenario in one job (spawning ranks costs seconds); the absent rank last,
    since a timed-out collective leaves the group unusable."""
    out: dict[str, Any] = {}
    out["nonfinite"] = train({"dp": 2, "fsdp": True}, TINY, 3, run_dir=str(Path(root) / "nonfinite"),
                             inject=NONFINITE_INJECTED)
    out["pipeline"] = train({"pp": 2}, TINY, 2, run_dir=str(Path(root) / "pipeline"))
    out["raising"] = _metric_raising_on_one_rank(rank, world)
    out["asymmetric"] = _asymmetric_plan(rank, world)
    out["router_split"] = _router_split_by_expert(rank, world)
    out["absent"] = _absent_rank(rank, world, timeout_s=3.0)
    return out


def four_rank_uneven(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP2 over 4 ranks on tensors of 3 rows (router weight, 3 experts): one empty shard each."""
    return train({"dp": 4, "fsdp": True}, UNEVEN, 2, run_dir=str(Path(root) / "uneven"))
