"""Padding taken from a Hugging Face model's ``attention_mask``, with no user code.

A batch of sequences of unequal length is padded, and the model's forward is told which tokens
are real by ``attention_mask`` (``[batch, seq]``, 1 for a real token, 0 for padding). Activation,
residual, logit and router metrics read every row of a block's output: without the mask they
count padding rows as tokens (an activation RMS over padding and text alike). Until now only a
hand-written ``tm.observe(mask, kind="token_mask")`` removed them.

A forward pre-hook on the model passes a 2-D ``attention_mask`` as the step's ``token_mask``
before any block runs, so every token observation of that forward whose row count equals
``batch * seq`` drops the padding rows. A ``token_mask`` the model observes itself comes later
in the forward and wins. A mask of another shape (a 4-D additive mask built by the caller) is not
read as one: the logging rank says once that padding is counted. Only models from
``transformers`` or ``peft`` (by their class's module) are hooked.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

__all__ = ["install_padding"]

log = logging.getLogger("tmetrics")

_PACKAGES = ("transformers.", "peft.")


def install_padding(model: torch.nn.Module, record: Callable[..., None], *, say: bool) -> list[Any]:
    """Hook ``model``'s forward to observe its ``attention_mask`` as ``token_mask`` (through
    ``record(module, name, tensor, kind=, shard_dim=)``); returns the handles (none for a model
    not from ``transformers`` or ``peft``). ``say``: this rank warns about unusable masks."""
    if not type(model).__module__.startswith(_PACKAGES):
        return []
    position = _mask_position(model)
    said = [not say]

    def take_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and position is not None and len(args) > position:
            mask = args[position]
        if not isinstance(mask, torch.Tensor):
            return
        if mask.dim() == 2:
            record(module, "attention_mask", mask, kind="token_mask", shard_dim=None)
        elif not said[0]:
            said[0] = True
            log.warning("tmetrics: %s received an attention_mask of shape %s, not [batch, seq]: padding tokens "
                        "are counted by activation, residual, logit and router metrics. Pass a [batch, seq] "
                        "mask, or observe one with tm.observe(mask, kind='token_mask'). Said once.",
                        type(model).__name__, list(mask.shape))
    return [model.register_forward_pre_hook(take_mask, with_kwargs=True)]


def _mask_position(model: torch.nn.Module) -> int | None:
    """Index of ``attention_mask`` among ``forward``'s positional arguments (``model(ids, mask)``)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("attention_mask") if "attention_mask" in names else None
