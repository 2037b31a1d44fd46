"""A sink that raises, hangs or is unreachable costs training nothing and loses nothing: what it
did not take is in its spool, and ``replay`` brings exactly the missing records, with their
values, into a backend (records in == records out). A full spool disk is warned about once,
counted as dropped, and training goes on. End to end: real TensorMetrics records, real spool.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import RecordingSink, rows
from tests.reliability.layered_model import LayeredModel, catalogue_metrics, train_steps
from tmetrics_core.hub.sink_hub import SinkHub
from tmetrics_core.records import RunInfo
from tmetrics_core.hub.replay import replay
from tmetrics_core.hub.spool import spool_path
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(60)

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-grad-nonfinite", "layer-grad-histogram", "layer-param-rms")
FAST = {"backoff": 0.01, "backoff_max": 0.05, "close_timeout": 2.0, "spool_timeout": 5.0}


def _metrics(sink, run_dir: Path) -> tuple[TensorMetrics, LayeredModel, torch.optim.Optimizer]:
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hub = SinkHub([sink], spool_dir=run_dir / "spool", **FAST)
    metrics = TensorMetrics(model, metrics=catalogue_metrics(*METRICS), optimizer=optimizer, hub=hub,
                            run=RunInfo(name="faults", dir=str(run_dir)))
    return metrics, model, optimizer


def _replayed(run_dir: Path, sink_name: str) -> RecordingSink:
    target = RecordingSink("backend")
    path = spool_path(run_dir / "spool", sink_name)
    if path.exists():
        replay(path, target)
    return target


@pytest.mark.parametrize("kind", ["raising", "hanging", "unreachable"])
def test_sink_fault_loses_nothing_and_replay_completes_it(kind, tmp_path, failing_sink, hanging_sink,
                                                          unreachable_sink):
    sink = {"raising": failing_sink, "hanging": hanging_sink, "unreachable": unreachable_sink}[kind]()
    metrics, model, optimizer = _metrics(sink, tmp_path)
    produced, longest = train_steps(metrics, model, optimizer, range(1, 6))
    if kind == "unreachable":
        sink.make_reachable()  # the background open keeps retrying; wait until it gets through
        deadline = time.monotonic() + 10
        while not sink.runs and time.monotonic() < deadline:
            time.sleep(0.01)
    more, longer = train_steps(metrics, model, optimizer, range(6, 11))
    produced += more
    report = metrics.close()[sink.name]

    assert {r.step for r in produced} == set(range(1, 11))  # every step measured
    assert max(longest, longer) < 1.0  # the training thread never waited for the sink
    assert report.submitted == len(produced) and report.dropped == 0 and report.pending == 0
    assert report.written + report.spooled == report.submitted
    backend = _replayed(tmp_path, sink.name)
    written_live = [] if kind == "hanging" else sink.records
    assert sorted(rows(written_live + backend.records)) == sorted(rows(produced))
    assert len(backend.records) == report.spooled
    if kind == "raising":
        # log_config is tried 1 + 3 times; then the sink is down and only probed, once per interval
        assert report.written == 0 and report.errors >= 4 and sink.calls == report.errors
        assert backend.configs == [metrics.run.config]  # the run config missed by log_config is replayed too
    if kind == "hanging":
        assert sink.entered.is_set() and report.written == 0 and not report.closed
    if kind == "unreachable":
        assert sink.open_attempts > 1 and report.written > 0 and report.spooled > 0


def test_spool_disk_full_warns_once_and_training_goes_on(tmp_path, failing_sink, caplog):
    spool = tmp_path / "spool"
    spool.mkdir()
    os.symlink("/dev/full", spool / "failing.jsonl")  # every write to the spool: ENOSPC
    sink = failing_sink()
    metrics, model, optimizer = _metrics(sink, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tmetrics"):
        produced, longest = train_steps(metrics, model, optimizer, range(1, 9))
        report = metrics.close()["failing"]
    assert len({r.step for r in produced}) == 8 and longest < 1.0
    assert (report.submitted, report.written, report.spooled, report.dropped) == (len(produced), 0, 0, len(produced))
    disk = [m for m in caplog.messages if m.startswith("cannot write the failing spool")]
    assert len(disk) == 1 and "No space left on device" in disk[0] and "Free disk space" in disk[0]
    assert f"failing: {len(produced)} records LOST (spool could not take them)" in caplog.messages[-1]
