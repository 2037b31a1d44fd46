"""Attention vectors over global heads (stat ``heads``) drawn as layer x head heatmaps, with their
per-layer roll-ups as scalars; read back from TensorBoard's event file too."""

from __future__ import annotations

import math
from pathlib import Path

from tests.sinks.readback_tensorboard import read_log
from tmetrics_core.records import Labels, MetricRecord, RunInfo
from tmetrics_core.sinks.keys import TENSORBOARD_RULES
from tmetrics_core.sinks.render import StepRenderer

LAYERS, HEADS = 3, 4


def _records(step: int = 1) -> list[MetricRecord]:
    out = []
    for layer in range(LAYERS):
        heads = tuple(math.nan if (layer, h) == (1, 2) else float(10 * layer + h) for h in range(HEADS))
        out.append(MetricRecord("layer-attn-entropy", step, heads, Labels(layer=layer, stat="heads")))
        out.append(MetricRecord("layer-attn-entropy", step, 1.5, Labels(layer=layer, stat="mean")))
    return out


def _renderer(**options) -> StepRenderer:
    out = StepRenderer(TENSORBOARD_RULES, distributions=False, **options)
    out.open(RunInfo(name="r", dir=".", num_layers=LAYERS, num_experts=8))  # experts do not size head grids
    return out


def test_heads_become_one_layer_by_head_heatmap_and_rollups_stay_scalars():
    rendered = _renderer(heatmaps=True, expert_scalars=False).render(_records())
    [(key, heatmap)] = rendered.heatmaps
    assert key == "layer-attn-entropy/layer_x_head"
    assert heatmap.values.shape == (LAYERS, HEADS) and heatmap.present.all()
    assert heatmap.values[2, 3] == 23.0 and math.isnan(heatmap.values[1, 2])
    assert "3 layers (rows) x 4 heads (columns)" in heatmap.caption()
    assert [k for k, _ in rendered.scalars] == [f"layer-attn-entropy/layer_{i:02d}/mean" for i in range(LAYERS)]


def test_without_heatmaps_each_head_is_a_series_not_an_expert():
    rendered = _renderer().render(_records())
    keys = [k for k, _ in rendered.scalars]
    assert "layer-attn-entropy/layer_02/head_3" in keys and not any("expert" in k for k in keys)


def test_tensorboard_draws_the_head_heatmap(tmp_path: Path):
    from tmetrics_tb import TensorBoardSink

    sink = TensorBoardSink()
    sink.open(RunInfo(name="heads", dir=str(tmp_path / "run"), num_layers=LAYERS))
    sink.write(_records(), 1)
    sink.close("finished")
    log = read_log(tmp_path / "run" / "tb")
    assert log.image_tags == {"layer-attn-entropy/layer_x_head"}
    [(step, height, width, _)] = log.images("layer-attn-entropy/layer_x_head")
    assert step == 1 and height > LAYERS * 16 and width > HEADS * 16  # a figure: axes, ticks, colour bar
    assert {f"layer-attn-entropy/layer_{i:02d}/mean" for i in range(LAYERS)} <= log.scalar_tags

