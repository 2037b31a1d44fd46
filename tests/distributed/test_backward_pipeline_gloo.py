"""Cotangent metrics on 2 pipeline stages of ``torch.distributed.pipelining`` (GPipe and 1F1B,
4 micro-batches): each stage observes its own layers' cotangents, under their global layer
indices, and with ``grad_divisor`` = the micro-batches the schedule divides the gradients by,
the records equal float64 autograd of the global batch in one process (rel 1e-5)."""
from __future__ import annotations

import pytest
import torch

from tests.backward_model import BATCH, D, SEQ, Net, assert_close, batch, expected, loss_of, observed
from tests.distributed.harness import run_distributed

MICRO = 4
NAMES = ("layer-residual-grad-l2", "layer-residual-grad-absmax", "layer-backward-gain", "output-logits-grad-l2")


class _First(torch.nn.Module):
    def __init__(self, full: Net) -> None:
        super().__init__()
        self.embed, self.layers = full.embed, torch.nn.ModuleList(full.layers[:2])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return h


class _Last(torch.nn.Module):
    def __init__(self, full: Net) -> None:
        super().__init__()
        self.layers, self.head = torch.nn.ModuleList(full.layers[2:]), full.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _stages(rank: int, world: int) -> dict[str, dict]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    out = {}
    for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        full = Net()
        module = _First(full) if rank == 0 else _Last(full)
        h = torch.zeros(BATCH // MICRO, SEQ, D, requires_grad=True)  # stage 1's received input needs a cotangent
        stage = PipelineStage(module, rank, world, torch.device("cpu"),  # examples given: no shape-inference forward
                              input_args=(torch.zeros(BATCH // MICRO, SEQ, dtype=torch.long) if rank == 0 else h,),
                              output_args=h if rank == 0 else torch.zeros(BATCH // MICRO, SEQ, 16))
        schedule = schedule_class(stage, n_microbatches=MICRO, loss_fn=loss_of)
        tm = TensorMetrics(module, metrics=[(build_metric(n), 1) for n in NAMES],
                           topology=Topology.from_groups({"pp": dist.group.WORLD}), layer_offset=2 * rank,
                           grad_divisor=MICRO, timeout_s=60)
        tokens, targets = batch(1)
        with tm.step(1):
            if rank == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=targets)
        assert tm.failures == []
        out[name] = observed(tm.last_records)
        tm.close()
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_equal_one_process(schedule: str, pipeline_ranks) -> None:
    want = {k: v for k, v in expected(1).items() if k[0] in NAMES}
    assert_close(pipeline_ranks[0][schedule], want)


@pytest.fixture(scope="module")
def pipeline_ranks() -> list[dict]:
    return run_distributed(_stages, 2, timeout=240)
