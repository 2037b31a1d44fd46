"""One rank of the soak job: ``python -m tests.reliability.soak_job RUN_DIR RANK WORLD PORT STEPS``.

Data-parallel training of a small layered model on gloo ranks (gradients averaged by hand, as
DDP does), measured every step by TensorMetrics: per-layer gradient and parameter metrics and
the residual stream (a token population split across ranks, so every step runs a data
collective). Rank 0 logs through a :class:`~tests.reliability.flaky_sink.FlakySink` (30% of
calls fail) behind a SinkHub, and after each completed step appends the step's records to
``RUN_DIR/produced.jsonl`` and the step number to ``RUN_DIR/progress`` (both flushed).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.reliability.flaky_sink import FlakySink
from tests.reliability.layered_model import LayeredModel, catalogue_metrics
from tmetrics_core.topology import Topology
from tmetrics_core.hub.sink_hub import NullHub, SinkHub
from tmetrics_core.records import RunInfo
from tmetrics_core.tensor_metrics import TensorMetrics

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-grad-nonfinite", "layer-param-rms",
           "layer-residual-accumulator-rms")


def main(run_dir: Path, rank: int, world: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    model = LayeredModel(width=4, depth=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hub = (SinkHub([FlakySink(path=str(run_dir / "backend.jsonl"), seed=7)], spool_dir=run_dir / "spool",
                   retries=2, backoff=0.001, backoff_max=0.02, close_timeout=20.0) if rank == 0 else NullHub())
    metrics = TensorMetrics(model, metrics=catalogue_metrics(*METRICS), optimizer=optimizer,
                            topology=Topology.from_groups({"dp": dist.group.WORLD}), hub=hub,
                            run=RunInfo(name="soak", dir=str(run_dir)), timeout_s=30)
    produced = open(run_dir / "produced.jsonl", "a") if rank == 0 else None
    progress = open(run_dir / "progress", "a") if rank == 0 else None
    for step in range(1, steps + 1):
        with metrics.step(step):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(world * step + rank))
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
            optimizer.zero_grad()
        if produced is not None and progress is not None:
            produced.write("".join(json.dumps({"step": r.step, "metric": r.metric, "labels": r.labels.as_dict(),
                                               "value": r.value_json()}) + "\n" for r in metrics.last_records))
            produced.flush()
            progress.write(f"{step}\n")
            progress.flush()
    metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
