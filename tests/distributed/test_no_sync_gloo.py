"""``observe_gradients()`` after each micro-batch under DDP's ``no_sync()`` (the README's way to
accumulate): the first read sees each rank's own, unsynchronized gradients, which are no
replicas. Only the last read before the optimizer step counts, and so does only its Replica
check. Before, the first read's check stopped training with a false ``PlacementError``.

In the same run, a layer that no rank computes a gradient for (a block the forward skips; DDP
with ``find_unused_parameters=True``) writes no ``layer-grad-rms`` record. Before, it wrote NaN,
which the default ``nonfinite-gradients`` alert took for a diverged run.

References: float64 norms of the gradients DDP all-reduced, read right before ``step()``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed


class _SkipsOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[2](torch.tanh(self.layers[0](x)))  # layer 1: no gradient on any rank


def _run(rank: int, world: int) -> tuple[dict, dict]:
    from torch.nn.parallel import DistributedDataParallel

    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    torch.manual_seed(0)
    model = DistributedDataParallel(_SkipsOne(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("global-grad-l2", "layer-grad-rms")],
                            optimizer=optimizer, topology=Topology.from_groups({"dp": dist.group.WORLD}), timeout_s=60)
    g = torch.Generator().manual_seed(10 + rank)  # other data on each rank
    out = []
    for step in (1, 2):
        with metrics.step(step):
            with model.no_sync():
                model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
                metrics.observe_gradients()
            model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            metrics.observe_gradients()
            layers = {i: [p.grad.double() for p in model.module.layers[i].parameters()] for i in (0, 2)}
            sumsq = {i: sum(float(t.pow(2).sum()) for t in ts) for i, ts in layers.items()}
            want = {("global-grad-l2", None): sum(sumsq.values()) ** 0.5,
                    **{("layer-grad-rms", i): (sumsq[i] / sum(t.numel() for t in ts)) ** 0.5 for i, ts in layers.items()}}
            optimizer.step()
            optimizer.zero_grad()
        out.append(({(r.metric, r.layer): r.value for r in metrics.last_records}, want))
    metrics.close()
    return out


def test_reads_under_no_sync_and_a_layer_without_gradients():
    ranks = run_distributed(_run, 2, timeout=120)
    assert ranks[0] == ranks[1]
    for got, want in ranks[0]:
        assert ("layer-grad-rms", 1) not in got  # no gradient on any rank: no record, not NaN
        assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}
