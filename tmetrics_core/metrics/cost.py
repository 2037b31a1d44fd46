"""What a catalogue metric costs, relative to the others: one class per mechanism.

The class is read from the metric itself (its statistics and source kinds), so a new metric gets
one without a table to keep. Measured on the demo model (``python -m bench.step_overhead
--bundle ...``): the standard bundle, all ``shared-read`` and ``own-pass`` metrics, costs about
6% of a step; ``layer-grad-histogram`` alone cost +100% (24 ms on a 24 ms step) while it binned
one tensor at a time, and now bins every tensor of a due step in one batched pass.
"""

from __future__ import annotations

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.sketches import LogHistogram

__all__ = ["COST_CLASSES", "cost_class"]

COST_CLASSES = {
    "shared-read": "derived from the one batched rows pass over the tensors that such metrics share (sum of "
                   "squares, sum, max, min, zeros): several cost about one",
    "own-pass": "one more batched pass over the chosen tensors' elements (row norms, softmax rows, expert "
                "counts, router sums): a fixed number of ops per due step",
    "binning": "a binning pass over every element (searchsorted on the log2 bin edges, batched per 2**22 "
               "elements): several times a shared read per element, the dearest per element",
    "snapshot": "a copy of the chosen parameters before the optimizer step (one parameter copy of memory)",
    "sampled": "fingerprints and a sampled exchange of elements across data-parallel replicas",
}
"""Each cost class, cheapest first, with what it costs."""


def cost_class(metric: TensorMetric) -> str:
    """The key of :data:`COST_CLASSES` that describes ``metric``."""
    statistics = tuple(getattr(metric, "statistics", ()))
    if any(isinstance(s, LogHistogram) for s in statistics):
        return "binning"
    if "update" in metric.source_kinds:
        return "snapshot"
    if metric.name == "dp-replica-drift":
        return "sampled"
    if statistics and all(s.reads or not s.elements for s in statistics):
        return "shared-read"
    return "own-pass"
