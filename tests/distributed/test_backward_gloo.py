"""Cotangent metrics on 2 gloo ranks (4 for FSDP2 over TP, 2 x 2) equal float64 autograd of the same global batch in one
process (rel 1e-5): DDP and FSDP2 (each rank half the batch, 2 micro-batches: the averaging
divided out), tensor parallelism with and without sequence parallelism (the residual stream a
plain tensor holding all tokens, or each rank's half of the sequence); each site observed
once per micro-batch. And the Partial cotangent of a replicated DTensor activation consumed
by a column-parallel linear: reduced before its statistics, not summed as parts."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from tests.backward_model import BATCH, L, METRICS, Net, assert_close, batch, expected, loss_of, observed
from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

MICRO = 2


def _parallelize_tp(model: Net, mesh, sequence: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)
    seq = Shard(1) if sequence else Replicate()
    if sequence:
        parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)})
    parallelize_module(model, mesh, {"head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())})
    for block in model.layers:
        plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=seq)}
        if sequence:
            plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, plan)


@contextlib.contextmanager
def _counted() -> Iterator[dict[str, int]]:
    """Cotangent observations by kind, in this rank's process, while the block runs."""
    from tmetrics_core.sources.tokens import TokenObserver

    counts: dict[str, int] = {}
    original = TokenObserver.cotangent

    def spy(self, module, name, grad, *, kind, shard_dim):
        counts[kind] = counts.get(kind, 0) + 1
        return original(self, module, name, grad, kind=kind, shard_dim=shard_dim)
    TokenObserver.cotangent = spy  # type: ignore[method-assign]  # this rank's process only
    try:
        yield counts
    finally:
        TokenObserver.cotangent = original  # type: ignore[method-assign]


def _run(rank: int, world: int, layout: str) -> tuple[dict, dict[str, int]]:
    with _counted() as counts:
        return _measure(rank, world, layout), counts


def _measure(rank: int, world: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    axis = "tp" if layout.startswith("tp") else "dp"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    model: torch.nn.Module = Net()
    if layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        _parallelize_tp(model, mesh, sequence=layout == "tp-sp")
    return _step_records(model, mesh, rank if axis == "dp" else 0, world if axis == "dp" else 1)


def _step_records(model: torch.nn.Module, mesh, part: int, parts: int) -> dict:
    """One step of ``MICRO`` micro-batches over this rank's ``part`` of ``parts`` of the global
    batch, every cotangent metric due; the records as :func:`observed` keys them."""
    tm = TensorMetrics(model, metrics=[(build_metric(n, modules=["layers.*.mlp"] if "activation" in n else None), 1)
                                       for n in METRICS], topology=Topology.from_mesh(mesh), timeout_s=60)
    tokens, targets = (t[part * BATCH // parts:(part + 1) * BATCH // parts] for t in batch(1))
    n = tokens.shape[0]
    with tm.step(1):
        for k in range(MICRO):
            rows = slice(k * n // MICRO, (k + 1) * n // MICRO)
            (loss_of(model(tokens[rows]), targets[rows]) / MICRO).backward()
    assert tm.failures == []
    got = observed(tm.last_records)
    tm.close()
    return got


LAYOUTS = ("ddp", "fsdp", "tp", "tp-sp")


def _layouts(rank: int, world: int) -> dict:
    """Every layout in one world (one spawn: start-up dominates these runs)."""
    return {layout: _run(rank, world, layout) for layout in LAYOUTS} | {"partial": _partial(rank, world)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_layouts, 2, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cotangents_equal_one_process(ranks, layout):
    want = expected(1)
    for rank in ranks:
        got, counts = rank[layout]
        assert_close(got, want)
        assert counts == {"residual_grad": MICRO * L, "residual_input_grad": MICRO * L,
                          "activation_grad": MICRO * L, "logits_grad": MICRO}


T, DIN, DOUT = 5, 6, 4


def _partial_case() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(T, DIN, generator=g) * 3, torch.randn(DOUT, DIN, generator=g) * 2


def _partial(rank: int, world: int) -> tuple[float, float, dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tmetrics_core.metrics.norms import L2Norm
    from tmetrics_core.observe import observe

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Linear(1, 1)])
    tm = TensorMetrics(holder, metrics=[(L2Norm(name="l2", source_kinds=["activation_grad"], scope="tensor"), 1)],
                       topology=Topology.from_mesh(mesh), timeout_s=60)
    x_full, w_full = _partial_case()
    x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()  # column-parallel: output features split
    seen = {}
    with tm.step(1):
        observe(holder.layers[0], "x", x, kind="activation", grad=True)
        y = x @ w.t()  # Shard(1)
        x.register_hook(lambda g: seen.update(placements=g.placements))
        (y * y).sum().backward()  # the cotangent of x reaches it as Partial(sum)
    naive = float(x.grad.to_local().double().square().sum())  # this rank's part; summed below as parts
    (record,) = tm.last_records
    tm.close()
    return record.value ** 2, naive, {"partial": str(seen["placements"])}


def test_partial_cotangent_is_reduced_before_its_statistics(ranks):
    x, w = (t.double() for t in _partial_case())
    truth = (2 * (x @ w.t()) @ w).square().sum().item()  # d/dx sum((x W^T)^2) = 2 (x W^T) W
    results = [rank["partial"] for rank in ranks]
    naive = sum(r[1] for r in results)  # each rank's local part squared and summed: the parts' error
    for sumsq, _, placements in results:
        assert "Partial" in placements["partial"]
        assert sumsq == pytest.approx(truth, rel=1e-5)
    assert abs(naive / truth - 1) > 0.05  # the parts' sum of squares is not the truth


def _fsdp_tp(rank: int, world: int) -> tuple[dict, dict[str, int]]:
    """FSDP2 over dp x tensor parallelism over tp on a 2 x 2 mesh: each dp rank half the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Net()
    _parallelize_tp(model, mesh["tp"], sequence=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with _counted() as counts:
        return _step_records(model, mesh, mesh["dp"].get_local_rank(), 2), counts


def test_fsdp2_over_tp_2x2_equals_one_process():
    want = expected(1)
    for got, counts in run_distributed(_fsdp_tp, 4, timeout=300):
        assert_close(got, want)
        assert counts == {"residual_grad": MICRO * L, "residual_input_grad": MICRO * L,
                          "activation_grad": MICRO * L, "logits_grad": MICRO}
