"""The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of Hugging Face
``transformers`` models: their parameters are named by the ``hf`` naming tables
(:mod:`tmetrics_core.naming.layouts.hf`), their routers observed as every framework's
(:mod:`tmetrics_core.sources.routers`); model and optimizer are read as given (the ``Trainer``'s
optimizer is unwrapped by the accelerate adapter). The ``Trainer`` callback is
:mod:`tmetrics_core.integrations.hf`.
"""

from __future__ import annotations

from typing import Any

from tmetrics_core.integrations.adapter import BaseAdapter

__all__ = ["HuggingFace"]


class HuggingFace(BaseAdapter):
    """Detected for a ``transformers`` ``PreTrainedModel`` (by class name and module, so
    transformers is not imported); states no topology, placements or offsets."""

    name = "transformers"
    layouts: tuple[str, ...] = ("hf", "hf-gpt2", "hf-gpt-oss", "hf-switch")

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                   for c in type(model).__mro__)
