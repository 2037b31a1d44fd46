"""Weights & Biases sink for tmetrics: sections per metric family, histograms, layer heatmaps."""

from __future__ import annotations

from tmetrics_wandb.heatmap import LayerHeatmap
from tmetrics_wandb.sink import STEP_KEY, WandbSink

__all__ = [
    "LayerHeatmap",
    "STEP_KEY",
    "WandbSink",
]
