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
read as one: the logging rank says once that padding is counted. Only the outermost models
from ``transformers`` or ``peft`` (a ``PreTrainedModel`` or ``PeftModel``, recognised by their
class's module and attributes) are hooked: the model itself, or the Hugging Face model inside a
LightningModule or another wrapper; never their layers, which get built masks.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch

from tmetrics_core.sources.hook_context import HookContext

__all__ = ["install"]

log = logging.getLogger("tmetrics")

_PACKAGES = ("transformers.", "peft.")


def install(hooks: HookContext) -> list[Any]:
    """Hook the forward of the measured model's outermost ``transformers``/``peft`` modules (the
    model itself, or the Hugging Face model inside a LightningModule) to observe their
    ``attention_mask`` as ``token_mask`` (``token_mask``'s installer); returns the handles. The
    logging rank warns about unusable masks."""
    model, record = hooks.model, hooks.record
    said = [not hooks.reporter.speaks]
    handles: list[Any] = []
    outer: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{o}.") for o in outer) or "" in outer:
            continue
        if type(module).__module__.startswith(_PACKAGES) and _is_model(module):
            outer.append(path)
            handles.append(module.register_forward_pre_hook(_taker(module, record, said), with_kwargs=True))
    return handles


def _taker(model: torch.nn.Module, record: Callable[..., None], said: list[bool]) -> Callable[..., None]:
    position = _mask_position(model)

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
    return take_mask


def _is_model(module: torch.nn.Module) -> bool:
    """A whole model (``PreTrainedModel``, ``PeftModel``), not one of its layers, whose masks
    are built ones (4-D, or None)."""
    return hasattr(module, "base_model_prefix") or hasattr(module, "peft_config")


def _mask_position(model: torch.nn.Module) -> int | None:
    """Index of ``attention_mask`` among ``forward``'s positional arguments (``model(ids, mask)``)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("attention_mask") if "attention_mask" in names else None
