"""An MLflow tracking server that cannot be reached (issue 35, item 3): said within seconds, the
records spooled, and ``close()`` within its bound with the reason in its report. Before, nothing
was said for 4 min 08 s (MLflow's own HTTP retries), and close waited 30 s to report
``retried 0 errors 0``."""

from __future__ import annotations

import logging
import socket
import time
from typing import Iterator

import pytest
import torch

from tmetrics_core.hub.spool import SpoolReader
from tmetrics_core.records import MetricRecord
from tmetrics_core.tensor_metrics import TensorMetrics

FIRST_WORD_S = 5.0
CLOSE_TIMEOUT_S = 4.0


@pytest.fixture(params=["refused", "silent"])
def unreachable(request) -> Iterator[str]:
    """An HTTP URI that refuses connections, or one whose listener never answers (a black hole:
    the probe's timeout decides)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if request.param == "silent":
            listener.listen(8)
            yield f"http://127.0.0.1:{port}"
            return
    yield f"http://127.0.0.1:{port}"


def test_an_unreachable_server_is_said_at_once_and_close_gives_the_reason(tmp_path, unreachable, caplog):
    caplog.set_level(logging.WARNING, logger="tmetrics.hub")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    started = time.monotonic()
    metrics = TensorMetrics.from_config(
        {"run": {"close_timeout_s": CLOSE_TIMEOUT_S}, "metrics": ["global-grad-l2"],
         "sinks": {"mlflow": {"tracking_uri": unreachable}}}, model=model, optimizer=optimizer, run_dir=tmp_path)
    for step in (1, 2, 3):
        with metrics.step(step):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    while not any("cannot be reached" in r.getMessage() for r in caplog.records):
        assert time.monotonic() - started < FIRST_WORD_S, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    first = min(r.created for r in caplog.records if "cannot be reached" in r.getMessage())
    print(f"first warning {first - (time.time() - (time.monotonic() - started)):.2f} s after start-up")

    closing = time.monotonic()
    report = metrics.close()
    took = time.monotonic() - closing
    print(f"close took {took:.2f} s")
    assert took < CLOSE_TIMEOUT_S + 1.0
    mlflow = report["mlflow"]
    assert (mlflow.opened, mlflow.written, mlflow.spooled) == (False, 0, 3)
    assert unreachable in str(report) and "cannot be reached" in str(report) and "never opened" in str(report)
    spooled = [e for e in SpoolReader(tmp_path / "spool" / "mlflow.jsonl") if isinstance(e, MetricRecord)]
    assert [r.step for r in spooled] == [1, 2, 3]
