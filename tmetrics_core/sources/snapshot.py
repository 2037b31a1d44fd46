"""The update snapshot: the local parameters as they were before the optimizer step.

Update metrics read ``p - snapshot`` after the step, and metrics of parameters alone read the
snapshot itself when an update metric is due (see ``TensorMetrics``). :func:`snapshot` copies the
chosen parameters with one batched torch kernel, on any device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.sources.params import local_view
from tmetrics_core import torch_private

__all__ = ["Snapshot", "snapshot"]

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


class Snapshot(dict[str, torch.Tensor]):
    """``parameter name -> copy`` of its local tensor (as its manifest entry reads it: an expert
    slice's view) before the optimizer step, shaped and typed as the tensor was."""


@torch.no_grad()
def snapshot(manifest: Manifest, names: Sequence[str] | None = None) -> Snapshot:
    """Copies of the local parameters (for updates), only of ``names`` when given (in that
    order; names without a local parameter are skipped), else of all in manifest order: one
    batched torch kernel (``x * 1.0`` is exact for every value: -0.0, NaN, inf)."""
    views = manifest.views
    local = manifest.local
    chosen = list(local) if names is None else list(filter(local.__contains__, names))  # C-level, per due step
    # local_view of a parameter (never None) is a tensor; a plain parameter is itself.
    tensors: list[torch.Tensor] = list(map(local.__getitem__, chosen))
    if not set(map(type, tensors)) <= _PLAIN:
        tensors = list(map(local_view, tensors))
    if views:
        tensors = [manifest.viewed(n, t) for n, t in zip(chosen, tensors)]
    copies = torch_private.foreach_mul(tensors, 1.0) if tensors else []
    return Snapshot(zip(chosen, copies))
