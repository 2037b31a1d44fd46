"""The user's own scalars (loss, learning rate) as records, for ``TensorMetrics.log``.

They reach every sink beside the layer metrics of the same step, so the loss and the per-layer
norms sit in one run of each tracker. Tensor values are read in one host copy per call (one
``torch.stack`` of the 0-dim or one-element tensors, then ``.cpu()``): a call with a GPU loss
waits for the device once, as ``loss.item()`` would.
"""

from __future__ import annotations

import numbers
from typing import Any, Collection, Mapping

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.records import MetricRecord

__all__ = ["scalar_records"]


def scalar_records(values: Mapping[str, Any], step: int, *, reserved: Collection[str]) -> list[MetricRecord]:
    """One global record per item of ``values``: ``MetricRecord(name, step, float(value))``.

    Args:
        values: name -> a Python number or a tensor holding one element (any dtype, any device).
        step: the step of every record.
        reserved: names the run's metrics already use (refused: their keys would collide).

    Raises:
        ConfigError: a name that is not a non-empty string or is a metric of the run; a value
            that is not a number or a one-element tensor (path ``log``).
    """
    numbers_in: dict[str, float] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"metrics.log: got the name {name!r}; need a non-empty string such as 'loss'", path="log")
        if name in reserved:
            raise ConfigError(f"metrics.log: {name!r} is a metric of this run; log your own value under another "
                              "name (e.g. 'train/loss')", path="log")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            tensors[name] = value.detach().reshape(())
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            numbers_in[name] = float(value)
        else:
            raise ConfigError(f"metrics.log: {name!r} = {value!r} ({type(value).__name__}); need a number or a "
                              "one-element tensor", path="log")
    if tensors:
        read = torch.stack(list(tensors.values())).cpu().to(torch.float64).tolist()
        numbers_in.update(zip(tensors, read))
    return [MetricRecord(name, step, numbers_in[name]) for name in values]
