"""The jsonl sink's public format, read back from the real file."""

from __future__ import annotations

import json
import math

import pytest

from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.jsonl import JsonlSink
from tmetrics_core.sinks.keys import PLAIN_RULES, KeyBook, index_widths
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_core.hub.spool import SpoolReader

pytestmark = pytest.mark.timeout(60)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_one_object_per_record_with_the_documented_fields(tmp_path):
    run = RunInfo(name="r", dir=str(tmp_path / "run"), num_layers=12, num_experts=64)
    sink = JsonlSink()
    sink.open(run)
    hist = Histogram(edges=(0.1, 1.0, 10.0), counts=(3, 4), zeros=2, nan=1, posinf=0, neginf=5)
    sink.write(
        [
            MetricRecord("global-grad-l2", 5, 1.25),
            MetricRecord("layer-grad-l2", 5, math.nan, labels=Labels(layer=3)),
            MetricRecord("layer-expert-tokens", 5, (1.0, 2.0, math.inf), labels=Labels(layer=3)),
            MetricRecord("layer-router-expert-bias", 5, -0.5, labels=Labels(layer=11, expert=17, stat="mean")),
            MetricRecord("layer-grad-histogram", 5, hist, labels=Labels(layer=0)),
            MetricRecord("family-grad-l2", 5, 2.0, labels=Labels(tensor="layers.*.mlp.up.weight")),
        ],
        5,
    )
    sink.close("finished")
    assert _lines(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 5, "metric": "global-grad-l2", "labels": {}, "key": "global-grad-l2", "value": 1.25},
        {"step": 5, "metric": "layer-grad-l2", "labels": {"layer": 3}, "key": "layer-grad-l2/layer_03", "value": "NaN"},
        {
            "step": 5,
            "metric": "layer-expert-tokens",
            "labels": {"layer": 3},
            "key": "layer-expert-tokens/layer_03",
            "value": [1.0, 2.0, "Infinity"],
        },
        {
            "step": 5,
            "metric": "layer-router-expert-bias",
            "labels": {"layer": 11, "expert": 17, "stat": "mean"},
            "key": "layer-router-expert-bias/layer_11/expert_017/mean",
            "value": -0.5,
        },
        {
            "step": 5,
            "metric": "layer-grad-histogram",
            "labels": {"layer": 0},
            "key": "layer-grad-histogram/layer_00",
            "value": {"edges": [0.1, 1.0, 10.0], "counts": [3, 4], "zeros": 2, "nan": 1, "posinf": 0, "neginf": 5},
        },
        {
            "step": 5,
            "metric": "family-grad-l2",
            "labels": {"tensor": "layers.*.mlp.up.weight"},
            "key": "family-grad-l2/layers.*.mlp.up.weight",
            "value": 2.0,
        },
    ]


def test_keys_use_the_run_widths(tmp_path, step_records):
    run = RunInfo(name="r", dir=str(tmp_path), num_layers=120, num_experts=1024)
    sink = JsonlSink()
    sink.open(run)
    records = step_records(1)
    sink.write(records, 1)
    sink.close("finished")
    layer_width, expert_width = index_widths(120, 1024)
    book = KeyBook(PLAIN_RULES, layer_width=layer_width, expert_width=expert_width)
    expected = [book.add(r.metric, r.labels) for r in records]
    keys = [line["key"] for line in _lines(tmp_path / "metrics.jsonl")]
    assert keys == expected and "layer-router-expert-bias/layer_000/expert_0002" in keys


def test_each_step_is_on_disk_when_write_returns_and_reopen_appends(tmp_path, sample_run, step_records, record_rows):
    path = tmp_path / "custom" / "m.jsonl"
    sink = JsonlSink(path=str(path))
    sink.open(sample_run)
    sink.write(step_records(1), 1)
    assert len(path.read_text().splitlines()) == len(step_records(1))  # visible before flush/close
    sink.close("failed")
    again = JsonlSink(path=str(path))
    again.open(sample_run)
    again.write(step_records(2), 2)
    again.close("finished")
    assert record_rows(list(SpoolReader(path))) == record_rows(step_records(1) + step_records(2))


def test_invalid_path_option_is_a_config_error():
    with pytest.raises(ConfigError, match="sinks.jsonl.path"):
        JsonlSink(path=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        JsonlSink(path="")
