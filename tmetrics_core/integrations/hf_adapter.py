"""The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of Hugging Face
``transformers`` models: their parameters are named by the ``hf`` naming tables
(:mod:`tmetrics_core.naming.layouts.hf`), their routers observed as every framework's
(:mod:`tmetrics_core.sources.routers`); model and optimizer are read as given (the ``Trainer``'s
optimizer is unwrapped by the accelerate adapter). The ``Trainer`` callback is
:mod:`tmetrics_core.integrations.hf`.
"""

from __future__ import annotations

from typing import Any, Mapping

from tmetrics_core.integrations.adapter import Prepared
from tmetrics_core.topology import Topology

__all__ = ["HuggingFace"]


class HuggingFace:
    """Detected for a ``transformers`` ``PreTrainedModel`` (by class name and module, so
    transformers is not imported); states no topology, placements or offsets."""

    name = "transformers"
    layouts: tuple[str, ...] = ("hf", "hf-gpt2", "hf-gpt-oss", "hf-switch")

    def unwrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        return model, optimizer

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                   for c in type(model).__mro__)

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        return None

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        return Prepared(model=model, optimizer=optimizer)
