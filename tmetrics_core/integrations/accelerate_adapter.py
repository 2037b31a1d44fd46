"""The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of Hugging Face accelerate:
the torch optimizer inside ``AcceleratedOptimizer`` wrappers (:func:`unwrap_accelerated`), so
tmetrics hooks the torch optimizer's own ``step()`` (or DeepSpeed's optimizer, which the
DeepSpeed adapter then detects). Used by :mod:`tmetrics_core.integrations.accelerate` and the
Hugging Face ``Trainer`` callback, and by ``from_config`` given an ``AcceleratedOptimizer``.
"""

from __future__ import annotations

import sys
from typing import Any

from tmetrics_core.integrations.adapter import BaseAdapter

__all__ = ["Accelerate", "unwrap_accelerated"]


def unwrap_accelerated(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers (its ``.optimizer``);
    any other optimizer as it is (accelerate is imported only when the user did)."""
    module = sys.modules.get("accelerate.optimizer")
    wrapper = getattr(module, "AcceleratedOptimizer", None)
    while wrapper is not None and isinstance(optimizer, wrapper):
        optimizer = optimizer.optimizer
    return optimizer


class Accelerate(BaseAdapter):
    """Unwraps an ``AcceleratedOptimizer``; states no topology (multi-process accelerate runs
    DDP: :func:`~tmetrics_core.integrations.accelerate.attach` passes ``{"dp": WORLD}``),
    placements or offsets."""

    name = "accelerate"

    def unwrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        return model, unwrap_accelerated(optimizer)
