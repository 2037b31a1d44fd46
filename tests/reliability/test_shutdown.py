"""Ends of a run that nobody planned (issue 8, item 2): SIGTERM to a training process, and an
exception in the training loop. Everything up to the last completed step is flushed to the
backend (or its spool), and the tracker run is ended KILLED or FAILED.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.conftest import rows
from tests.reliability.layered_model import LayeredModel, train_steps
from tmetrics_core.records import MetricRecord
from tmetrics_core.hub.spool import SpoolReader, spool_path
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _records(path: Path) -> list[MetricRecord]:
    return [e for e in SpoolReader(path) if isinstance(e, MetricRecord)] if path.exists() else []


def _mlflow_run(db: Path, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def _mlflow_steps(client, run, key: str) -> set[int]:
    return {m.step for m in client.get_metric_history(run.info.run_id, key)}


def test_sigterm_flushes_every_completed_step_and_ends_the_run_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    job = subprocess.Popen([sys.executable, "-m", "tests.reliability.sigterm_job", str(tmp_path)], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    progress = tmp_path / "progress"
    deadline = time.monotonic() + 90
    while not (progress.exists() and len(progress.read_text().split()) >= 25):
        assert job.poll() is None, job.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the job did not reach step 25"
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # while it trains
    output = job.communicate(timeout=60)[0].decode()
    assert job.returncode == -signal.SIGTERM, output[-3000:]

    last = int(progress.read_text().split()[-1])
    produced = [r for r in _records(tmp_path / "produced.jsonl") if r.step <= last]
    assert {r.step for r in produced} == set(range(1, last + 1))
    # jsonl sink: metrics.jsonl plus its spool hold every record of every completed step, once, same value.
    jsonl = _records(tmp_path / "metrics.jsonl") + _records(spool_path(tmp_path / "spool", "jsonl"))
    assert sorted(rows([r for r in jsonl if r.step <= last])) == sorted(rows(produced))
    # MLflow: the run is KILLED, and each metric key's history plus the spool covers every step.
    client, run = _mlflow_run(tmp_path / "mlflow.db", "sigterm")
    assert run.info.status == "KILLED"
    spooled: dict[str, set[int]] = defaultdict(set)
    for r in _records(spool_path(tmp_path / "spool", "mlflow")):
        spooled[r.metric].add(r.step)
    for key, metric in (("global-grad-l2", "global-grad-l2"), ("layer-grad-l2/layer_00", "layer-grad-l2"),
                        ("layer-param-rms/layer_02", "layer-param-rms")):
        assert _mlflow_steps(client, run, key) | spooled[metric] >= set(range(1, last + 1)), key
    values = {(r.step, r.metric, r.layer): r.value for r in produced if r.metric == "layer-grad-l2"}
    for m in client.get_metric_history(run.info.run_id, "layer-grad-l2/layer_01"):
        if m.step <= last:
            assert m.value == pytest.approx(values[(m.step, "layer-grad-l2", 1)], rel=1e-12)


def test_exception_in_the_loop_flushes_the_steps_before_it_and_fails_the_runs(tmp_path):
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"run": {"name": "crash"}, "metrics": ["global-grad-l2", "layer-grad-l2"],
              "sinks": {"jsonl": {}, "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                "experiment": "crash"}}}
    produced = []
    with pytest.raises(FloatingPointError, match="loss is NaN at step 5"):
        with TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=tmp_path) as metrics:
            produced += train_steps(metrics, model, optimizer, range(1, 5))[0]
            with metrics.step(5):
                raise FloatingPointError("loss is NaN at step 5")
    assert metrics.hub.report().status == "failed"
    assert sorted(rows(_records(tmp_path / "metrics.jsonl"))) == sorted(rows(produced))
    assert {r.step for r in produced} == {1, 2, 3, 4}
    client, run = _mlflow_run(tmp_path / "mlflow.db", "crash")
    assert run.info.status == "FAILED"
    assert _mlflow_steps(client, run, "global-grad-l2") == {1, 2, 3, 4}
    assert not (tmp_path / "spool").exists()  # nothing needed the spool: all was written before close


def test_steps_after_sigterm_closed_the_metrics_run_quietly(tmp_path, caplog):
    """A job that keeps training after SIGTERM (its own handler, chained after tmetrics',
    returns) runs later steps with the same collectives; with tmetrics' hooks gone they find
    nothing and their update metric fails, which says nothing about the model: kept in
    ``failures``, not warned about. Steps before the signal are written."""
    import logging

    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        model = LayeredModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        metrics = TensorMetrics.from_config(
            {"metrics": ["global-grad-l2", "layer-update-ratio"], "sinks": {"jsonl": {}}},
            model=model, optimizer=optimizer, run_dir=tmp_path)
        caplog.set_level(logging.WARNING, logger="tmetrics")
        for step in (1, 2, 3, 4):
            with metrics.step(step):
                model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]
    assert [r.getMessage() for r in caplog.records if r.name == "tmetrics"] == []
    assert {f.metric for f in metrics.failures} == {"layer-update-ratio"}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sorted({json.loads(line)["step"] for line in lines}) == [1, 2]
