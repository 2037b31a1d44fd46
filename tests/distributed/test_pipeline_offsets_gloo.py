"""Pipeline stages whose blocks are a local ``nn.ModuleList`` (names restart at 0 on every
stage) with ``layer_offset``: token sites take the global layer path, so each layer keeps its
own residual record; and a DTensor ``Partial("avg")`` weight is averaged, not summed."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.up = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return x + self.mlp.up(x)


class Stage(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def _reference():
    torch.manual_seed(0)
    full = Stage(2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out, h = {}, x
    for i, block in enumerate(full.layers):
        h = block(h)
        out[i] = h.pow(2).mean().sqrt().item()
    return full, x, out


def _pp_rank(rank, world):
    import torch.distributed as dist

    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    full, x, _ = _reference()
    stage = Stage(1)
    stage.layers[0].load_state_dict(full.layers[rank].state_dict())
    metrics = TensorMetrics(stage, metrics=[(build_metric("layer-residual-accumulator-rms"), 1)],
                            topology=Topology.from_groups({"pp": dist.group.WORLD}), layer_offset=rank, timeout_s=30)
    with torch.no_grad(), metrics.step(1):
        stage(x if rank == 0 else full.layers[0](x))
    return {r.layer: r.value for r in metrics.last_records}


def test_stage_local_block_names_get_global_layers():
    _, _, want = _reference()
    for got in run_distributed(_pp_rank, 2, timeout=90):
        assert got.keys() == want.keys()
        for layer, value in want.items():
            assert got[layer] == pytest.approx(value, rel=1e-6)


def _avg_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = Stage(1)
    weight = DTensor.from_local(torch.full((8, 8), float(rank + 1)), mesh, [Partial("avg")])
    model.layers[0].mlp.up.weight = torch.nn.Parameter(weight)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-param-l2"), 1)],
                            topology=Topology.from_mesh(mesh), timeout_s=30)
    with metrics.step(1):
        pass
    return metrics.last_records[0].value, weight.full_tensor().norm().item()


def test_dtensor_partial_avg_is_averaged():
    for got, want in run_distributed(_avg_rank, 2, timeout=90):
        assert got == pytest.approx(want, rel=1e-6)
        assert want == pytest.approx(1.5 * 8, rel=1e-6)


class HeadStage(Stage):
    def __init__(self, last):
        super().__init__(1)
        if last:
            self.head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        x = super().forward(x)
        return self.head(x) if hasattr(self, "head") else x


def _head_rank(rank, world):
    import torch.distributed as dist

    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    torch.manual_seed(rank)
    model = HeadStage(last=rank == world - 1)
    metrics = TensorMetrics(model, metrics=[(build_metric("global-output-logits-l2"), 1)],
                            topology=Topology.from_groups({"pp": dist.group.WORLD}), layer_offset=rank, timeout_s=30)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), metrics.step(1):
        out = model(x)
    logits_norm = out.norm().item() if rank == world - 1 else None
    return [r.value for r in metrics.last_records], logits_norm


def test_stage_without_head_accepts_logit_metrics():
    # Only the last stage has the head: the config check is agreed across stages (no stage
    # raises while another waits), and every rank reports the last stage's logits.
    results = run_distributed(_head_rank, 2, timeout=90)
    want = results[-1][1]
    for values, _ in results:
        assert values == [pytest.approx(want, rel=1e-6)]
