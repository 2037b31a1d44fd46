"""Forward hooks on a model's blocks, its head and the modules ``modules:`` globs pick.

The installers that the residual, logit and activation kinds' records name
(:data:`tmetrics_core.kinds.KINDS`). ``TensorMetrics`` installs them once, at construction, and
keeps them (adding or removing a hook on a compiled module is a recompile): a hook passes its
tensors to ``tmetrics_core.observe``, which drops them after one context-variable read on a
step where no due metric watches their kind, and compiles into the graph as a custom operator
(see there). The same forward hooks tap the tensors whose cotangents a metric reads
(``tmetrics_core.observe.tap``): a tensor hook on a due step only. A tapped tensor is the one the
model made (a DTensor stays one: its cotangent's placements are reduced as the forward's).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tmetrics_core.sources.hook_context import HookContext

__all__ = ["install_activation_grads", "install_activations", "install_blocks", "install_head"]


def install_blocks(hooks: HookContext) -> list[Any]:
    """One forward hook per block for the residual kinds read: its output ``h`` (the residual
    accumulator) and, for the contribution ``h - x``, its input ``x`` to ``record_residual``;
    ``h`` and ``x`` tapped for their cotangents (``residual_grad``, ``residual_input_grad``).
    A block object at several positions is hooked once, with its stand-ins' depth hooks."""
    index, kinds = hooks.index, hooks.kinds
    residual, contribution = "residual_accumulator" in kinds, "residual_contribution" in kinds
    block_grads = kinds & {"residual_grad", "residual_input_grad"}
    handles: list[Any] = []
    if residual or contribution or block_grads:
        record_residual, tap = hooks.record_residual, hooks.tap
        for _, _, block in index.blocks:
            if index.depths.is_stand_in(block):
                continue  # observed through the block it stands for
            hook = _residual_hook(index.depths.wrap(block, record_residual), residual, contribution, tap,
                                  block_grads, index.depths.current)
            handles.append(block.register_forward_hook(hook, with_kwargs=True))
        handles += index.depths.install()
    return handles


def install_head(hooks: HookContext) -> list[Any]:
    """A forward hook on the head for ``logits`` (its local output) and ``logits_grad`` (the
    output tapped)."""
    head, kinds = hooks.index.head, hooks.kinds
    logits, grad = "logits" in kinds, "logits_grad" in kinds
    if not (logits or grad) or head is None:
        return []
    vocab = _logical_out(head[1])
    return [head[1].register_forward_hook(_logits_hook(hooks.record if logits else None,
                                                       hooks.tap if grad else None, vocab))]


def install_activations(hooks: HookContext) -> list[Any]:
    """A forward hook recording the output of each module the configured metrics' globs pick (a
    metric built without ``modules:``, as ``layer-activation-rms``, hooks its documented defaults)."""
    record = hooks.record
    patterns = tuple(p for m in hooks.metrics for p in hooks.modules.get(m.name, getattr(m, "modules", ())))
    return [module.register_forward_hook(
                lambda m, args, out: record(m, "", _first(out), kind="activation", shard_dim=None))
            for _, module in hooks.index.matching(patterns)]


def install_activation_grads(hooks: HookContext) -> list[Any]:
    """A forward hook tapping the output of each module the ``activation_grad`` metrics' globs
    pick, for its cotangent."""
    tap = hooks.tap
    patterns = tuple(p for m in hooks.metrics if "activation_grad" in m.source_kinds
                     for p in hooks.token_modules.get(m.name, ()))
    return [module.register_forward_hook(
                lambda m, args, out: tap(m, "", _unwrapped(out), kind="activation_grad", shard_dim=None))
            for _, module in hooks.index.matching(patterns)]


def _residual_hook(record_residual: Callable[..., None], residual: bool, contribution: bool,
                   tap: Callable[..., None] | None, grads: frozenset[str],
                   at_depth: Callable[[torch.nn.Module], torch.nn.Module]):
    """A block's input is its first positional argument, or its first tensor keyword argument
    when called by keyword (Megatron-Core calls ``layer(hidden_states=..., ...)``); its
    cotangents are tapped as the site of the current call's depth (``at_depth``)."""
    def hook(module, args, kwargs, out):
        h = _unwrapped(out)  # a DTensor stays one: its Shard on the sequence dim is a population split
        given = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        fits = (contribution and isinstance(given, torch.Tensor) and given.shape == h.shape
                and getattr(given, "placements", None) == getattr(h, "placements", None))  # both DTensors or neither
        x = given if fits else None
        if residual or x is not None:
            record_residual(module, h, x, accumulator=residual)
        if tap is not None:
            if "residual_grad" in grads:
                tap(at_depth(module), "", h, kind="residual_grad", shard_dim=None)
            if "residual_input_grad" in grads and isinstance(given, torch.Tensor):
                tap(at_depth(module), "", given, kind="residual_input_grad", shard_dim=None)
    return hook


def _logits_hook(record: Callable[..., None] | None, tap: Callable[..., None] | None, vocab: int):
    """The head's output: its local logits to ``record``, the tensor itself to ``tap``; split
    on ``tp`` (``shard_dim`` 1) when this rank holds fewer than ``vocab`` columns."""
    def hook(module, args, out):
        local = _first(out)
        shard_dim = 1 if local.shape[-1] < vocab else None
        if record is not None:
            record(module, "", local, kind="logits", shard_dim=shard_dim)
        if tap is not None:
            tap(module, "", _unwrapped(out), kind="logits_grad", shard_dim=shard_dim)
    return hook


def _unwrapped(out: Any) -> torch.Tensor:
    """The first tensor of a module's output (tuples and lists unwrapped; a DTensor as it is)."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _first(out: Any) -> torch.Tensor:
    """The local tensor of a module's first output."""
    out = _unwrapped(out)
    local = getattr(out, "to_local", None)
    return local() if local is not None else out


def _logical_out(linear: torch.nn.Linear) -> int:
    return int(linear.weight.shape[0])
