"""Router sources found in the model: MoE router logits and top-k choices with no user code.

A framework integration recognises its router modules (``tmetrics_core.integrations.hf_moe``
for Hugging Face ``transformers``) and says, for each, how to read its forward output. On a
run configured with a metric reading ``router_logits`` or ``router_topk``, :func:`install` puts
one forward hook on each router (kept, like every module-side source); on a due step each call
observes the logits ``[tokens, E]`` and the chosen expert ids ``[tokens, k]`` as the sites
``<MoE block path>.router_logits`` and ``<MoE block path>.router_topk``, exactly as a model
calling ``tm.observe(block, "router_logits", ...)`` would. What is recognised is verified on
every observed call: the logits must have ``num_experts`` columns and the choices be integer
ids with ``top_k`` columns, or every router metric of the step is failed with the reason (never
a count of the wrong tensor).

Integrations are looked up by the top-level package of the model's module classes, so a plain
PyTorch model pays one scan of its module classes at construction and nothing per step.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tmetrics_core.sources.modules import ModuleIndex

__all__ = ["RECOGNIZERS", "ROUTER_OUTPUT_KINDS", "Router", "find_routers", "install"]

ROUTER_OUTPUT_KINDS = frozenset({"router_logits", "router_topk"})
"""The kinds a found router provides."""

RECOGNIZERS: dict[str, str] = {"transformers": "tmetrics_core.integrations.hf_moe:find_routers"}
"""Top-level package of a model's module classes -> ``module:function`` that finds its routers
(called with the model and its :class:`ModuleIndex`, returns a list of :class:`Router`)."""


@dataclass(frozen=True)
class Router:
    """One router module and how to read its output.

    Attributes:
        path: the router module's path (``model.layers.3.mlp.gate``).
        module: the router module, which the hook is put on.
        block: the module the observations are named after (the MoE block holding the router):
            sites are ``<block path>.router_logits`` and ``<block path>.router_topk``.
        num_experts: global expert count (from the model's config).
        top_k: experts chosen per token.
        read: the module's forward output -> ``(logits or None, top-k ids or None)``.
    """

    path: str
    module: torch.nn.Module
    block: torch.nn.Module
    num_experts: int
    top_k: int
    read: Callable[[Any], tuple[torch.Tensor | None, torch.Tensor | None]]


def find_routers(model: torch.nn.Module, index: ModuleIndex) -> list[Router]:
    """The routers of every integration whose package defines some module class of ``model``."""
    packages = {type(m).__module__.partition(".")[0] for _, m in index.named}
    found: list[Router] = []
    for package, target in RECOGNIZERS.items():
        if package in packages:
            module_name, _, function = target.partition(":")
            found.extend(getattr(importlib.import_module(module_name), function)(model, index))
    return found


def install(routers: Sequence[Router], record: Callable[..., None], fail: Callable[[str], None],
            kinds: frozenset[str]) -> list[Any]:
    """Forward hooks on ``routers`` observing the ``kinds`` wanted (of :data:`ROUTER_OUTPUT_KINDS`)
    through ``record`` (``tmetrics_core.observe.record``); ``fail(reason)`` fails the step's router
    metrics when an output is not what the router was recognised as. Returns the handles."""
    wanted = kinds & ROUTER_OUTPUT_KINDS
    if not wanted:
        return []
    return [router.module.register_forward_hook(_hook(router, record, fail, wanted)) for router in routers]


def _hook(router: Router, record: Callable[..., None], fail: Callable[[str], None], wanted: frozenset[str]):
    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        logits, chosen = router.read(out)
        problem = _check(router, logits, chosen)
        if problem is not None:
            fail(problem)
            return
        if logits is not None and "router_logits" in wanted:
            record(router.block, "router_logits", logits, kind="router_logits", shard_dim=None)
        if chosen is not None and "router_topk" in wanted:
            record(router.block, "router_topk", chosen, kind="router_topk", shard_dim=None)
    return hook


def _check(router: Router, logits: torch.Tensor | None, chosen: torch.Tensor | None) -> str | None:
    """Why the output does not match what ``router`` was recognised as, or None."""
    if logits is not None and (not isinstance(logits, torch.Tensor) or logits.shape[-1] != router.num_experts):
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        return (f"router {router.path}: its logits are {shape}, not [tokens, {router.num_experts}] as the model's "
                "config says; observe router outputs with tm.observe(...) instead")
    if chosen is not None and (not isinstance(chosen, torch.Tensor) or chosen.is_floating_point()
                               or chosen.shape[-1] != router.top_k):
        what = f"{chosen.dtype} {list(chosen.shape)}" if isinstance(chosen, torch.Tensor) else type(chosen).__name__
        return (f"router {router.path}: its top-k choices are {what}, not integer expert ids [tokens, "
                f"{router.top_k}] as the model's config says; observe them with tm.observe(...) instead")
    return None
