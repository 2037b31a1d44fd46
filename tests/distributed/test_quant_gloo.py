"""Low-precision statistics on real gloo ranks: the sharded cases of tests/metrics/test_quant.py
at world 2 and 4 (row shards, feature shards, data-split tokens) against the unsharded
reference; and a torchao float8 training step under FSDP2 on CPU, whose weight casts (torchao's
own, amax over every shard) match tmetrics' fp8-tensorwise statistics.

FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather=True``) does not run on gloo: its
all-gather of float8 shards raises ``RuntimeError: Invalid scalar type`` in
``all_gather_single`` (gloo has no float8 dtypes). The step below all-gathers in high precision
and casts the whole weight, whose amax is the same amax over all shards; the float8 all-gather's
own scale (``hp_tensor_to_float8_dynamic(shard, reduce_amax=True)``) is computed from the shards
directly and compared."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tests.metrics.cases import assert_results
from tests.metrics.test_quant import both_cases, both_references
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

MESHES = {2: [((2,), ("dp",)), ((2,), ("tp",))], 4: [((2, 2), ("dp", "tp")), ((4,), ("dp",))]}


def _cases(rank, world, meshes):
    out = []
    for shape, names in meshes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        out.append(both_cases(rank, shape, names, Topology.from_mesh(mesh), TorchCollectives(30.0)))
    # One launch per world size: the torchao step rides along at world 2.
    return out, (_float8_fsdp(rank, world) if world == 2 else None)


@pytest.fixture(scope="module")
def launches():
    return {world: run_distributed(_cases, world, MESHES[world], timeout=240) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_quant_equals_unsharded_reference_on_gloo(launches, world):
    for index, (shape, names) in enumerate(MESHES[world]):
        want = both_references(shape, names)
        for rank_results, _ in launches[world]:
            assert_results(rank_results[index], want)


class _Mlp(torch.nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Block(torch.nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.mlp = _Mlp(d, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Tiny(torch.nn.Module):
    def __init__(self, d: int = 64, f: int = 96, layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d, f) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def _float8_fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    torch.manual_seed(0)
    model = _Tiny()
    with torch.no_grad():
        model.layers[1].mlp.up.weight[70, 3] = 1000.0  # an outlier on rank 1's rows: it sets every shard's scale
        model.layers[0].mlp.down.weight.mul_(1e-3)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=False))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metric = build_metric("layer-param-quant", recipe=["fp8-tensorwise", "mxfp8"])
    metrics = TensorMetrics(model, metrics=[(metric, 1)], optimizer=optimizer, topology=Topology.from_mesh(mesh),
                            timeout_s=30)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    torchao_counts = {}
    with metrics.step(1):
        loss = model(x).square().mean()
        loss.backward()
        # torchao's own weight cast under float8 all-gather: each shard scaled by the amax of all shards
        for name, p in model.named_parameters():
            layer = int(name.split(".")[1])
            local = p.to_local().detach()
            fp8 = hp_tensor_to_float8_dynamic(local, torch.float8_e4m3fn, LinearMMConfig(), reduce_amax=True,
                                              gemm_input_role=GemmInputRole.WEIGHT, device_mesh=mesh)
            dq = fp8._data.to(torch.float64) / fp8._scale.to(torch.float64)
            row = torch.stack([((local != 0) & (fp8._data.float() == 0)).sum().double(),
                               local.double().square().sum(), (local.double() - dq).square().sum(),
                               torch.tensor(float(local.numel()), dtype=torch.float64)])
            torch.distributed.all_reduce(row)
            torchao_counts[layer] = torchao_counts.get(layer, 0) + row
        optimizer.step()
        optimizer.zero_grad()
    records = {(r.layer, r.stat): r.value for r in metrics.last_records}
    metrics.close()
    return {"records": records, "torchao": {k: v.tolist() for k, v in torchao_counts.items()},
            "loss": float(loss.detach()), "failures": [f.error for f in metrics.failures]}


def test_torchao_float8_fsdp2_amax_over_shards(launches):
    """A real torchao float8 step (Float8Linear under FSDP2) on 2 gloo ranks:
    tmetrics' fp8-tensorwise underflow and SQNR of each layer's weights equal those of torchao's
    own casts, whose scale comes from the amax over both shards."""
    results = [step for _, step in launches[2]]
    for got in results:
        assert not got["failures"] and math.isfinite(got["loss"])
        for layer, (underflow, energy, noise, numel) in got["torchao"].items():
            assert got["records"][(layer, "fp8-tensorwise.underflow")] * numel == underflow
            assert got["records"][(layer, "fp8-tensorwise.sqnr-db")] == pytest.approx(
                10 * math.log10(energy / noise), rel=1e-9)
    assert results[0]["records"] == results[1]["records"]
    assert results[0]["torchao"][1][0] > 0  # the outlier's scale flushes small weights on both shards
