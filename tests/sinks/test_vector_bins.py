"""The bins of a vector record that the TensorBoard and W&B sinks both draw."""

from __future__ import annotations

import math

from tmetrics_core.sinks.vector_bins import VECTOR_BINS, vector_bins


def test_finite_elements_in_up_to_thirty_equal_bins():
    values = [float(v) for v in range(100)] + [math.nan, math.inf, -math.inf]
    bins = vector_bins(values)
    assert bins is not None and VECTOR_BINS == 30
    assert bins.finite.tolist() == [float(v) for v in range(100)]
    assert len(bins.counts) == 30 and int(bins.counts.sum()) == 100
    assert bins.edges[0] == 0.0 and bins.edges[-1] == 99.0
    widths = set((bins.edges[1:] - bins.edges[:-1]).round(12).tolist())
    assert widths == {round(99 / 30, 12)}
    assert bins.counts.tolist()[:3] == [4, 3, 3]  # [0, 3.3): 0..3, [3.3, 6.6): 4..6, [6.6, 9.9): 7..9


def test_fewer_elements_than_bins_and_none_finite():
    bins = vector_bins([2.0, 5.0, 5.0])
    assert bins is not None and bins.counts.tolist() == [1, 0, 2] and bins.edges.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert vector_bins([math.nan, math.inf]) is None and vector_bins([]) is None
