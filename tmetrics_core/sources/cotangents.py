"""Cotangent sources: the scale that makes a local cotangent the optimizer's.

A backward pass on one rank differentiates that rank's loss. The optimizer applies the gradient
of another loss: the data-parallel gradient reduction (DDP, FSDP2 and HSDP average over the
ranks that see different data) divides by their number, and a loss scaler (``GradScaler``)
multiplies the loss by its scale before backward and divides the gradients after. So the
cotangent of the applied loss at an activation is the local one divided by both::

    g = g_local / (D * S)     D = ranks averaged over (product of the data-parallel axes' sizes)
                              S = the loss scale in force (1 without a scaler)

Micro-batches add up as gradients do: each micro-batch's cotangents are observed as tokens of
the step, so a sum of squares over the step is that of the concatenated global batch when
each micro-batch's loss is scaled by 1/(micro-batches), as gradient accumulation does. With
this, records of one global batch are equal on one rank and on any data, tensor, sequence or
pipeline parallel layout (``docs/backward.md``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from tmetrics_core.topology import Topology

__all__ = ["CotangentScale", "data_parallel_divisor", "grad_scaler_scale"]

LossScale = Callable[[], "torch.Tensor | float | None"]
"""Returns the loss scale in force (a 0-d tensor, a number, or None for no scaling)."""


def data_parallel_divisor(topology: Topology) -> int:
    """The number of ranks whose gradients the data-parallel reduction averages: the product
    of the sizes of the population axes (``dp``, ``fsdp``, ``cp``, ``ep``...: ranks that see
    different tokens), less an axis whose ranks all lie in another such axis's group
    (torchtitan's ``ep`` or ``efsdp`` inside ``fsdp``), which would count them twice."""
    spans = {a: frozenset(topology.axes[a].ranks) for a in topology.population_axes}
    inner = {a for a in spans if any(b != a and spans[a] < spans[b] for b in spans)}
    return math.prod(topology.axes[a].size for a in topology.population_axes if a not in inner)


def grad_scaler_scale(scaler: Any) -> LossScale:
    """The :data:`LossScale` of a ``torch.amp.GradScaler``: its scale tensor while enabled
    (read without a host sync), None when disabled or before its first ``scale()``."""
    def scale() -> torch.Tensor | None:
        return getattr(scaler, "_scale", None) if scaler.is_enabled() else None
    return scale


class CotangentScale:
    """The factor ``1 / (D * S)`` of one step (see the module doc), per device.

    Args:
        divisor: ``D``, from :func:`data_parallel_divisor`.
        loss_scale: ``S`` read at the step's first cotangent, or None for no loss scaling.
    """

    def __init__(self, divisor: int, loss_scale: LossScale | None) -> None:
        self.divisor = divisor
        self.loss_scale = loss_scale
        self._factors: dict[torch.device, float | torch.Tensor | None] = {}

    def factor(self, grad: torch.Tensor) -> float | torch.Tensor | None:
        """What to multiply a cotangent on ``grad``'s device by: a float, a 0-d float32 tensor
        on that device (a scale tensor: no host sync), or None when it is 1."""
        device = grad.device
        if device in self._factors:
            return self._factors[device]
        scale = self.loss_scale() if self.loss_scale is not None else None
        factor: float | torch.Tensor | None
        if scale is None:
            factor = None if self.divisor == 1 else 1.0 / self.divisor
        elif isinstance(scale, torch.Tensor):
            factor = scale.detach().to(device, torch.float32).reshape(()).mul(self.divisor).reciprocal()
        else:
            factor = 1.0 / (self.divisor * float(scale))
        self._factors[device] = factor
        return factor
