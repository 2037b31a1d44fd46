"""The step's active observer and the delivery of each observation to it.

:mod:`tmetrics_core.observe` is what models and tmetrics' hooks call; this module holds what those
calls reach: the :class:`Observer` protocol, the observer active in this context (installed by
``TensorMetrics.step()`` on due steps), the registry that turns a module's ``id`` back into the
module, and the ``tmetrics::*`` custom operators through which a compiled graph delivers its
observations (each runs eagerly at its place in the graph and does what the uncompiled call
does).
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Protocol

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core import torch_private

__all__ = ["IN_BACKWARD", "MODULES", "Observer", "UNKNOWN", "compiled_cotangent", "current", "deliver",
           "deliver_attention", "deliver_fail", "deliver_fail_unless", "deliver_residual", "grad_observer"]


class Observer(Protocol):
    """Receives the observations of one step; ``kinds`` are the site kinds some due metric wants;
    ``kept`` the kinds whose tensors it keeps past the call (until the step's end); an observer
    without ``kept`` is given copies of every observation from a compiled graph."""

    kinds: frozenset[str]
    kept: frozenset[str]

    def record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
               shard_dim: int | None, minus: torch.Tensor | None = None) -> None:
        """Observe ``tensor`` (minus ``minus``) for every due metric that accepts the site: read
        at once, or kept until the step's end where the source says so (router outputs)."""
        ...

    def record_residual(self, module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *,
                        accumulator: bool) -> None:
        """Observe a block's output ``h`` as the residual stream (when ``accumulator``) and
        ``h - x`` as its contribution (when ``x`` is given)."""
        ...

    def tap(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
            shard_dim: int | None) -> None:
        """Register a hook on ``tensor`` that observes its cotangent (see :func:`tmetrics_core.observe.tap`)."""
        ...

    def cotangent(self, module: torch.nn.Module, name: str, grad: torch.Tensor, *, kind: str,
                  shard_dim: int | None) -> None:
        """Observe ``grad``, the cotangent of a tapped tensor, in backward."""
        ...

    def fail(self, reason: str, kinds: frozenset[str] | None = None) -> None:
        """Fail the step's metrics that read any of ``kinds`` (router outputs when None) with
        ``reason``."""
        ...

    def fail_unless(self, ok: torch.Tensor, reason: str, kinds: frozenset[str] | None = None) -> None:
        """As :meth:`fail` unless the 0-d bool tensor ``ok`` is true, decided at the step's end:
        a check of device values that costs no host synchronisation where it is made."""
        ...


_ACTIVE: ContextVar[Observer | None] = ContextVar("tmetrics_observer", default=None)
"""The observer of this thread/context (set by ``tmetrics_core.observe.observing``); read by the
step scope and the calls of :mod:`tmetrics_core.observe` only."""

MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
"""``id(module)`` -> module, for the compiled path (a custom operator takes no module)."""

UNKNOWN = torch.nn.Module()
"""Stands for a module observed under compile that no model of a ``TensorMetrics`` holds: it has
no path in any model, as that module would have none (its sites are named ``?.<name>``)."""

IN_BACKWARD: dict[int, Observer] = {}
"""Owner number -> its step's observer, for hooks that run in a backward on another thread
(the autograd engine's device threads do not see the context variable)."""


def current(owner: int | None) -> Observer | None:
    """The active observer, if any, and when ``owner`` is given only if it is that owner's."""
    observer = _ACTIVE.get()
    if observer is None or (owner is not None and getattr(observer, "owner", None) != owner):
        return None
    return observer


def grad_observer(owner: int | None) -> Observer | None:
    """The observer that takes ``owner``'s cotangents: the active one, or inside a backward on a
    device thread the one :data:`IN_BACKWARD` holds; None for an observer without ``tap``."""
    observer = current(owner)
    if observer is None and owner is not None and torch_private.in_backward():
        observer = IN_BACKWARD.get(owner)  # a recomputation (reentrant checkpointing) on a device thread
    return observer if observer is not None and hasattr(observer, "tap") else None


def compiled_cotangent(module: int, name: str, kind: str, shard_dim: int | None, owner: int | None,
                       grad: torch.Tensor) -> None:
    """A compiled graph's cotangent hook: the ``tmetrics::observe_grad`` operator."""
    torch.ops.tmetrics.observe_grad(grad, module, name, kind, shard_dim, owner)


def deliver(module: torch.nn.Module, name: str, tensor: torch.Tensor, minus: torch.Tensor | None, kind: str,
            shard_dim: int | None, owner: int | None, *, compiled: bool) -> None:
    """``tensor`` (minus ``minus``) to ``owner``'s active observer when it watches ``kind`` (a kind
    it does not watch goes to its ``unwatched``); from a compiled graph (``compiled``) a kind the
    observer keeps past the call is copied first."""
    observer = current(owner)
    if observer is None:
        return
    if kind not in observer.kinds:
        unwatched = getattr(observer, "unwatched", None)  # observers written before it take no such call
        if unwatched is not None:
            unwatched(kind, module)
        return
    if compiled and kind in getattr(observer, "kept", observer.kinds):  # not declared: every kind may be kept
        tensor = tensor.clone()  # the compiled graph may write its next values into this buffer
    if minus is None:  # observers written before ``minus`` existed take no such argument
        observer.record(module, name, tensor, kind=kind, shard_dim=shard_dim)
    else:
        observer.record(module, name, tensor, kind=kind, shard_dim=shard_dim, minus=minus)


def deliver_residual(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, accumulator: bool,
                     owner: int | None) -> None:
    """A block's output and input to the active observer: each part only where it watches its kind."""
    observer = current(owner)
    if observer is None:
        return
    accumulator = accumulator and "residual_accumulator" in observer.kinds
    x = x if "residual_contribution" in observer.kinds else None
    if accumulator or x is not None:
        observer.record_residual(module, h, x, accumulator=accumulator)


def deliver_attention(module: torch.nn.Module, name: str, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec | None,
                      shard_dim: int | None, owner: int | None) -> None:
    """Queries and keys to the active observer when it watches ``attn_qk``."""
    observer = current(owner)
    if observer is None or "attn_qk" not in observer.kinds:
        return
    observer.record_attention(module, name, q, k, spec=spec, shard_dim=shard_dim)  # type: ignore[attr-defined]


def deliver_fail(reason: str, kinds: frozenset[str] | None, owner: int | None) -> None:
    """``Observer.fail`` of the active observer, if any."""
    observer = current(owner)
    if observer is not None:
        observer.fail(reason, kinds)


def deliver_fail_unless(ok: torch.Tensor, reason: str, kinds: frozenset[str] | None, owner: int | None) -> None:
    """``Observer.fail_unless`` of the active observer, if any."""
    observer = current(owner)
    if observer is not None:
        observer.fail_unless(ok, reason, kinds)


@torch.library.custom_op("tmetrics::observe", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_op(tensor: torch.Tensor, minus: torch.Tensor | None, module: int, name: str, kind: str,
                shard_dim: int | None, owner: int | None) -> None:
    deliver(MODULES.get(module, UNKNOWN), name, tensor, minus, kind, shard_dim, owner, compiled=True)


@torch.library.custom_op("tmetrics::observe_grad", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_grad_op(grad: torch.Tensor, module: int, name: str, kind: str, shard_dim: int | None,
                     owner: int | None) -> None:
    observer = grad_observer(owner)
    if observer is not None and kind in observer.kinds:
        # a compiled backward may reuse the buffer: the observer reads it now or copies it
        observer.cotangent(MODULES.get(module, UNKNOWN), name, grad, kind=kind, shard_dim=shard_dim)


@torch.library.custom_op("tmetrics::observe_residual", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_residual_op(h: torch.Tensor, x: torch.Tensor | None, module: int, accumulator: bool,
                         owner: int | None) -> None:
    deliver_residual(MODULES.get(module, UNKNOWN), h, x, accumulator, owner)


@torch.library.custom_op("tmetrics::observe_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_attention_op(q: torch.Tensor, k: torch.Tensor, token_mask: torch.Tensor | None,
                          segment_ids: torch.Tensor | None, mask: torch.Tensor | None, q_positions: torch.Tensor | None,
                          k_positions: torch.Tensor | None, module: int, name: str, shard_dim: int | None,
                          scale: float | None, causal: bool, window: int | None, softcap: float | None,
                          key_split: str | None, owner: int | None) -> None:
    # The spec travels as its fields (an operator takes no dataclass) and is rebuilt here.
    spec = AttentionSpec(scale=scale, causal=causal, window=window, softcap=softcap, token_mask=token_mask,
                         segment_ids=segment_ids, mask=mask, q_positions=q_positions, k_positions=k_positions,
                         key_split=key_split)
    deliver_attention(MODULES.get(module, UNKNOWN), name, q, k, spec, shard_dim, owner)


@_observe_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, token_mask: torch.Tensor | None, segment_ids: torch.Tensor | None,
      mask: torch.Tensor | None, q_positions: torch.Tensor | None, k_positions: torch.Tensor | None, module: int,
      name: str, shard_dim: int | None, scale: float | None, causal: bool, window: int | None, softcap: float | None,
      key_split: str | None, owner: int | None) -> None:
    return None


@torch.library.custom_op("tmetrics::fail", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fail_op(reason: str, kinds: str | None, owner: int | None) -> None:
    # kinds comma-joined: a custom operator takes no list of strings
    deliver_fail(reason, None if kinds is None else frozenset(kinds.split(",")), owner)


@torch.library.custom_op("tmetrics::fail_unless", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fail_unless_op(ok: torch.Tensor, reason: str, kinds: str | None, owner: int | None) -> None:
    deliver_fail_unless(ok.clone(), reason, None if kinds is None else frozenset(kinds.split(",")), owner)


@_observe_op.register_fake
def _(tensor: torch.Tensor, minus: torch.Tensor | None, module: int, name: str, kind: str,
      shard_dim: int | None, owner: int | None) -> None:
    return None


@_observe_grad_op.register_fake
def _(grad: torch.Tensor, module: int, name: str, kind: str, shard_dim: int | None, owner: int | None) -> None:
    return None


@_observe_residual_op.register_fake
def _(h: torch.Tensor, x: torch.Tensor | None, module: int, accumulator: bool, owner: int | None) -> None:
    return None


@_fail_op.register_fake
def _(reason: str, kinds: str | None, owner: int | None) -> None:
    return None


@_fail_unless_op.register_fake
def _(ok: torch.Tensor, reason: str, kinds: str | None, owner: int | None) -> None:
    return None


for _op in ("tmetrics::observe", "tmetrics::observe_grad", "tmetrics::observe_residual",
            "tmetrics::observe_attention", "tmetrics::fail",
            "tmetrics::fail_unless"):
    # An operator with no output and no mutated input would be dropped as dead code: an ordered
    # effect keeps it, in program order, in the forward graph.
    torch_private.register_effectful_op(_op, torch_private.EffectType.ORDERED)
