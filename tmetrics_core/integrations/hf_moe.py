"""Hugging Face ``transformers`` MoE models: their routers, recognised with no user code.

transformers 5.x gives every MoE family a router module of its own (``MixtralTopKRouter``,
``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``DeepseekV3TopkRouter``,
``GptOssTopKRouter``) whose forward returns ``(router_logits [tokens, E], top-k weights
[tokens, k], top-k expert ids [tokens, k])``: the logits and the ids are observed from that
output, so the counts are the model's own choices (DeepSeek-V3's group-limited, bias-corrected
choice included). transformers 4.x computes the choice inside the MoE block from an
``nn.Linear`` gate (``block_sparse_moe.gate`` in Mixtral, ``mlp.gate`` in Qwen2-MoE, Qwen3-MoE,
OLMoE): only its logits are observed there; the top-k choices of a 4.x block are not (they
never leave the block's forward), so tokens-per-expert metrics need ``tm.observe`` on 4.x.

The expert count and ``k`` come from the model's config (``num_local_experts``,
``num_experts`` or ``n_routed_experts``; ``num_experts_per_tok``) and every observed output is
checked against them (see `tmetrics_core.sources.routers`).
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.routers import Router

__all__ = ["expert_count", "find_routers"]

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count(config: Any) -> tuple[int, int] | None:
    """``(experts, k)`` of a transformers config (its text config for multimodal ones), or None
    for a dense model."""
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is None:
            continue
        experts = next((getattr(candidate, k) for k in _EXPERT_KEYS
                        if isinstance(getattr(candidate, k, None), int) and getattr(candidate, k) > 0), None)
        k = getattr(candidate, "num_experts_per_tok", None)
        if experts is not None and isinstance(k, int) and k > 0:
            return experts, k
    return None


def find_routers(model: torch.nn.Module, index: ModuleIndex) -> list[Router]:
    """The routers of a transformers MoE model (none for a dense one), in module order."""
    config = next((m.config for _, m in index.named if _is_config(getattr(m, "config", None))), None)
    counts = expert_count(config) if config is not None else None
    if counts is None:
        return []
    experts, k = counts
    parents = _parents(model)
    found = []
    for path, module in index.named:
        parent = parents.get(id(module))
        if parent is None:
            continue
        if _is_router_module(module, experts):
            found.append(Router(path, module, parent, experts, k, _tuple_output))
        elif (isinstance(module, torch.nn.Linear) and path.rpartition(".")[2] == "gate"
              and module.out_features == experts and isinstance(getattr(parent, "experts", None), torch.nn.ModuleList)):
            found.append(Router(path, module, parent, experts, k, _logits_only))
    return found


def _is_config(value: Any) -> bool:
    if value is None:
        return False
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _is_router_module(module: torch.nn.Module, experts: int) -> bool:
    """A transformers 5.x router: its own class (named ``...Router``) in a ``transformers``
    module, holding a ``[E, hidden]`` weight and ``top_k``."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (cls.__module__.startswith("transformers.") and cls.__name__.lower().endswith("router")
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == experts
            and isinstance(getattr(module, "top_k", None), int))


def _parents(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    out: dict[int, torch.nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            out.setdefault(id(child), parent)
    return out


def _tuple_output(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if isinstance(out, (tuple, list)) and len(out) == 3:
        return out[0], out[2]
    return out, None  # checked against the config by the hook: a tensor of other width fails


def _logits_only(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return out, None
