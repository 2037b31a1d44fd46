"""SinkHub: failure isolation, spool and replay, bounded close; fake sinks from conftest."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from tmetrics_core.errors import ConfigError, SinkError
from tmetrics_core.hub.sink_hub import NullHub, SinkHub
from tmetrics_core.hub.replay import replay
from tmetrics_core.hub.spool import SpoolConfig, SpoolReader, spool_path

pytestmark = pytest.mark.timeout(60)

FAST = {"backoff": 0.01, "backoff_max": 0.05, "close_timeout": 5.0, "spool_timeout": 5.0}


def make_hub(sinks, tmp_path: Path, **options) -> SinkHub:
    return SinkHub(sinks, spool_dir=tmp_path / "spool", **{**FAST, **options})


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def submit_steps(hub: SinkHub, step_records, steps, *, pace=None) -> list:
    """Submit each step; with ``pace`` (a recording sink), wait for it to take the step first,
    as steps spaced by training time would."""
    submitted = []
    for step in steps:
        records = step_records(step)
        hub.submit(records, step)
        submitted += records
        if pace is not None:
            wait_until(lambda step=step: bool(pace.batches) and pace.batches[-1][0] == step)
    return submitted


def accounted(report) -> None:
    assert report.pending == 0
    assert report.submitted == report.written + report.spooled + report.dropped


def test_healthy_sink_gets_every_record_on_its_worker_thread(
    tmp_path, sample_run, step_records, recording_sink, record_rows
):
    sink = recording_sink()
    hub = make_hub([sink], tmp_path)
    hub.open(sample_run)
    hub.log_config({"lr": 0.1})
    submitted = submit_steps(hub, step_records, range(1, 11))
    report = hub.close("finished")

    assert record_rows(sink.records) == record_rows(submitted)
    assert [step for step, _ in sink.batches] == list(range(1, 11))
    assert sink.runs == [sample_run] and sink.configs == [{"lr": 0.1}] and sink.statuses == ["finished"]
    assert threading.get_ident() not in sink.threads and len(sink.threads) == 1
    r = report["recording"]
    assert (r.submitted, r.written, r.spooled, r.dropped, r.retried, r.errors) == (
        len(submitted),
        len(submitted),
        0,
        0,
        0,
        0,
    )
    assert r.opened and r.closed and r.spool_path is None
    assert report.complete and not (tmp_path / "spool").exists()


def test_submit_hands_over_one_shared_tuple_without_copying(tmp_path, sample_run, step_records, recording_sink):
    first, second = recording_sink("a"), recording_sink("b")
    hub = make_hub([first, second], tmp_path)
    hub.open(sample_run)
    records = tuple(step_records(1) * 400)  # 20k records: submit must not touch them one by one
    hub.submit(records, 1)
    hub.close()
    assert first.batches[0][1] is records and second.batches[0][1] is records


@pytest.mark.parametrize("fail_open", [False, True], ids=["write-fails", "open-fails-too"])
def test_sink_raising_on_every_call_loses_nothing(
    tmp_path, sample_run, step_records, failing_sink, recording_sink, record_rows, fail_open
):
    failing, healthy = failing_sink(fail_open=fail_open), recording_sink()
    hub = make_hub([failing, healthy], tmp_path, retries=2)
    hub.open(sample_run)
    hub.log_config({"lr": 0.1, "layers": 4})
    submitted = submit_steps(hub, step_records, range(1, 21))
    report = hub.close("failed")

    assert record_rows(healthy.records) == record_rows(submitted)  # isolation: the healthy sink saw all
    r = report["failing"]
    accounted(r)
    assert (r.written, r.spooled, r.dropped) == (0, len(submitted), 0)
    assert r.opened is not fail_open and r.closed is False and r.errors > 0 and "backend down" in r.last_error
    if not fail_open:  # the first call (log_config) got all 3 attempts; later ones one probe at most
        assert 3 <= r.errors < 3 * 21 and failing.calls == r.errors

    path = spool_path(tmp_path / "spool", "failing")
    assert r.spool_path == str(path)
    target = recording_sink("replayed")
    assert replay(path, target) == len(submitted)
    assert record_rows(target.records) == record_rows(submitted)
    assert target.configs == [{"lr": 0.1, "layers": 4}]
    assert target.runs == [sample_run] and target.statuses == ["finished"]
    assert [step for step, _ in target.batches] == list(range(1, 21))


def test_flaky_sink_is_retried_and_written(tmp_path, sample_run, step_records, recording_sink):
    class FlakySink(type(recording_sink())):
        failures = 2

        def write(self, records, step):
            if self.failures:
                self.failures -= 1
                raise TimeoutError("transient")
            super().write(records, step)

    sink = FlakySink("flaky")
    hub = make_hub([sink], tmp_path, retries=3)
    hub.open(sample_run)
    submitted = submit_steps(hub, step_records, [1, 2])
    r = hub.close()["flaky"]
    assert (r.written, r.spooled, r.retried, r.errors) == (len(submitted), 0, len(step_records(1)), 2)


def test_hanging_sink_blocks_neither_training_nor_close(
    tmp_path, sample_run, step_records, hanging_sink, recording_sink, record_rows
):
    hanging, healthy = hanging_sink(hang_s=10.0), recording_sink()
    hub = make_hub([hanging, healthy], tmp_path, queue_size=2 * len(step_records(1)), close_timeout=0.5)
    hub.open(sample_run)
    hub.submit(step_records(1), 1)
    assert hanging.entered.wait(5)
    wait_until(lambda: len(healthy.batches) == 1)
    submitted = step_records(1) + submit_steps(hub, step_records, range(2, 31), pace=healthy)
    assert hanging.returned == 0  # all 30 submits returned while the sink was stuck in write
    assert hub.flush(timeout=0.2) is False  # flush is bounded too

    report = hub.close("finished")
    assert hanging.returned == 0  # close returned while the write still hangs
    r = report["hanging"]
    accounted(r)
    assert (r.written, r.spooled, r.dropped, r.closed) == (0, len(submitted), 0, False)
    assert record_rows(healthy.records) == record_rows(submitted)

    target = recording_sink("replayed")
    assert replay(spool_path(tmp_path / "spool", "hanging"), target) == len(submitted)
    assert sorted(record_rows(target.records)) == sorted(record_rows(submitted))


def test_sink_unreachable_at_start_spools_then_writes_once_reachable(
    tmp_path, sample_run, step_records, unreachable_sink, recording_sink, record_rows
):
    sink = unreachable_sink()
    hub = make_hub([sink], tmp_path)
    hub.open(sample_run)
    early = submit_steps(hub, step_records, range(1, 4))
    assert hub.flush(timeout=10) is True  # spooled while the backend refuses connections
    assert sink.open_attempts >= 1 and not sink.runs
    assert hub.report()["unreachable"].spooled == len(early)

    sink.make_reachable()
    wait_until(lambda: hub.report()["unreachable"].opened)
    late = submit_steps(hub, step_records, range(4, 7))
    r = hub.close()["unreachable"]
    accounted(r)
    assert (r.written, r.spooled, r.dropped, r.closed) == (len(late), len(early), 0, True)
    assert record_rows(sink.records) == record_rows(late)

    target = recording_sink("replayed")
    assert replay(spool_path(tmp_path / "spool", "unreachable"), target) == len(early)
    assert record_rows(target.records) == record_rows(early)


def test_every_failure_at_once_with_a_healthy_sink(
    tmp_path, sample_run, step_records, failing_sink, hanging_sink, unreachable_sink, recording_sink, record_rows
):
    sinks = [failing_sink(), hanging_sink(), unreachable_sink(), recording_sink()]
    hub = make_hub(sinks, tmp_path, queue_size=3 * len(step_records(1)), close_timeout=1.0)
    hub.open(sample_run)
    submitted = submit_steps(hub, step_records, range(1, 16), pace=sinks[3])
    report = hub.close("killed")
    assert record_rows(sinks[3].records) == record_rows(submitted) and sinks[3].statuses == ["killed"]
    for name in ("failing", "hanging", "unreachable"):
        r = report[name]
        accounted(r)
        assert r.dropped == 0 and r.written + r.spooled == len(submitted)
        restored = recording_sink(name)
        assert replay(spool_path(tmp_path / "spool", name), restored) == r.spooled
        written = sinks[["failing", "hanging", "unreachable"].index(name)].records
        assert sorted(record_rows(restored.records + written)) == sorted(record_rows(submitted))


def test_spool_disk_full_counts_dropped_and_warns_once(tmp_path, sample_run, step_records, failing_sink, caplog):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    os.symlink("/dev/full", spool_dir / "failing.jsonl")  # every write: ENOSPC
    hub = make_hub([failing_sink()], tmp_path)
    with caplog.at_level(logging.WARNING, logger="tmetrics"):
        hub.open(sample_run)
        submitted = submit_steps(hub, step_records, range(1, 6))
        r = hub.close()["failing"]
    accounted(r)
    assert (r.written, r.spooled, r.dropped) == (0, 0, len(submitted))
    spool_warnings = [m for m in caplog.messages if "cannot write the failing spool" in m]
    assert len(spool_warnings) == 1 and "No space left on device" in spool_warnings[0]
    assert "LOST" in caplog.messages[-1]  # the report logged at close says so


def test_close_is_idempotent_and_thread_safe(tmp_path, sample_run, step_records, recording_sink):
    sink = recording_sink()
    hub = make_hub([sink], tmp_path)
    hub.open(sample_run)
    submit_steps(hub, step_records, [1])
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(hub.close("killed"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(reports) == 4 and all(r is reports[0] for r in reports) and hub.close() is reports[0]
    assert reports[0].status == "killed" and sink.statuses == ["killed"]


def test_flush_waits_for_writes_and_sink_flush(tmp_path, sample_run, step_records, recording_sink):
    sink = recording_sink()
    hub = make_hub([sink], tmp_path)
    hub.open(sample_run)
    submitted = submit_steps(hub, step_records, range(1, 4))
    assert hub.flush(timeout=10) is True
    assert len(sink.records) == len(submitted) and sink.flushes == 1
    hub.close()


def test_lifecycle_errors(tmp_path, sample_run, step_records, recording_sink, caplog):
    hub = make_hub([recording_sink()], tmp_path)
    with pytest.raises(SinkError, match="before open"):
        hub.submit(step_records(1), 1)
    hub.open(sample_run)
    with pytest.raises(SinkError, match="twice"):
        hub.open(sample_run)
    hub.close()
    with caplog.at_level(logging.WARNING, logger="tmetrics"):
        hub.submit(step_records(2), 2)  # after close: not taken, said once, never raised
    assert any("after close" in m for m in caplog.messages)
    with pytest.raises(ConfigError, match="once"):
        SinkHub([recording_sink("x"), recording_sink("x")], spool_dir=tmp_path)
    with pytest.raises(ConfigError, match="hub.queue_size"):
        SinkHub([], spool_dir=tmp_path, queue_size=0)


def test_report_text_names_the_replay_command(tmp_path, sample_run, step_records, failing_sink):
    hub = make_hub([failing_sink()], tmp_path)
    hub.open(sample_run)
    submit_steps(hub, step_records, [1])
    text = str(hub.close())
    path = spool_path(tmp_path / "spool", "failing")
    assert f"tmetrics replay {path} --sink failing" in text
    assert text.splitlines()[1].split() == ["sink", "submitted", "written", "retried", "spooled", "dropped", "errors"]


def test_replay_by_sink_name_into_jsonl(tmp_path, sample_run, step_records, failing_sink, record_rows):
    hub = make_hub([failing_sink()], tmp_path)
    hub.open(sample_run)
    hub.log_config({"seed": 1})
    submitted = submit_steps(hub, step_records, [1, 2])
    hub.close()
    spool = spool_path(tmp_path / "spool", "failing")
    assert [type(e) for e in SpoolReader(spool)][:2] == [type(sample_run), SpoolConfig]
    out = tmp_path / "replayed.jsonl"
    assert replay(spool, "jsonl", options={"path": str(out)}) == len(submitted)
    assert record_rows([e for e in SpoolReader(out)]) == record_rows(submitted)
    with pytest.raises(ConfigError, match="sink name only"):
        replay(spool, failing_sink(), options={"path": "x"})


def test_interrupt_spools_a_backlog_the_sink_cannot_write_by_the_drain_deadline_at_once(
    tmp_path, sample_run, step_records, recording_sink, record_rows, caplog
):
    """Ctrl-C with a slow tracker: the drain does not spend its deadline writing part of a
    backlog whose rest is spooled anyway; every record ends written or spooled, and a sink
    that keeps up still gets every record."""
    from tmetrics_core.records import MetricRecord

    class SlowSink(type(recording_sink())):  # type: ignore[misc]
        def write(self, records, step):
            time.sleep(0.05)
            super().write(records, step)

    slow, fast = SlowSink("slow"), recording_sink()
    hub = make_hub([slow, fast], tmp_path, interrupt_timeout=2.0)
    hub.open(sample_run)
    submitted = submit_steps(hub, step_records, [1], pace=slow)
    submitted += submit_steps(hub, step_records, range(2, 62))  # 60 writes of 0.05 s: 3 s > the 1 s drain
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tmetrics.hub"):
        report = hub.close_interrupted()
    took = time.monotonic() - started

    assert took < 0.5, took  # one write in flight and the close, not the 1 s drain
    assert "would not be written by the close's drain deadline" in caplog.text
    assert slow.statuses == ["killed"] and fast.statuses == ["killed"]
    spooled = [e for e in SpoolReader(spool_path(tmp_path / "spool", "slow")) if isinstance(e, MetricRecord)]
    assert sorted(record_rows(slow.records + spooled)) == sorted(record_rows(submitted))
    assert report["slow"].spooled == len(spooled) > 0 and report["slow"].written == len(slow.records)
    assert record_rows(fast.records) == record_rows(submitted) and report["recording"].spooled == 0
    accounted(report["slow"])


def test_null_hub_does_nothing(step_records, sample_run):
    hub = NullHub()
    hub.open(sample_run)
    hub.log_config({"a": 1})
    hub.submit(step_records(1), 1)
    assert hub.flush() is True
    report = hub.close("finished")
    assert report.sinks == () and report.complete


def test_a_retry_policy_takes_exactly_one_way_to_stop():
    import threading

    from tmetrics_core.hub.attempts import retrying

    common = dict(backoff=0.0, backoff_max=0.0, sleep=lambda s: None, before_sleep=lambda state: None)
    calls = []

    def failing():
        calls.append(1)
        raise OSError("down")
    with pytest.raises(OSError):
        retrying(attempts=3, **common)(failing)
    assert len(calls) == 3
    for wrong in ({}, {"attempts": 2, "until": threading.Event()}):
        with pytest.raises(ValueError, match="exactly one"):
            retrying(**wrong, **common)
