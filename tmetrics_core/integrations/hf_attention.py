"""Hugging Face attention observed with no user code, without changing the kernel that runs.

Every transformers 5 model gets its attention function from ``ALL_ATTENTION_FUNCTIONS`` by the
name in ``config._attn_implementation`` (``sdpa``, ``flash_attention_2``, ``flex_attention``,
``eager``...). :func:`install` wraps the entry of each name a measured model uses (for ``eager``,
which has no entry, it adds one that calls the model's own ``eager_attention_forward``): the
wrapper hands ``(query, key)`` after RoPE and the mask the kernel gets to
:func:`tmetrics_core.observe.record_attention`, then calls the original function with the same
arguments, so SDPA stays SDPA. Only modules of the measured model are observed, and only on due
steps (one context-variable read otherwise). ``remove()`` on the returned handle restores the
entry.

Mask translation: ``attention_mask is None`` is the causal (``is_causal``) or full pattern, with
``sliding_window`` when given; a boolean mask is used as it is; a float mask (eager: ``0`` and
the dtype's minimum) becomes an additive mask with ``-inf`` where the kernel's mask is below half
the dtype's minimum, so a fully masked (padded) query counts nowhere, as under SDPA.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Callable, cast

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.errors import ConfigError
from tmetrics_core.sources.hook_context import HookContext

__all__ = ["implementations", "install"]

_WRAPPED = "__tmetrics_attention__"


def implementations(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The attention implementation names a Hugging Face model's configs use, each with a
    module whose config names it; empty for a model that is not a transformers model."""
    found: dict[str, torch.nn.Module] = {}
    for module in model.modules():
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            found.setdefault(impl, module)
    return found


def install(hooks: HookContext) -> list[Any]:
    """Wrap the attention functions the measured model uses so that its attention modules call
    ``hooks.record_attention(module, "qk", q, k, spec=AttentionSpec(...))`` before the kernel
    (``attn_qk``'s first installer); the handles' ``remove()`` undoes it.

    Raises:
        ConfigError: an implementation that is neither registered in ``ALL_ATTENTION_FUNCTIONS``
            nor ``eager`` with an ``eager_attention_forward`` next to the model's class (a custom
            kernel that tmetrics cannot reach): the message says how to observe it with
            ``tm.observe``.
    """
    model, record = hooks.model, hooks.record_attention
    found = implementations(model)
    if not found:
        return []
    from transformers.modeling_utils import AttentionInterface

    ours: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet(model.modules())
    table = cast("dict[str, Callable]", AttentionInterface._global_mapping)  # typed by transformers as functions
    handles: list[_Handle] = []
    for impl, owner in found.items():
        original = table.get(impl)
        if original is None and (impl != "eager" or _eager_of(owner) is None):
            for handle in handles:  # nothing stays wrapped when start-up fails
                handle.remove()
            raise ConfigError(
                f"the attention metrics cannot observe {type(owner).__name__}'s attention implementation {impl!r}: it "
                "is not in transformers' ALL_ATTENTION_FUNCTIONS. Use attn_implementation='sdpa' (or 'eager', "
                "'flex_attention', 'flash_attention_2'), or call tm.observe(self, 'qk', (q, k), kind='attn_qk', "
                "attention=tm.AttentionSpec(causal=True, ...)) in the attention's forward, with q and k after RoPE")
        wrapper = _wrap(impl, original, ours, record)
        table[impl] = wrapper
        handles.append(_Handle(table, impl, original, wrapper))
    return handles


class _Handle:
    """Restores one entry of the attention table (if it is still this handle's wrapper)."""

    def __init__(self, table: dict, impl: str, original: Callable | None, wrapper: Callable) -> None:
        self.table, self.impl, self.original, self.wrapper = table, impl, original, wrapper

    def remove(self) -> None:
        if self.table.get(self.impl) is not self.wrapper:
            return  # wrapped again since (another measured model): that wrapper restores its own
        if self.original is None:
            del self.table[self.impl]
        else:
            self.table[self.impl] = self.original


def _wrap(impl: str, original: Callable | None, ours: "weakref.WeakSet[torch.nn.Module]",
          record: Callable[..., None]) -> Callable:
    from tmetrics_core.observe import watched

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if module in ours and watched("attn_qk"):
            record(module, "qk", query, key, spec=_spec(module, query, key, attention_mask, kwargs))
        kernel = original if original is not None else _eager_of(module)
        assert kernel is not None, "checked at install"
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(attention, _WRAPPED, impl)
    return attention


def _eager_of(module: torch.nn.Module) -> Callable | None:
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _spec(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
          kwargs: dict[str, Any]) -> AttentionSpec:
    tq, tk = query.shape[2], key.shape[2]
    scale, softcap = kwargs.get("scaling"), kwargs.get("softcap")
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        return AttentionSpec(scale=scale, softcap=softcap, causal=bool(causal) and tq > 1,
                             window=kwargs.get("sliding_window"),
                             q_positions=torch.arange(tk - tq, tk, device=query.device) if tq != tk else None)
    mask = mask[..., :tk]
    if mask.dtype != torch.bool:
        visible = mask > torch.finfo(mask.dtype).min / 2
        mask = torch.where(visible, mask.to(torch.float64), torch.full((), -math.inf, dtype=torch.float64,
                                                                        device=mask.device))
    return AttentionSpec(scale=scale, softcap=softcap, mask=mask)
