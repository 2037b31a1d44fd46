"""The forward (and backward) hooks of every token source the configured metrics read.

Installed once by :class:`~tmetrics_core.tensor_metrics.TensorMetrics` and kept until its
``close()``: on steps with no due metric of their kind they pass their tensors to
``tmetrics_core.observe``, which drops them; and a compiled model sees the same hooks on every
step (a hook added or removed is a recompile).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.observe import fail, fail_unless, record, record_attention, record_residual, tap
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.attention import install_inner_attention
from tmetrics_core.kinds import GRAD_KINDS, ROUTER_OUTPUT_KINDS, TOKEN_KINDS
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.padding import install_padding
from tmetrics_core.sources.routers import install as install_routers
from tmetrics_core.topology import Topology

__all__ = ["install_observation_hooks"]


def install_observation_hooks(model: torch.nn.Module, metrics: Sequence[TensorMetric], *, index: ModuleIndex,
                              routers: Sequence[Any], topology: Topology, modules: Mapping[str, Sequence[str]],
                              token_modules: Mapping[str, Sequence[str]], owner: int,
                              reporter: Reporter) -> list[Any]:
    """Hook every token source that ``metrics`` read; returns the handles (``.remove()`` each).

    Args:
        metrics: the configured metrics (those without a token source kind are passed over).
        index: the model's modules, blocks and head.
        routers: the model's MoE routers (:func:`~tmetrics_core.sources.routers.find_routers`).
        modules: metric name -> module globs of ``activation`` metrics.
        token_modules: metric name -> module globs of cotangent (``activation_grad``) metrics.
        owner: the number of the ``TensorMetrics`` whose observer takes these hooks' calls.
        reporter: says a padding mask's warnings on the logging rank.

    Raises:
        ConfigError: ``attn_qk`` read from a Hugging Face attention implementation it cannot reach.
    """
    token_metrics = [m for m in metrics if set(m.source_kinds) & TOKEN_KINDS]
    kinds = frozenset(k for m in token_metrics for k in m.source_kinds)
    # A metric built without modules: (layer-activation-rms) hooks its documented defaults.
    patterns = tuple(p for m in token_metrics for p in modules.get(m.name, getattr(m, "modules", ())))
    handles = index.install(functools.partial(record, owner=owner),
                            functools.partial(record_residual, owner=owner),
                            residual="residual_accumulator" in kinds,
                            contribution="residual_contribution" in kinds, logits="logits" in kinds,
                            patterns=patterns, tap=functools.partial(tap, owner=owner),
                            grads=kinds & GRAD_KINDS,
                            grad_patterns=tuple(p for m in token_metrics if "activation_grad" in m.source_kinds
                                                for p in token_modules.get(m.name, ())))
    if token_metrics:
        handles += install_padding(model, functools.partial(record, owner=owner), say=reporter.speaks)
    if routers and kinds & ROUTER_OUTPUT_KINDS:
        handles += install_routers(routers, functools.partial(record, owner=owner),
                                   functools.partial(fail, owner=owner), functools.partial(fail_unless, owner=owner),
                                   kinds)
    if "attn_qk" in kinds:
        # Hugging Face attention through its attention table (transformers imported lazily);
        # raises ConfigError for an implementation it cannot reach.
        from tmetrics_core.integrations.hf_attention import install as install_hf_attention

        handles += install_hf_attention(model, functools.partial(record_attention, owner=owner))
        tp = topology.axes.get("tp")
        handles += install_inner_attention(model, functools.partial(record_attention, owner=owner),
                                           heads_split=tp is not None and tp.size > 1)
    return handles
