"""The console sink's per-step summary, captured from the real stream."""

from __future__ import annotations

import math

import pytest

from tmetrics_core.sinks.console import ConsoleSink
from tmetrics_core.errors import ConfigError
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo

pytestmark = pytest.mark.timeout(60)

RUN = RunInfo(name="r", dir=".", num_layers=24, num_experts=8)


def _step(step: int) -> list[MetricRecord]:
    out = [MetricRecord("global-grad-l2", step, 1.23456), MetricRecord("output-entropy", step, 3.5)]
    out += [MetricRecord("layer-grad-l2", step, 0.5 + layer, labels=Labels(layer=layer)) for layer in range(24)]
    out[5] = MetricRecord("layer-grad-l2", step, math.nan, labels=Labels(layer=3))
    out += [MetricRecord("layer-expert-tokens", step, (4.0, 0.0, 812.0), labels=Labels(layer=layer)) for layer in (2, 5)]
    out += [
        MetricRecord("layer-grad-histogram", step, Histogram(edges=(0.0, 1.0), counts=(10,), nan=1), labels=Labels(layer=layer))
        for layer in range(2)
    ]
    out.append(MetricRecord("layer-expert-load-imbalance", step, 1.5, labels=Labels(layer=7, stat="max_over_mean")))
    return out


def test_summary_lines(capsys):
    sink = ConsoleSink()
    sink.open(RUN)
    sink.write(_step(10), 10)
    sink.close("finished")
    assert capsys.readouterr().out.splitlines() == [
        "step 10  global-grad-l2 1.235  output-entropy 3.5",
        "  layer-grad-l2                              min 0.5 @ layer 00  max 23.5 @ layer 23  (24 values, 1 non-finite)",
        "  layer-expert-tokens                        min 0 @ layer 02 [1]  max 812 @ layer 02 [2]  (6 values)",
        "  layer-grad-histogram                       2 histograms, 22 values, 2 non-finite",
        "  layer-expert-load-imbalance/max_over_mean  min 1.5 @ layer 07  max 1.5 @ layer 07  (1 value)",
    ]


def test_every_and_stream_options(capsys):
    sink = ConsoleSink(every=5, stream="stderr")
    sink.open(RUN)
    for step in range(1, 11):
        sink.write([MetricRecord("global-grad-l2", step, float(step))], step)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["step 5  global-grad-l2 5", "step 10  global-grad-l2 10"]


def test_expert_positions_use_the_run_widths(capsys):
    sink = ConsoleSink()
    sink.open(RunInfo(name="r", dir=".", num_layers=200, num_experts=2000))
    sink.write(
        [MetricRecord("layer-router-expert-bias", 1, v, labels=Labels(layer=5, expert=e)) for e, v in ((3, -1.0), (1500, 2.0))], 1
    )
    assert capsys.readouterr().out.splitlines()[1].split("  ")[2:4] == [
        "min -1 @ layer 005 expert 0003",
        "max 2 @ layer 005 expert 1500",
    ]


@pytest.mark.parametrize("options", [{"every": 0}, {"every": True}, {"every": 1.5}, {"stream": "file"}])
def test_invalid_options_are_config_errors(options):
    with pytest.raises(ConfigError, match="sinks.console"):
        ConsoleSink(**options)
