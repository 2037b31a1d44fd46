"""The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of Lightning: a
``LightningModule`` is measured as the network it keeps (:func:`measured_model`), whether the
callback (:mod:`tmetrics_core.integrations.lightning`) or the user hands it to ``from_config``.
Lightning is not imported here: a module is recognised by its classes' names and modules.
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.integrations.adapter import BaseAdapter

__all__ = ["Lightning", "measured_model"]


def _is_lightning_module(model: Any) -> bool:
    return any(c.__name__ == "LightningModule" and c.__module__.startswith(("lightning.", "pytorch_lightning."))
               for c in type(model).__mro__)


def measured_model(pl_module: torch.nn.Module) -> torch.nn.Module:
    """The module tmetrics names: the LightningModule's one child when that child holds every
    parameter (``self.net = LlamaForCausalLM(...)``), so tensors get the model's own canonical
    names (``layers.0.attn.q.weight``, not a path under ``net.``); else the LightningModule."""
    if any(True for _ in pl_module.parameters(recurse=False)):
        return pl_module
    holders = [child for child in pl_module.children() if any(True for _ in child.parameters())]
    return holders[0] if len(holders) == 1 else pl_module


class Lightning(BaseAdapter):
    """Unwraps a ``LightningModule`` (:func:`measured_model`); states no topology (the callback
    passes ``{"dp": WORLD}`` under DDP), placements or offsets."""

    name = "lightning"

    def unwrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        return (measured_model(model) if _is_lightning_module(model) else model), optimizer
