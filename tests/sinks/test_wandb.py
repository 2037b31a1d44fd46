from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.sinks.conftest import LAYERS, make_records
from tests.sinks.readback_wandb import find_run_file, read_run
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import WANDB_RULES, KeyBook
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_wandb import STEP_KEY, LayerHeatmap, WandbSink

_WANDB_DIRS = ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "WANDB_DIR")


@pytest.fixture(autouse=True)
def clean_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME without W&B credentials and no WANDB_* directories set; restored afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in (*_WANDB_DIRS, "WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home


def _logged_steps(run) -> list[int]:
    return [row[STEP_KEY] for row in run.history]


def test_roundtrip_every_step_value_histogram_and_definition(run_info: RunInfo, clean_home: Path) -> None:
    sink = WandbSink(heatmap_every=2, tags=["smoke"], expert_scalars=True)  # mode unset and no API key: offline
    sink.open(run_info)
    sink.log_config(run_info.config)
    for step in range(1, 6):
        sink.write(make_records(step), step)
    sink.close("finished")

    run = read_run(find_run_file(Path(run_info.dir) / "wandb"))
    # One row per write, plus the final heatmaps at close (same step as the last write).
    assert _logged_steps(run) == [1, 2, 3, 4, 5, 5]
    assert [row["_step"] for row in run.history] == list(range(6))
    assert run.exit_code == 0
    assert run.run.display_name == "demo-run" and run.run.project == "tmetrics"
    assert set(run.run.tags) == {"smoke", "dp=2", "tp=1", "model=TinyMoE"}
    assert run.config["metrics"] == ["layer-grad-l2:1"] and run.config["run"] == {"name": "demo-run"}
    definitions = {(m.name, m.glob_name, m.step_metric) for m in run.metrics}
    assert ("tmetrics/step", "", "") in definitions and ("", "*", STEP_KEY) in definitions

    for step, row in zip(range(1, 6), run.history):
        for record in make_records(step):
            key = KeyBook(WANDB_RULES).add(record.metric, record.labels)
            if record.kind == "scalar":
                value = row[key]
                assert (math.isnan(value) and math.isnan(record.value)) or value == record.value, key  # type: ignore[arg-type]
            elif record.kind == "vector":
                for labels, element in record.elements():  # one scalar per expert as well
                    assert row[KeyBook(WANDB_RULES).add(record.metric, labels)] == element
                assert row[key]["_type"] == "histogram"
                assert sum(row[key]["values"]) == len(record.value)  # type: ignore[arg-type]
                assert min(row[key]["bins"]) == min(record.value) and max(row[key]["bins"]) == max(record.value)  # type: ignore[type-var]
            else:
                # edges (1e-3, 1e-2, 1e-1, 1) with counts (i, 2, 3 + step), one exact zero in [0, 1e-3)
                layer = record.layer
                assert row[key] == {"_type": "histogram", "bins": [0.0, 1e-3, 1e-2, 1e-1, 1.0],
                                    "values": [1, layer, 2, 3 + step]}
        assert row["layer-grad-histogram/layer_00/nonfinite"] == 1
        assert "layer-grad-histogram/layer_01/nonfinite" not in row
        # W&B sections are the text before the first "/": the metric family.
        assert "layer-expert-load-imbalance/layer_02/max_over_mean" in row

    heatmap_rows = [(row[STEP_KEY], sorted(k for k in row if k.endswith("heatmap"))) for row in run.history]
    expected_images = ["layer-expert-load-imbalance/cv-heatmap", "layer-expert-load-imbalance/max_over_mean-heatmap",
                       "layer-grad-l2/heatmap"]
    assert [s for s, keys in heatmap_rows if keys] == [2, 4, 5]
    assert all(keys == expected_images for _, keys in heatmap_rows if keys)
    image = run.history[1]["layer-grad-l2/heatmap"]
    assert image["_type"] == "image-file" and image["width"] > 100 and image["height"] > 100
    files = list(find_run_file(Path(run_info.dir) / "wandb").parent.rglob("*.png"))
    grids = [f for f in files if "layer_x_expert" in f.name]
    assert len(files) - len(grids) == 9  # three layer x step images at each of steps 2, 4 and the close
    assert len(grids) == 2 * 5  # tokens and router bias: a layer x expert image at every step
    # Nothing of W&B's landed in HOME (matplotlib keeps its own font cache there).
    # (Where W&B's own cache lands depends on what an earlier W&B import in this process read;
    # the guarantee is only that it is not HOME.)
    assert [p for p in clean_home.rglob("*") if "wandb" in p.name] == []


def test_late_and_repeated_steps_are_kept(run_info: RunInfo) -> None:
    sink = WandbSink(mode="offline", heatmap_every=0, dir=str(Path(run_info.dir) / "elsewhere"))
    sink.open(run_info)
    for step, value in ((5, 1.0), (6, 2.0), (3, 3.0), (6, 4.0)):
        sink.write([MetricRecord("global-grad-l2", step, value)], step)
    sink.close("failed")
    run = read_run(find_run_file(Path(run_info.dir) / "elsewhere"))
    assert run.column("global-grad-l2") == [(5, 1.0), (6, 2.0), (3, 3.0), (6, 4.0)]
    assert [row["_step"] for row in run.history] == [0, 1, 2, 3]
    assert run.exit_code == 1
    assert not any("heatmap" in key for row in run.history for key in row)


def test_nonfinite_and_empty_values_do_not_break_histograms(run_info: RunInfo) -> None:
    sink = WandbSink(mode="offline", heatmap_every=0)
    sink.open(run_info)
    records = [
        MetricRecord("layer-grad-histogram", 1, Histogram(edges=(0.1, 1.0), counts=(0,), nan=2, neginf=1), labels=Labels(layer=0)),
        MetricRecord("layer-grad-histogram", 1, Histogram(edges=(-1.0, 0.0, 1.0), counts=(4, 5), zeros=3), labels=Labels(layer=1)),
        MetricRecord("layer-grad-histogram", 1, Histogram(edges=(1.0,), counts=(), zeros=2), labels=Labels(layer=2)),
        MetricRecord("layer-expert-tokens", 1, (1.0, math.nan, math.inf, 3.0), labels=Labels(layer=0)),
        MetricRecord("layer-expert-tokens", 1, (math.nan,), labels=Labels(layer=1)),
    ]
    sink.write(records, 1)
    sink.close("killed")
    (row,) = read_run(find_run_file(Path(run_info.dir) / "wandb")).history
    assert row["layer-grad-histogram/layer_00"]["values"] == [0]
    assert row["layer-grad-histogram/layer_00/nonfinite"] == 3
    assert row["layer-grad-histogram/layer_01"]["values"] == [4, 8]  # zeros join the bin [0, 1)
    assert row["layer-grad-histogram/layer_02"] == {"_type": "histogram", "bins": [0.0, 1.0], "values": [2]}
    tokens = row["layer-expert-tokens/layer_00"]
    assert sum(tokens["values"]) == 2 and tokens["bins"][0] == 1.0 and tokens["bins"][-1] == 3.0
    assert row["layer-expert-tokens/layer_00/nonfinite"] == 2
    assert sum(row["layer-expert-tokens/layer_01"]["values"]) == 0
    assert row["layer-expert-tokens/layer_01/nonfinite"] == 1


def test_options_are_validated_without_touching_backend(tmp_path: Path) -> None:
    cases = {
        "colour": {"colour": "red"},
        "mode": {"mode": "online-ish"},
        "tags": {"tags": "one"},
        "heatmap_every": {"heatmap_every": -1},
        "project": {"project": ""},
        "heatmap_metrics": {"heatmap_metrics": "layer-grad-l2"},
    }
    for option, kwargs in cases.items():
        with pytest.raises(ConfigError) as info:
            WandbSink(**kwargs)
        assert info.value.path == f"sinks.wandb.{option}"
    with pytest.raises(ConfigError, match="online, offline, disabled"):
        WandbSink(mode="cloud")
    sink = WandbSink(dir=str(tmp_path / "never"), mode="offline")
    assert not (tmp_path / "never").exists()
    with pytest.raises(RuntimeError, match="not open"):
        sink.write([], 1)
    assert WandbSink.key_rules is WANDB_RULES


def test_layer_heatmap_matrix_thinning_and_image() -> None:
    heatmap = LayerHeatmap("layer-grad-l2", max_columns=4)
    for step in range(1, 7):
        for layer in range(LAYERS):
            if (step, layer) != (2, 1):
                heatmap.add(step, layer, 10.0 * step + layer)
    values, steps = heatmap.matrix()
    # 6 steps > 4 columns: after step 5 the columns were thinned to 1, 3, 5, then 6 arrived.
    assert steps == [1, 3, 5, 6]
    assert values.shape == (LAYERS, 4)
    assert values[:, 0].tolist() == [10.0, 11.0, 12.0] and values[2, 3] == 62.0
    assert not heatmap.changed
    heatmap.add(6, 0, math.inf)
    assert heatmap.changed
    image = heatmap.image()
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 10  # drawn, not blank
    with pytest.raises(ValueError):
        LayerHeatmap("x", max_columns=1)
