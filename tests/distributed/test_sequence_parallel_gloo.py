"""Residual streams under torch's sequence-parallel plan (tp = 2): the blocks' inputs and
outputs are plain local tensors holding each rank's half of the sequence, the same shape on
both ranks. tmetrics checks a residual site's Replica claim when the site first appears and,
finding different tokens on the tp ranks, measures it as split by sequence: the residual L2,
RMS and contribution RMS equal the float64 values of one process (they were rank 0's half:
L2 5.85 for 8.83), and so do the logits and gradients. A second step reads the same way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

V, D, H, B, S = 11, 8, 8, 2, 4
NAMES = ("layer-residual-accumulator-rms", "layer-residual-contribution-rms", "layer-residual-accumulator-l2",
         "global-output-logits-l2", "layer-grad-l2")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(D)
        self.attention = nn.ModuleDict({"wq": nn.Linear(D, H, bias=False), "wo": nn.Linear(H, D, bias=False)})
        self.ffn_norm = nn.RMSNorm(D)
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(D, H, bias=False), "w2": nn.Linear(H, D, bias=False)})

    def forward(self, x):
        x = x + self.attention["wo"](torch.tanh(self.attention["wq"](self.attention_norm(x))))
        return x + self.feed_forward["w2"](torch.relu(self.feed_forward["w1"](self.ffn_norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _reference(step: int) -> dict[tuple, float]:
    torch.manual_seed(0)
    model = Model().double()
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, block in enumerate(model.layers.values()):
        block.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (o, a[0])))
    ids, targets = _batch(step)
    z = model(ids)
    nn.functional.cross_entropy(z.flatten(0, 1), targets.flatten()).backward()
    out = {("global-output-logits-l2", None): z.norm().item()}
    for i, (h, x) in seen.items():
        out[("layer-residual-accumulator-rms", i)] = h.pow(2).mean().sqrt().item()
        out[("layer-residual-accumulator-l2", i)] = h.norm().item()
        out[("layer-residual-contribution-rms", i)] = (h - x).pow(2).mean().sqrt().item()
        out[("layer-grad-l2", i)] = torch.cat([p.grad.flatten() for p in model.layers[str(i)].parameters()]).norm().item()
    return out


def _run(rank: int, world: int) -> list[dict[tuple, float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                                     "norm": SequenceParallel(),
                                     "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], optimizer=optimizer,
                            topology=Topology.from_mesh(mesh), timeout_s=60)
    steps = []
    for step in (1, 2):
        ids, targets = _batch(step)
        with metrics.step(step):
            z = model(ids)
            assert type(z) is torch.Tensor
            nn.functional.cross_entropy(z.flatten(0, 1), targets.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert metrics.failures == []
        steps.append({(r.metric, r.layer): r.value for r in metrics.last_records})
    metrics.close()
    return steps


def test_residual_streams_split_by_sequence_are_measured_whole():
    want = [_reference(1), _reference(2)]
    for steps in run_distributed(_run, 2, timeout=120):
        for got, ref in zip(steps, want):
            assert got == {k: pytest.approx(v, rel=1e-4) for k, v in ref.items()}


def _nested(rank: int, world: int) -> float:
    """Four data-parallel ranks (population) holding different batches, and an expert-parallel
    axis of pairs inside them, as torchtitan's ``ep`` inside ``fsdp``."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(D, D)])
    torch.manual_seed(0)
    model.layers[0].reset_parameters()
    topology = Topology.from_groups({"dp": dist.group.WORLD, "ep": pairs[rank // 2]}, population_axes=["dp"])
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-l2"), 1)], topology=topology,
                            timeout_s=60)
    with metrics.step(1):
        model.layers[0](torch.randn(3, D, generator=torch.Generator().manual_seed(rank)))
    (record,) = metrics.last_records
    metrics.close()
    return record.value


def test_an_axis_inside_a_population_axis_is_not_split_again():
    """Its ranks hold different tokens because the data-parallel axis splits them: measured once."""
    torch.manual_seed(0)
    layer = nn.Linear(D, D).double()
    outs = [layer(torch.randn(3, D, generator=torch.Generator().manual_seed(r)).double()) for r in range(4)]
    want = torch.cat(outs).norm().item()
    assert run_distributed(_nested, 4, timeout=120) == [pytest.approx(want, rel=1e-5)] * 4
