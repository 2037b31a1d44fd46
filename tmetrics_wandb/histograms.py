"""Histograms in W&B's form (``np_histogram``: counts and bin edges) for the W&B sink.

A :class:`~tmetrics_core.records.Histogram` record keeps its exact zeros apart from its bins;
W&B has no such slot, so they join the bin holding 0 (or a bin of their own next to the edges).
"""

from __future__ import annotations

from typing import Any

from tmetrics_core.records import Histogram
from tmetrics_core.sinks.vector_bins import vector_bins

__all__ = ["bins_with_zeros", "vector_histogram"]


def bins_with_zeros(hist: Histogram) -> tuple[list[int], list[float]]:
    """``(counts, edges)`` for ``np_histogram``: the bins, with the exact zeros added to the bin
    holding 0, or to an extra bin between 0 and the nearest edge."""
    edges = list(hist.edges)
    counts = list(hist.counts)
    if not counts:
        top = edges[0] if edges and edges[0] > 0.0 else 1.0
        return [hist.zeros], [0.0, top]
    if hist.zeros:
        inside = [i for i in range(len(counts)) if edges[i] <= 0.0 < edges[i + 1]]
        if inside:
            counts[inside[0]] += hist.zeros
        elif 0.0 < edges[0]:
            edges, counts = [0.0, *edges], [hist.zeros, *counts]
        elif edges[-1] < 0.0:
            edges, counts = [*edges, 0.0], [*counts, hist.zeros]
        else:  # the last edge is exactly 0
            counts[-1] += hist.zeros
    return counts, edges


def vector_histogram(wandb: Any, values: tuple[float, ...]) -> Any:
    """A ``wandb.Histogram`` of a vector's finite values (tokens per expert): their bins
    (:func:`~tmetrics_core.sinks.vector_bins.vector_bins`); one empty bin when none is finite."""
    bins = vector_bins(values)
    if bins is None:
        return wandb.Histogram(np_histogram=([0], [0.0, 1.0]))
    return wandb.Histogram(np_histogram=(bins.counts.tolist(), bins.edges.tolist()))
