"""StepRenderer: the one place records become keyed scalars, distributions and heatmaps."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_core.sinks.keys import MLFLOW_RULES, TENSORBOARD_RULES
from tmetrics_core.sinks.render import Heatmap, StepRenderer

LAYERS, EXPERTS = 3, 5
HOT = (1, 3)


def grid_records(step: int = 1) -> list[MetricRecord]:
    """Router bias per (layer, expert): 1.0, with 10.0 at HOT and NaN at (2, 0); tokens per
    expert of each layer as vectors, 100 at HOT."""
    out = []
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            value = 10.0 if (layer, expert) == HOT else math.nan if (layer, expert) == (2, 0) else 1.0
            out.append(MetricRecord("layer-router-expert-bias", step, value, Labels(layer=layer, expert=expert)))
        tokens = tuple(100.0 if (layer, e) == HOT else float(e) for e in range(EXPERTS))
        out.append(MetricRecord("layer-expert-tokens", step, tokens, Labels(layer=layer)))
    return out


def renderer(rules=TENSORBOARD_RULES, **options) -> StepRenderer:
    out = StepRenderer(rules, **options)
    out.open(RunInfo(name="r", dir=".", num_layers=LAYERS, num_experts=EXPERTS))
    return out


def test_nonfinite_counts_and_histogram_summaries_are_written_once() -> None:
    hist = Histogram(edges=(0.0, 1.0), counts=(3,), zeros=2, nan=1, posinf=1)
    records = [
        MetricRecord("g", 1, 2.5),
        MetricRecord("h", 1, hist, Labels(layer=0, stat="s")),
        MetricRecord("v", 1, (1.0, math.inf), Labels(layer=1, expert=2)),
    ]
    with_distributions = renderer(distributions=True).render(records)
    assert with_distributions.scalars == [
        ("g", 2.5), ("h/layer_00/s-nonfinite", 2.0),
        ("v/layer_01/expert_002/element_0", 1.0), ("v/layer_01/expert_002/element_1", math.inf),
        ("v/layer_01/expert_002/nonfinite", 1.0),
    ]
    assert [key for key, _ in with_distributions.distributions] == ["h/layer_00/s", "v/layer_01/expert_002"]
    summaries = renderer(MLFLOW_RULES, distributions=False).render(records)
    assert summaries.scalars[1:4] == [("h/layer_00/s-total", 7.0), ("h/layer_00/s-zeros", 2.0),
                                      ("h/layer_00/s-nonfinite", 2.0)]
    assert summaries.distributions == [] and len(summaries.scalars) == 6


def test_layer_by_expert_values_become_one_heatmap_per_metric() -> None:
    out = renderer(distributions=True, heatmaps=True, expert_scalars=False).render(grid_records())
    assert [key for key, _ in out.heatmaps] == ["layer-router-expert-bias/layer_x_expert",
                                                "layer-expert-tokens/layer_x_expert"]
    assert not any("expert_0" in key for key, _ in out.scalars)  # expert_scalars: false
    assert [key for key, _ in out.distributions] == [f"layer-expert-tokens/layer_{i:02d}" for i in range(LAYERS)]
    bias = out.heatmaps[0][1]
    assert bias.values.shape == (LAYERS, EXPERTS) and bias.present.all()
    assert bias.values[HOT] == 10.0 and math.isnan(bias.values[2, 0]) and bias.values[0, 0] == 1.0
    tokens = out.heatmaps[1][1]
    np.testing.assert_array_equal(tokens.values[0], np.arange(EXPERTS, dtype=float))
    assert tokens.values[HOT] == 100.0
    kept = renderer(distributions=True, heatmaps=True, expert_scalars=True).render(grid_records())
    assert len(kept.heatmaps) == 2
    assert dict(kept.scalars)["layer-router-expert-bias/layer_01/expert_003"] == 10.0
    assert dict(kept.scalars)["layer-expert-tokens/layer_01/expert_003"] == 100.0


def test_heatmap_figure_has_axes_colour_bar_title_and_marks_dead_experts() -> None:
    """Issue 35: the picture names its axes and ticks, shows its colour range, the metric and the
    step, grows with the grid, and marks experts that got no token."""
    from PIL import Image

    from tests.sinks.test_heatmaps import colour_bar_column

    values = np.array([[1.0, 2.0, np.nan], [0.0, 5.0, 3.0]])
    present = np.array([[True, True, True], [True, True, False]])
    heatmap = Heatmap("layer-expert-tokens", Labels(), values, present, step=40)
    image = heatmap.image()
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert colour_bar_column(image.astype(int)) is not None
    text = dict(Image.open(io.BytesIO(heatmap.png())).text)  # type: ignore[attr-defined]
    assert text["Title"] == "layer-expert-tokens, step 40"
    assert text["Description"] == ("2 layers (y axis, ticks 0..1) x 3 experts (x axis, ticks 0..2); colour bar viridis "
                                   "from 0 to 5; magenta NaN or infinite, black no value; dead experts marked: 1")
    assert (np.abs(image.astype(int) - (255, 0, 0)) < 40).all(axis=2).sum() > 20  # the red x of the dead expert
    assert "step 40: 2 layers (rows) x 3 experts (columns), min 0 max 5" in heatmap.caption()
    big = Heatmap("m", Labels(), np.zeros((64, 256)), np.ones((64, 256), dtype=bool)).image()
    assert big.shape[0] > 2 * image.shape[0] and big.shape[1] > 2 * image.shape[1]


def test_negative_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="indices must be >= 0"):
        renderer(distributions=True, heatmaps=True).render([MetricRecord("m", 1, 1.0, Labels(layer=-1, expert=0))])


def test_per_expert_scalars_by_default_up_to_256_cells() -> None:
    """Issue 35: a small grid (3 x 5 here) also keeps one series per expert, a line per expert in
    each layer's chart; 256 layers x experts is the most, beyond it only the heatmaps."""
    small = renderer(distributions=True, heatmaps=True).render(grid_records())
    assert len(small.heatmaps) == 2
    assert ("layer-router-expert-bias/layer_01/expert_003", 10.0) in small.scalars
    for layers, experts, kept in ((16, 16, True), (16, 17, False), (1, 257, False)):
        sized = StepRenderer(TENSORBOARD_RULES, distributions=True, heatmaps=True)
        sized.open(RunInfo(name="r", dir=".", num_layers=layers, num_experts=experts))
        assert sized.expert_scalars is kept, (layers, experts)
