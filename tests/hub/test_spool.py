"""Spool writer and reader on real files: round trip, torn lines, disk full, append-only."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_core.hub.spool import SpoolConfig, SpoolReader, SpoolWriter, spool_path

pytestmark = pytest.mark.timeout(60)


def test_round_trip_keeps_run_config_and_every_value(tmp_path, sample_run, step_records, record_rows):
    path = spool_path(tmp_path / "spool", "mlflow")
    writer = SpoolWriter(path, sink="mlflow", run=sample_run)
    assert not path.exists()  # created on first write only
    assert writer.write_config({"lr": 0.5, "nested": {"a": [1, 2]}}) is True
    records = step_records(1) + step_records(2)
    assert writer.write_records(records) == len(records)
    writer.close()

    entries = list(SpoolReader(path))
    assert entries[0] == sample_run
    assert entries[1] == SpoolConfig({"lr": 0.5, "nested": {"a": [1, 2]}})
    assert record_rows(entries[2:]) == record_rows(records)
    nan = [e for e in entries[2:] if e.metric == "output-entropy"][0]
    assert math.isnan(nan.value)
    hist = [e for e in entries[2:] if isinstance(e.value, Histogram)][0]
    assert hist.value.posinf == 1 and hist.value.total == sum(hist.value.counts) + 2 + hist.value.nan


def test_line_format_is_strict_json_with_the_sink_name(tmp_path):
    path = tmp_path / "s.jsonl"
    writer = SpoolWriter(path, sink="tensorboard")
    writer.write_records([MetricRecord("layer-grad-l2", 7, math.inf, labels=Labels(layer=3, stat="max"))])
    line = path.read_text().splitlines()[0]
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) == {
        "step": 7,
        "metric": "layer-grad-l2",
        "labels": {"layer": 3, "stat": "max"},
        "value": "Infinity",
        "sink": "tensorboard",
    }


def test_torn_last_line_is_skipped_and_counted_then_isolated_on_append(tmp_path, sample_run, step_records, record_rows):
    path = tmp_path / "s.jsonl"
    first = step_records(1)
    SpoolWriter(path, sink="x", run=sample_run).write_records(first)
    whole = path.read_bytes()
    path.write_bytes(whole[:-25])  # a kill in the middle of the last line

    reader = SpoolReader(path)
    entries = list(reader)
    assert reader.skipped_lines == [len(first) + 1]  # line 1 is the run header
    assert record_rows(entries[1:]) == record_rows(first[:-1])

    second = step_records(2)
    SpoolWriter(path, sink="x", run=sample_run).write_records(second)  # a resumed run appends
    reader = SpoolReader(path)
    entries = list(reader)
    assert reader.skipped_lines == [len(first) + 1]  # the torn line stays alone; nothing glued to it
    assert record_rows(entries[1:]) == record_rows(first[:-1] + second)
    assert sum(isinstance(e, RunInfo) for e in entries) == 1  # no second header in a non-empty file


def test_damaged_middle_lines_are_skipped_not_fatal(tmp_path):
    path = tmp_path / "s.jsonl"
    good = '{"step":1,"metric":"m","labels":{},"value":1.0}\n'
    path.write_text(
        good + "not json\n" + '{"step":1,"metric":"m","labels":{"colour":"red"},"value":1}\n' + "[1,2]\n" + good
    )
    reader = SpoolReader(path)
    assert [e.value for e in reader] == [1.0, 1.0]
    assert reader.skipped_lines == [2, 3, 4]


def test_disk_full_warns_once_counts_nothing_written_never_raises(tmp_path, step_records, caplog):
    path = tmp_path / "full.jsonl"
    os.symlink("/dev/full", path)
    writer = SpoolWriter(path, sink="mlflow", run=RunInfo(name="r", dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="tmetrics.spool"):
        assert writer.write_records(step_records(1)) == 0
        assert writer.write_records(step_records(2)) == 0
        assert writer.write_config({"a": 1}) is False
        writer.close()
    assert len(caplog.records) == 1 and "No space left on device" in caplog.messages[0]


def test_unusable_directory_is_a_warning_not_an_error(tmp_path, step_records, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    writer = SpoolWriter(blocker / "spool" / "x.jsonl", sink="x")  # a parent is a regular file
    with caplog.at_level(logging.WARNING, logger="tmetrics.spool"):
        assert writer.write_records(step_records(1)) == 0
    assert len(caplog.records) == 1


def test_failed_append_leaves_no_partial_lines(tmp_path, monkeypatch, step_records):
    path = tmp_path / "s.jsonl"
    writer = SpoolWriter(path, sink="x")
    assert writer.write_records(step_records(1)) == len(step_records(1))
    size = path.stat().st_size
    real_write = os.write

    def half_then_fail(fd, data):  # the disk fills up in the middle of the batch
        if len(data) > 100:
            real_write(fd, bytes(data[:100]))
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_fail)
    assert writer.write_records(step_records(2)) == 0
    monkeypatch.undo()
    assert path.stat().st_size == size  # cut back: readers never see half a batch
    assert writer.write_records(step_records(3)) == len(step_records(3))  # and the file recovers
    assert SpoolReader(path).skipped_lines == []


_label = st.none() | st.integers(min_value=0, max_value=10_000)
_text = st.none() | st.text(min_size=1, max_size=20)
_number = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def _records(draw):
    kind = draw(st.sampled_from(["scalar", "vector", "histogram"]))
    if kind == "scalar":
        value = draw(_number)
    elif kind == "vector":
        value = tuple(draw(st.lists(_number, max_size=5)))
    else:
        counts = draw(st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=4))
        edges = tuple(float(10**i) for i in range(len(counts) + 1))
        value = Histogram(edges=edges, counts=tuple(counts), zeros=draw(st.integers(0, 9)), nan=draw(st.integers(0, 9)))
    return MetricRecord(
        metric=draw(st.text(min_size=1, max_size=30)),
        step=draw(st.integers(min_value=0, max_value=2**40)),
        value=value,
        labels=Labels(layer=draw(_label), expert=draw(_label), tensor=draw(_text), stat=draw(_text)),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(_records(), min_size=1, max_size=8))
def test_any_record_round_trips(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("spool") / "s.jsonl"
    SpoolWriter(path, sink="x").write_records(records)
    back = list(SpoolReader(path))
    assert [(r.step, r.metric, r.labels, repr(r.value_json())) for r in back] == [
        (r.step, r.metric, r.labels, repr(r.value_json())) for r in records
    ]
