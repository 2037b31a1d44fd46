"""The core metrics on real gloo processes (world sizes 1, 2 and 4) over every placement,
against the unsharded float64 reference computed in the parent process."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tests.placement_cases import Case, TensorCase, assert_matches, mean_scale, reference, run_case
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives


def _case(shape, names) -> Case:
    g = torch.Generator().manual_seed(sum(shape) * 7 + len(names))

    def t(*s, dtype=torch.float32):
        return torch.randn(s, generator=g).to(dtype)

    n = len(shape)
    pad = lambda *specs: tuple(specs) + (("R",),) * (n - len(specs))  # noqa: E731
    last = shape[-1]
    tensors = [
        TensorCase("layers.0.attn.q.weight", 0, t(9, 6), pad(("S", 0))),                 # uneven rows
        TensorCase("layers.0.attn.o.weight", 0, t(6, 7), pad(("S", 1))),                 # uneven columns
        TensorCase("layers.0.attn_norm.weight", 0, t(6), pad(("R",))),                   # replicated
        TensorCase("layers.1.mlp.up.weight", 1, t(3, 5), pad(("S", 0))),                 # empty shard at 4 ranks
        TensorCase("layers.1.mlp.down.weight", 1, t(4, 6),
                   pad(("F", tuple(i / shape[0] * 0.9 if i < shape[0] else 1.0 for i in range(shape[0] + 1))))),
        TensorCase("layers.1.moe.experts.0.up.weight", 1, t(5, 4), pad(("O", shape[0] - 1))),
        TensorCase("layers.2.attn.v.weight", 2, t(4, 4), pad(("P", "sum")), seed=3),
        TensorCase("layers.2.attn.k.weight", 2, t(3, 3), pad(("P", "max")), seed=5),
        TensorCase("layers.2.act", 2, t(7, 3), pad(("S", None))),
        TensorCase("layers.3.bf16.weight", 3, t(64, 32, dtype=torch.bfloat16) * 50, pad(("S", 0))),
    ]
    if n == 2:  # 2-D mesh: a second placement on the inner axis
        tensors.append(TensorCase("layers.3.mlp.gate.weight", 3, t(5, 6), (("S", 0), ("S", 1))))
        tensors.append(TensorCase("layers.3.mlp.fc1.weight", 3, t(4, 5),
                                  (("O", 1), ("F", (0.0, 0.45, 1.0)))))
        tensors.append(TensorCase("layers.0.hsdp.weight", 0, t(6, 2), (("R",), ("S", 0))))
    assert last >= 1
    return Case(shape, names, tensors)


def _rank(rank, world, case):
    mesh = init_device_mesh("cpu", case.shape, mesh_dim_names=case.names)
    topology = Topology.from_mesh(mesh)
    return run_case(rank, case, topology, TorchCollectives(30.0))


@pytest.mark.parametrize("shape,names", [((1,), ("dp",)), ((2,), ("tp",)), ((4,), ("fsdp",)),
                                          ((2, 2), ("dp", "tp"))])
def test_core_metrics_equal_reference(shape, names):
    case = _case(shape, names)
    world = 1
    for s in shape:
        world *= s
    results = run_distributed(_rank, world, case, timeout=120)
    want = reference(case)
    for got in results:
        assert_matches(got, want, atol_by_metric=mean_scale(case))
