"""A closed ``TensorMetrics`` refuses to measure: ``step()`` and ``observe_gradients()`` after
``close()`` raise ``TMetricsError`` (saying to create a new one) before any work, and closing
twice stays a no-op. Closed by SIGTERM instead, steps still run, so a job that shuts down
gracefully keeps the same collectives on every rank; their records reach no sink."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.reliability.layered_model import LayeredModel
from tmetrics_core.errors import TMetricsError
from tmetrics_core.tensor_metrics import TensorMetrics


def _metrics(run_dir: Path) -> tuple[TensorMetrics, LayeredModel, torch.optim.Optimizer]:
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"run": {"name": "closed"}, "metrics": ["layer-grad-l2", "layer-param-l2"], "sinks": {"jsonl": {}}}
    return TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=run_dir), model, optimizer


def _train(metrics: TensorMetrics, model: LayeredModel, optimizer: torch.optim.Optimizer, step: int) -> None:
    with metrics.step(step):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _written_steps(run_dir: Path) -> set[int]:
    with open(run_dir / "metrics.jsonl") as f:
        return {json.loads(line)["step"] for line in f if line.strip()}


def test_step_and_observe_gradients_after_close_raise_and_compute_nothing(tmp_path):
    metrics, model, optimizer = _metrics(tmp_path)
    _train(metrics, model, optimizer, 1)
    measured = list(metrics.last_records)
    assert {r.metric for r in measured} == {"layer-grad-l2", "layer-param-l2"}
    report = metrics.close()
    assert report is not None

    entered = False
    with pytest.raises(TMetricsError, match=r"step\(2\) called after close\(\).*create a new TensorMetrics"), \
            metrics.step(2):
        entered = True
    assert not entered
    with pytest.raises(TMetricsError, match=r"observe_gradients\(\) called after close\(\)"):
        metrics.observe_gradients()
    assert metrics.last_records == measured  # nothing was computed
    assert metrics.close() is report  # closing twice changes nothing and returns the first close's report
    assert _written_steps(tmp_path) == {1}


def test_closed_by_sigterm_steps_still_run_and_reach_no_sink(tmp_path):
    stops: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
    try:
        metrics, model, optimizer = _metrics(tmp_path)
        _train(metrics, model, optimizer, 1)
        os.kill(os.getpid(), signal.SIGTERM)  # closes the metrics, then the job's own handler runs
        assert stops == [signal.SIGTERM]
        _train(metrics, model, optimizer, 2)  # the job finishes its step before it stops
        assert {r.step for r in metrics.last_records} == {2}
        again = metrics.close()  # the report of the close SIGTERM ran
        assert again is not None and again.status == "killed"
        assert _written_steps(tmp_path) == {1}
    finally:
        signal.signal(signal.SIGTERM, previous)
