"""Framework integrations: one module per framework, each importing its framework lazily (only
when the user's objects come from it), so tmetrics never needs a framework it is not used with.

- :mod:`tmetrics_core.integrations.megatron`: Megatron-Core (topology from its parallel state,
  placements from parameter attributes, global layer and expert ids, ``main_grad``, Megatron
  optimizers, router observation).
"""
