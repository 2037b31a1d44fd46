"""The bins of a vector record (tokens per expert of a layer), as the tracker sinks draw it.

A vector has no bins of its own (a :class:`~tmetrics_core.records.Histogram` record does): the
TensorBoard and W&B sinks each draw its finite elements as a histogram of up to
:data:`VECTOR_BINS` equal-width bins over their range (``numpy.histogram``), built here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["VECTOR_BINS", "VectorBins", "vector_bins"]

VECTOR_BINS = 30
"""The most bins of a vector's histogram (fewer when it has fewer finite elements)."""


@dataclass(frozen=True, slots=True)
class VectorBins:
    """A vector's finite elements and their histogram.

    Attributes:
        finite: the finite elements, float64, in record order (for exact min, max, sum).
        counts: elements per bin, int64, ``min(VECTOR_BINS, finite.size)`` bins.
        edges: the bins' edges, float64, one more than ``counts``; the last bin is closed.
    """

    finite: npt.NDArray[np.float64]
    counts: npt.NDArray[np.int64]
    edges: npt.NDArray[np.float64]


def vector_bins(values: Sequence[float]) -> VectorBins | None:
    """The histogram of the finite elements of ``values`` (NaN and ±Inf left out: the sinks
    count them apart), or None when none is finite."""
    array = np.asarray(values, dtype=np.float64)
    finite = array[np.isfinite(array)]
    if finite.size == 0:
        return None
    counts, edges = np.histogram(finite, bins=min(VECTOR_BINS, finite.size))
    return VectorBins(finite, counts, edges)
