"""Megatron-Core's ``TopKRouter`` reported to tmetrics: its logits ``[tokens, E]`` (from
``gating()``) and the global expert ids it chose ``[tokens, k]`` (from its ``routing_map``),
through :func:`tmetrics_core.observe`, at the cost of one context-variable read on steps where
no router metric is due. Megatron is imported only when :func:`observe_routers` runs (its
parallel state is initialized, so the user imported it).
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.observe import fail_unless, observe, watched

__all__ = ["observe_routers"]


def observe_routers(model: torch.nn.Module) -> list[Any]:
    """Report every ``TopKRouter``'s logits and top-k choice (see the module docstring);
    returns the handles that undo it."""
    from megatron.core.transformer.moe.router import TopKRouter  # type: ignore[import-untyped]

    handles: list[Any] = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            handles.append(_GatingWrapper(module))
            handles.append(module.register_forward_hook(_report_topk))
    return handles


class _GatingWrapper:
    """``router.gating`` replaced by a call that also observes its logits; ``remove()`` undoes it."""

    def __init__(self, router: Any) -> None:
        self.router = router
        original = router.gating

        def gating(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = original(*args, **kwargs)
            if watched("router_logits"):
                observe(router, "router_logits", logits.reshape(-1, logits.shape[-1]), kind="router_logits")
            return logits

        router.gating = gating

    def remove(self) -> None:
        self.router.__dict__.pop("gating", None)


def _report_topk(router: Any, args: Any, out: Any) -> None:
    """Observes a router's top-k choice from its routing map ``[tokens, experts]``: the ids of
    the experts each token was sent to, read on the device (``topk`` of the map, no host
    read). Whether every token went to exactly ``k`` experts (none dropped over a capacity) is
    decided at the step's end (``fail_unless``): the metrics reading the choice fail then."""
    if not watched("router_topk"):
        return
    routing_map = out[1]
    k = int(router.topk)
    chosen = routing_map.reshape(-1, routing_map.shape[-1])
    fail_unless((chosen.sum(dim=1) == k).all(),
                f"a Megatron router dispatched other than top-{k} experts to some tokens (token dropping over an "
                "expert's capacity): its top-k choice would not be what it chose; observe router_topk with "
                "tm.observe(...) before the capacity is applied", frozenset({"router_topk"}))
    ids = chosen.to(torch.int8).topk(k, dim=1).indices
    observe(router, "router_topk", ids, kind="router_topk")
