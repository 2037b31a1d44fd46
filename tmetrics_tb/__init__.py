"""TensorBoard sink for tmetrics: scalars, histograms and a per-layer custom-scalars layout."""

from __future__ import annotations

from tmetrics_tb.layout import ScalarLayout
from tmetrics_tb.sink import TensorBoardSink

__all__ = [
    "ScalarLayout",
    "TensorBoardSink",
]
