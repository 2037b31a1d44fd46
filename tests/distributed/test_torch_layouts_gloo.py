"""Every parameter and gradient metric of the catalogue on the DTensor layouts torch itself makes
(4 gloo ranks), against float64 references on the full tensors (``full_tensor()``, which torch
reassembles from its own placements):

- FSDP2 over TP on a 2x2 mesh: ``parallelize_module`` colwise/rowwise, then ``fully_shard``, so
  colwise weights and biases are ``_StridedShard`` on ``fsdp`` and ``Shard(0)`` on ``tp``;
- HSDP on a 2x2 mesh (``Replicate``, ``Shard(0)``);
- HSDP + TP on a 2x1x2 mesh (``Replicate``, ``_StridedShard``, ``Shard``);
- parameters and gradients that are ``Partial`` of each reduce op (sum, avg, max, min) on 4 ranks;

(parameter metrics read the parameters before the optimizer step, the update ratio after it)

with uneven sizes (10 and 2 rows over 2x2 ranks: 5 rows per TP rank split 3 + 2 by FSDP, one
row split 1 + 0, an empty shard). A placement
tmetrics does not know (``_MaskPartial``) is a ``PlacementError`` naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.metrics import test_norms, test_updates
from tests.metrics.cases import Case, SiteCase, assert_results
from tests.metrics.test_sketches import reference_counts

NAMES = [spec.name for spec in test_norms.SPECS + test_updates.SPECS] + [
    "tensor-grad-l2", "layer-param-histogram", "layer-grad-histogram"]
LAYOUTS = ["fsdp-tp", "hsdp", "hsdp-tp", "partial"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = torch.nn.RMSNorm(6)
        self.attention = torch.nn.Module()
        self.attention.wq = torch.nn.Linear(6, 10)
        self.attention.wo = torch.nn.Linear(10, 6, bias=False)
        self.feed_forward = torch.nn.Module()
        self.feed_forward.w1 = torch.nn.Linear(6, 2, bias=False)
        self.feed_forward.w2 = torch.nn.Linear(2, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention.wo(torch.tanh(self.attention.wq(self.attention_norm(x))))
        return x + self.feed_forward.w2(torch.relu(self.feed_forward.w1(x)))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def _tensor_parallel(block: torch.nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, mesh, {"attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                                     "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})


def _build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    torch.manual_seed(0)
    model = _Model()
    if layout == "fsdp-tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        for block in model.layers.values():
            _tensor_parallel(block, mesh["tp"])
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp-tp":
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        for block in model.layers.values():
            _tensor_parallel(block, mesh["tp"])
            fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        rank = mesh.get_local_rank("tp")
        g = torch.Generator().manual_seed(rank + 1)
        ops = {"attention.wq.weight": "sum", "attention.wq.bias": "avg", "attention.wo.weight": "max",
               "feed_forward.w1.weight": "min"}
        for block in model.layers.values():
            for name, op in ops.items():
                owner, leaf = name.rsplit(".", 1)
                module = block.get_submodule(owner)
                local = torch.randn(getattr(module, leaf).shape, generator=g)
                setattr(module, leaf, torch.nn.Parameter(DTensor.from_local(local, mesh, [Partial(op)])))
    return model, mesh


class _Hold(torch.optim.Optimizer):
    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def _partial_grads(model: torch.nn.Module) -> None:
    """Gradients placed as their parameters (Partial of each op), plain ones for plain ones."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(torch.distributed.get_rank() + 11)
    for p in model.parameters():
        local = torch.randn(p.to_local().shape if isinstance(p, DTensor) else p.shape, generator=g)
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements)
        else:
            p.grad = local * 0 + torch.arange(local.numel()).reshape(local.shape) * 0.1


def _full(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def _run_layout(layout: str, only: tuple[str, ...] | None = None) -> tuple[dict, dict, list]:
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.metrics.sketches import LogBins
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    model, mesh = _build(layout)
    # A step on Partial(max) parameters has no sharding rule: they are held still (update 0).
    optimizer = (_Hold if layout == "partial" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    names = [n for n in (only or NAMES) if layout != "partial" or n != "layer-optimizer-state-rms"]
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], optimizer=optimizer,
                            topology=Topology.from_mesh(mesh), timeout_s=60)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    with metrics.step(1):
        before = {n: _full(p) for n, p in model.named_parameters()}
        if layout == "partial":
            _partial_grads(model)
        else:
            model(x).pow(2).sum().backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        after = {n: _full(p) for n, p in model.named_parameters()}
        optimizer.zero_grad()
    state = {n: {k: _full(optimizer.state[p][k]) for k in ("exp_avg", "exp_avg_sq")}
             for n, p in model.named_parameters() if p in optimizer.state}
    got: dict = {}
    for r in metrics.last_records:
        got.setdefault(r.metric, []).append(((r.layer, r.expert, r.tensor, r.stat), r.value))
    placements = sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()})
    metrics_entries = metrics.manifest.entries
    metrics.close()
    sites, originals = [], []
    for e in metrics_entries:
        kinds = {"param": before[e.original], "update": after[e.original] - before[e.original]}
        if e.original in grads:
            kinds["grad"] = grads[e.original]
        kinds.update(state.get(e.original, {}))
        for kind, full in kinds.items():
            sites.append(SiteCase(e.name, kind, full, (), layer=e.layer, family=e.family))
            originals.append(e.original)
    stepped = [SiteCase(sc.name, sc.kind, after[original], (), layer=sc.layer) if sc.kind == "param" else sc
               for sc, original in zip(sites, originals)]
    want = test_norms.reference(Case((), (), sites)) | test_updates.reference(Case((), (), stepped))
    want["tensor-grad-l2"] = [((sc.layer, None, sc.name, None), sc.full.double().norm().item())
                              for sc in sites if sc.kind == "grad"]
    for kind in ("param", "grad"):
        layers = sorted({sc.layer for sc in sites if sc.kind == kind})
        want[f"layer-{kind}-histogram"] = [
            ((layer, None, None, None), reference_counts(torch.cat([sc.full.reshape(-1) for sc in sites
                                                                    if sc.kind == kind and sc.layer == layer]),
                                                         LogBins())) for layer in layers]
    return got, {k: v for k, v in want.items() if k in names}, placements


def _unknown_placement() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _MaskPartial

    from tmetrics_core.errors import PlacementError
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = torch.nn.Module()
    model.odd = torch.nn.Parameter(DTensor.from_local(torch.zeros(3), mesh, [_MaskPartial()]))
    try:
        TensorMetrics(model, metrics=[(build_metric("global-param-l2"), 1)], topology=Topology.from_mesh(mesh))
    except PlacementError as exc:
        return str(exc)
    return "no error"


def _rank(rank, world):
    return {layout: _run_layout(layout) for layout in LAYOUTS}, _unknown_placement()


def test_every_param_metric_on_torch_layouts_equals_full_tensor_reference():
    for by_layout, unknown in run_distributed(_rank, 4, timeout=240):
        for layout, (got, want, placements) in by_layout.items():
            if layout in ("fsdp-tp", "hsdp-tp"):
                assert any("_StridedShard" in p for p in placements), placements
            try:
                assert_results(got, want, rtol=1e-6)
            except AssertionError as exc:
                raise AssertionError(f"layout {layout} {placements}: {exc}") from None
        assert "'odd'" in unknown and "_MaskPartial" in unknown, unknown


def test_strided_shard_runs_follow_torch():
    from torch.distributed.tensor.placement_types import _StridedShard

    from tmetrics_core.placements import StridedShard

    for size, parts, factor in ((9, 4, 2), (8, 2, 2), (5, 2, 2), (3, 2, 2), (7, 3, 3), (0, 2, 2)):
        rows = torch.arange(size)
        pieces, _ = _StridedShard(0, split_factor=factor)._split_tensor(rows, parts, with_padding=False)
        for index, piece in enumerate(pieces):
            runs = StridedShard(0, split_factor=factor).runs(size, parts, index)
            held = [i for start, length in runs for i in range(start, start + length)]
            assert held == piece.tolist(), (size, parts, factor, index)


@pytest.mark.parametrize("text", ["S0/2", "StridedShard(dim=1, split_factor=4)"])
def test_strided_shard_round_trips(text):
    from tmetrics_core.placements import StridedShard, parse_placement

    placement = parse_placement(text)
    assert isinstance(placement, StridedShard) and parse_placement(repr(placement)) == placement
    assert parse_placement(str(placement)) == placement


PLANNED = ("global-grad-l2", "layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio",
           "layer-param-rms", "tensor-grad-l2", "layer-optimizer-state-rms")
"""Metrics prepared from the parameter program's rows (no histogram)."""


def _planned_rank(rank, world):
    from tmetrics_core.sources.param_program import PhaseProgram

    ran = {"pre": 0, "post": 0}
    run = PhaseProgram.run

    def counted(self, *args, **kwargs):
        out = run(self, *args, **kwargs)  # counted when it returned
        ran[self.name] += 1
        return out
    PhaseProgram.run = counted
    try:
        return {layout: (_run_layout(layout, PLANNED), dict(ran)) for layout in ("fsdp-tp", "hsdp")}
    finally:
        PhaseProgram.run = run


def test_dtensor_parameters_take_the_program_and_equal_full_tensor_reference():
    """FSDP2 x TP and HSDP parameters (DTensors, _StridedShard included) are read by the parameter
    program as their local shards: each layout's due step runs its pre and post phases, and every
    record equals the full-tensor reference."""
    for by_layout in run_distributed(_planned_rank, 4, timeout=240):
        before = {"pre": 0, "post": 0}
        for layout, ((got, want, placements), ran) in by_layout.items():
            assert ran["pre"] == before["pre"] + 1 and ran["post"] == before["post"] + 1, (layout, ran)
            before = ran
            assert set(got) == set(PLANNED)
            try:
                assert_results(got, want, rtol=1e-6)
            except AssertionError as exc:
                raise AssertionError(f"layout {layout} {placements}: {exc}") from None
