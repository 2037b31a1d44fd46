"""Framework integrations: one module per framework, each importing its framework lazily (only
when the user's objects come from it), so tmetrics never needs a framework it is not used with.

Each framework implements :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` (unwrap,
detect, topology, prepare: placements, offsets, optimizer, routers; the naming tables it brings),
and ``from_config`` consults :data:`~tmetrics_core.integrations.frameworks.FRAMEWORKS` in order;
the run without a framework is :mod:`tmetrics_core.integrations.generic`, last.

- :mod:`tmetrics_core.integrations.megatron`: Megatron-Core (topology from its parallel state,
  placements from parameter attributes, global layer and expert ids, ``main_grad``, Megatron
  optimizers, router observation), used by ``TensorMetrics.from_config`` with no argument.
- :mod:`tmetrics_core.integrations.torchtitan`: topology from ``ParallelDims`` or the
  parameters' meshes.
- :mod:`tmetrics_core.integrations.hf`: ``TMetricsCallback`` for the Hugging Face ``Trainer``;
  :mod:`tmetrics_core.integrations.lightning`: ``TMetricsCallback`` for a Lightning ``Trainer``;
  :mod:`tmetrics_core.integrations.accelerate`: ``attach(accelerator, model, optimizer, config)``.
  Each opens one step scope per optimizer step (across gradient accumulation) and reads the
  gradients before clipping, so ``global-grad-l2`` equals the total norm the framework clips by.
"""
