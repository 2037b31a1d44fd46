"""Ready-made hook-ups of :class:`~tmetrics_core.tensor_metrics.TensorMetrics` to training frameworks.

One module per framework, each importing its framework only when used:

- :mod:`tmetrics_core.integrations.hf`: ``TMetricsCallback`` for the Hugging Face ``Trainer``;
- :mod:`tmetrics_core.integrations.lightning`: ``TMetricsCallback`` for a Lightning ``Trainer``;
- :mod:`tmetrics_core.integrations.accelerate`: ``attach(accelerator, model, optimizer, config)``.

Each opens one step scope per optimizer step (across gradient accumulation) and reads the
gradients before clipping, so ``global-grad-l2`` equals the total norm the framework clips by.
"""
