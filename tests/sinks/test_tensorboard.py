from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.sinks.conftest import EXPERTS, LAYERS, make_records
from tests.sinks.readback_tensorboard import read_log
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import TENSORBOARD_RULES, KeyBook
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_tb import TensorBoardSink

STEPS = (1, 2, 3)


def _write_run(run: RunInfo, steps=STEPS) -> TensorBoardSink:
    sink = TensorBoardSink(expert_scalars=True)
    sink.open(run)
    sink.log_config(run.config)
    for step in steps:
        sink.write(make_records(step), step)
    sink.close("finished")
    return sink


def test_roundtrip_scalars_every_step_and_value(run_info: RunInfo) -> None:
    _write_run(run_info)
    log_dir = Path(run_info.dir) / "tb" / "demo-run"  # named after the run: TensorBoard's run name
    # One directory, no sub-runs (add_scalars / add_hparams would create some).
    assert [p for p in log_dir.iterdir() if p.is_dir()] == []
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    log = read_log(log_dir)

    expected: dict[str, dict[int, float]] = {}
    for step in STEPS:
        for r in make_records(step):
            if r.kind == "scalar":
                expected.setdefault(KeyBook(TENSORBOARD_RULES).add(r.metric, r.labels), {})[step] = r.value  # type: ignore[assignment]
            for labels, element in r.elements():  # a vector: one scalar per expert as well
                expected.setdefault(KeyBook(TENSORBOARD_RULES).add(r.metric, labels), {})[step] = element
    assert "layer-expert-tokens/layer_02/expert_003" in expected
    # The histogram of layer 0 has one NaN: its non-finite count is a scalar.
    expected["layer-grad-histogram/layer_00/nonfinite"] = {s: 1.0 for s in STEPS}
    assert log.scalar_tags == set(expected)
    for tag, values in expected.items():
        got = log.scalars(tag)
        assert [s for s, _ in got] == list(STEPS), tag
        for (step, value), want in zip(got, values.values()):
            if math.isnan(want):
                assert math.isnan(value), (tag, step)
            else:
                assert value == pytest.approx(want, rel=1e-6), (tag, step)
    assert "family-grad-l2/layers._.attn.q.weight" in log.scalar_tags
    assert "layer-expert-load-imbalance/layer_02/max_over_mean" in log.scalar_tags
    assert "layer-router-expert-bias/layer_01/expert_003" in log.scalar_tags


def test_histograms_from_bins_and_vectors(run_info: RunInfo) -> None:
    _write_run(run_info)
    log = read_log(Path(run_info.dir) / "tb")
    want_tags = {f"layer-grad-histogram/layer_{i:02d}" for i in range(LAYERS)}
    want_tags |= {f"layer-expert-tokens/layer_{i:02d}" for i in range(LAYERS)}
    assert log.histogram_tags == want_tags

    # Merged histogram of layer 1 at step 3: edges (1e-3, 1e-2, 1e-1, 1), counts (1, 2, 6),
    # one exact zero (a zero-width bucket at 0, then an empty bucket up to the first edge).
    (step, h), = [x for x in log.histograms("layer-grad-histogram/layer_01") if x[0] == 3]
    assert list(h.bucket_limit) == pytest.approx([0.0, 1e-3, 1e-2, 1e-1, 1.0])
    assert list(h.bucket) == [1.0, 0.0, 1.0, 2.0, 6.0]
    assert h.num == 10 and h.min == 0.0 and h.max == 1.0

    # Tokens per expert of layer 2 at step 1: 12, 13, 14, 15 (exact min, max, sum).
    (_, v), = [x for x in log.histograms("layer-expert-tokens/layer_02") if x[0] == 1]
    assert (v.min, v.max, v.num, v.sum) == (12.0, 15.0, 4.0, 54.0)
    assert v.sum_squares == 12.0**2 + 13.0**2 + 14.0**2 + 15.0**2
    assert sum(v.bucket) == 4


def test_empty_and_all_nan_histograms_keep_the_step(run_info: RunInfo) -> None:
    sink = TensorBoardSink()
    sink.open(run_info)
    nan_hist = Histogram(edges=(0.1, 1.0), counts=(0,), nan=5, posinf=1)
    no_bins = Histogram(edges=(1.0,), counts=())
    sink.write(
        [
            MetricRecord("layer-grad-histogram", 7, nan_hist, labels=Labels(layer=0)),
            MetricRecord("layer-grad-histogram", 7, no_bins, labels=Labels(layer=1)),
            MetricRecord("layer-expert-tokens", 7, (math.nan, math.nan), labels=Labels(layer=0)),
            MetricRecord("layer-expert-tokens", 7, (), labels=Labels(layer=1)),
        ],
        7,
    )
    sink.close("failed")
    log = read_log(Path(run_info.dir) / "tb")
    for tag in ("layer-grad-histogram/layer_00", "layer-grad-histogram/layer_01",
                "layer-expert-tokens/layer_00", "layer-expert-tokens/layer_01"):
        (step, h), = log.histograms(tag)
        assert step == 7 and h.num == 0 and sum(h.bucket) == 0
    assert log.scalars("layer-grad-histogram/layer_00/nonfinite") == [(7, 6.0)]
    assert log.scalars("layer-expert-tokens/layer_00/nonfinite") == [(7, 2.0)]
    assert "layer-expert-tokens/layer_01/nonfinite" not in log.scalar_tags
    assert log.text("tmetrics/status").strip() == "failed"


def test_custom_scalars_layout_one_chart_per_metric_with_all_layers(run_info: RunInfo) -> None:
    _write_run(run_info)
    log = read_log(Path(run_info.dir) / "tb")
    charts = log.layout_charts()
    scalar_tags = sorted(log.scalar_tags)

    def lines(regexes: list[str]) -> list[str]:
        assert len(regexes) == 1
        return [t for t in scalar_tags if re.search(regexes[0], t)]

    assert set(charts) == {
        "global", "layer-grad-l2", "layer-expert-load-imbalance", "layer-grad-histogram",
        "tensor-grad-l2", "layer-router-expert-bias", "family-grad-l2", "layer-expert-tokens",
    }
    assert lines(charts["layer-grad-l2"]["layer-grad-l2 (all layers)"]) == [
        f"layer-grad-l2/layer_{i:02d}" for i in range(LAYERS)
    ]
    imbalance = charts["layer-expert-load-imbalance"]
    assert set(imbalance) == {"layer-expert-load-imbalance max_over_mean (all layers)",
                              "layer-expert-load-imbalance cv (all layers)"}
    assert lines(imbalance["layer-expert-load-imbalance cv (all layers)"]) == [
        f"layer-expert-load-imbalance/layer_{i:02d}/cv" for i in range(LAYERS)
    ]
    bias = charts["layer-router-expert-bias"]
    assert len(bias) == LAYERS  # one chart per layer, every expert on it
    assert lines(bias["layer-router-expert-bias layer_01"]) == [
        f"layer-router-expert-bias/layer_01/expert_{e:03d}" for e in range(EXPERTS)
    ]
    tokens = charts["layer-expert-tokens"]  # a vector per layer: one chart per layer, a line per expert
    assert lines(tokens["layer-expert-tokens layer_02"]) == [
        f"layer-expert-tokens/layer_02/expert_{e:03d}" for e in range(EXPERTS)
    ]
    tensor = charts["tensor-grad-l2"]
    assert lines(tensor["tensor-grad-l2 layers.*.attn.q.weight"]) == [
        f"tensor-grad-l2/layers.{i}.attn.q.weight" for i in range(LAYERS)
    ]
    assert lines(tensor["tensor-grad-l2 embed.weight"]) == ["tensor-grad-l2/embed.weight"]
    assert lines(charts["global"]["global-grad-l2"]) == ["global-grad-l2"]
    assert lines(charts["global"]["output-entropy"]) == ["output-entropy"]
    assert lines(charts["layer-grad-histogram"]["layer-grad-histogram nonfinite (all layers)"]) == [
        "layer-grad-histogram/layer_00/nonfinite"
    ]
    # Every scalar tag is on exactly one chart.
    regexes = [r for cat in charts.values() for chart in cat.values() for r in chart]
    for tag in scalar_tags:
        assert sum(1 for r in regexes if re.search(r, tag)) == 1, tag


def test_config_and_run_facts_as_text(run_info: RunInfo) -> None:
    _write_run(run_info)
    log = read_log(Path(run_info.dir) / "tb")
    config = log.text("tmetrics/config")
    assert "    run:\n      name: demo-run" in config
    assert "    - layer-grad-l2:1" in config
    facts = log.text("tmetrics/run")
    assert "model: TinyMoE" in facts and "name: demo-run" in facts


def test_log_dir_option_and_collision_writes_nothing(tmp_path: Path, run_info: RunInfo) -> None:
    sink = TensorBoardSink(log_dir=str(tmp_path / "elsewhere"))
    sink.open(run_info)
    sink.write([MetricRecord("tensor-grad-l2", 1, 1.0, labels=Labels(tensor="a*b"))], 1)
    with pytest.raises(ConfigError, match="tensor='a\\*b'.*tensor='a_b'"):
        sink.write([MetricRecord("global-grad-l2", 2, 5.0), MetricRecord("tensor-grad-l2", 2, 2.0, labels=Labels(tensor="a_b"))], 2)
    sink.close("finished")
    log = read_log(tmp_path / "elsewhere")
    assert log.scalar_tags == {"tensor-grad-l2/a_b"}
    assert log.scalars("tensor-grad-l2/a_b") == [(1, 1.0)]
    assert not (Path(run_info.dir) / "tb").exists()


def test_options_are_validated_without_touching_disk(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        TensorBoardSink(logdir="x")
    assert info.value.path == "sinks.tensorboard.logdir" and "log_dir" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TensorBoardSink(flush_secs=0)
    assert info.value.path == "sinks.tensorboard.flush_secs"
    with pytest.raises(ConfigError):
        TensorBoardSink(log_dir=3)
    TensorBoardSink(log_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert TensorBoardSink.key_rules is TENSORBOARD_RULES


def test_layout_for_expert_tensors_keeps_the_layer() -> None:
    from tmetrics_tb import ScalarLayout

    layout = ScalarLayout()
    for layer in range(2):
        for expert in range(3):
            assert layout.add("tensor-grad-l2", Labels(tensor=f"layers.{layer}.moe.experts.{expert}.up.weight")) == (expert == 0)
    charts = layout.categories["tensor-grad-l2"]
    assert charts == {
        "tensor-grad-l2 layers.0.moe.experts.*.up.weight": r"^tensor-grad-l2/layers\.0\.moe\.experts\.\d+\.up\.weight$",
        "tensor-grad-l2 layers.1.moe.experts.*.up.weight": r"^tensor-grad-l2/layers\.1\.moe\.experts\.\d+\.up\.weight$",
    }


def test_float32_edges_and_open_retry(run_info: RunInfo) -> None:
    sink = TensorBoardSink()
    sink.open(run_info)
    sink.open(run_info)  # the hub retries open after a failure: same event file
    values = {"a": 1e39, "b": -1e39, "c": 3, "d": 0.1, "e": -math.inf}
    sink.write([MetricRecord("tensor-param-l2", 4, v, labels=Labels(tensor=t)) for t, v in values.items()], 4)
    sink.close("finished")
    log_dir = Path(run_info.dir) / "tb" / "demo-run"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    log = read_log(log_dir)
    got = {tag.split("/")[1]: log.scalars(tag) for tag in log.scalar_tags}
    assert got == {"a": [(4, math.inf)], "b": [(4, -math.inf)], "c": [(4, 3.0)],
                   "d": [(4, pytest.approx(0.1, rel=1e-7))], "e": [(4, -math.inf)]}


def test_event_file_crc_matches_the_reference_and_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from tmetrics_tb import event_file

    # CRC-32C check value of "123456789" is 0xE3069283 (RFC 3720); masked as TFRecord does.
    crc = 0xE3069283
    assert event_file.masked_crc32c(b"123456789") == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
    for size in (0, 1, 7, 1000, 70_000):
        data = os.urandom(size)
        assert event_file.masked_crc32c(data) == reference(data)
    # Without google-crc32c, tensorboard's pure-Python CRC is used; the file reads back either way.
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

    monkeypatch.setattr(event_file, "_crc32c", crc32c)
    sink = TensorBoardSink(log_dir=tmp_path / "fallback")
    sink.open(RunInfo(name="x", dir=str(tmp_path)))
    sink.write([MetricRecord("layer-grad-l2", 1, 0.5, labels=Labels(layer=0))], 1)
    sink.close("finished")
    assert read_log(tmp_path / "fallback").scalars("layer-grad-l2/layer_00") == [(1, 0.5)]
