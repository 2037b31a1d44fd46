"""The step scope's jobs, one file each, that :class:`~tmetrics_core.tensor_metrics.TensorMetrics`
inherits or calls (see docs/architecture.md)."""
