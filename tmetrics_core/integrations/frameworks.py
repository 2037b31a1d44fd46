"""Every :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` tmetrics knows, in the
order ``from_config`` consults them: wrappers first (accelerate, Lightning), then the frameworks
that state a topology (DeepSpeed's engine before Megatron's parallel state, torchtitan's
``ParallelDims`` and DTensor meshes after both), the model zoos, and last the run without a
framework, which always answers."""

from __future__ import annotations

from tmetrics_core.integrations.accelerate_adapter import Accelerate
from tmetrics_core.integrations.adapter import FrameworkAdapter
from tmetrics_core.integrations.deepspeed import DeepSpeed
from tmetrics_core.integrations.generic import Generic
from tmetrics_core.integrations.hf_adapter import HuggingFace
from tmetrics_core.integrations.lightning_adapter import Lightning
from tmetrics_core.integrations.megatron import Megatron
from tmetrics_core.integrations.torchtitan import Torchtitan

__all__ = ["FRAMEWORKS"]

FRAMEWORKS: tuple[FrameworkAdapter, ...] = (Accelerate(), Lightning(), DeepSpeed(), Megatron(), Torchtitan(),
                                            HuggingFace(), Generic())
"""The adapters, in order; a new framework adds its adapter here, before :class:`Generic`."""
