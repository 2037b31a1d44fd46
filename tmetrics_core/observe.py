"""In-model observation sites: ``tm.observe(module, name, tensor, kind=...)``.

A model calls :func:`observe` where a tensor of interest exists (router logits inside an MoE
block, say); tmetrics' own forward hooks call :func:`record`, :func:`record_residual` and
:func:`fail` the same way. The active :class:`Observer` is installed by ``TensorMetrics.step()``
only for steps with due metrics; on other steps, and for a ``kind`` no due metric watches, a
call returns after one context-variable read and one set lookup, so sites can stay in
production code.

Under ``torch.compile`` each call is one ``tmetrics::observe`` (``tmetrics::observe_residual``,
``tmetrics::fail``, ``tmetrics::fail_unless``) custom operator in the user's graph: opaque to dynamo (no graph break, no
guard on whether a metric is due, so no recompile when the cadence changes), kept by AOT
autograd and inductor as an ordered side effect, and run eagerly at its place in the compiled
forward, where it does exactly what the uncompiled call does. The module travels as its
``id`` (a constant of the graph) and is looked up in :func:`register_modules`' registry; a
hook's owner number travels the same way. The
operators are tagged ``cudagraph_unsafe``: inductor does not capture them in a CUDA graph
(a replayed graph would skip them), it splits the graph around them.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, Protocol

import torch
from torch._library.effects import EffectType

__all__ = ["Observer", "fail", "fail_unless", "new_owner", "observe", "observing", "record", "record_residual", "register_modules",
           "suspended", "watched"]


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

    def fail(self, reason: str, kinds: frozenset[str] | None = None) -> None:
        """Fail the step's metrics that read any of ``kinds`` (router outputs when None) with
        ``reason``."""
        ...

    def fail_unless(self, ok: torch.Tensor, reason: str, kinds: frozenset[str] | None = None) -> None:
        """As :meth:`fail` unless the 0-d bool tensor ``ok`` is true, decided at the step's end:
        a check of device values that costs no host synchronisation where it is made."""
        ...


_ACTIVE: ContextVar[Observer | None] = ContextVar("tmetrics_observer", default=None)

_MODULES: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
"""``id(module)`` -> module, for the compiled path (a custom operator takes no module)."""

_UNKNOWN = torch.nn.Module()
"""Stands for a module observed under compile that no model of a ``TensorMetrics`` holds: it has
no path in any model, as that module would have none (its sites are named ``?.<name>``)."""


_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A number no other owner of hooks got in this process (an ``id`` may be reused once its
    object is collected, and the hooks of an object never closed are still installed)."""
    return next(_OWNERS)


def register_modules(modules: Iterable[torch.nn.Module]) -> None:
    """Make ``modules`` known to the compiled path by ``id`` (``ModuleIndex`` registers every
    module of the measured model; the registry holds them weakly)."""
    for module in modules:
        _MODULES[id(module)] = module


def observe(module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
            shard_dim: int | None = None) -> None:
    """Expose ``tensor`` to the metrics of the current step as site ``<module path>.<name>``.

    Args:
        module: the module that produced ``tensor``; its path in the model names the site and
            gives the layer index (``layers.3.moe`` -> layer 3).
        name: the site's name inside the module, e.g. ``"router_logits"``.
        tensor: the local tensor, any dtype and shape; e.g. router logits ``[tokens, experts]``.
        kind: what the tensor is (``"router_logits"``, ``"router_topk"``, ``"activation"``...);
            metrics select sites by kind.
        shard_dim: ``None`` when each rank holds different tokens (a population split across
            data-parallel ranks) or the tensor is replicated as the topology says; an int when
            the tensor is split along that dim across the tensor-parallel axis.

    Costs one context-variable read when no due metric watches ``kind``; never raises into the
    model for a metric's sake (errors are reported by the metrics object at the step's end).
    Router outputs (``router_logits``, ``router_topk``, ``router_scores``) are kept, not copied,
    until the step's end: do not change them in place afterwards (observe ``tensor.clone()``
    instead); a change is detected by the tensor's version counter and fails the metrics that
    read the site, on every rank. Under ``torch.compile`` they are copied on due steps (a
    compiled graph reuses its buffers), and the call is a custom operator in the graph.
    """
    record(module, name, tensor, kind=kind, shard_dim=shard_dim)


def record(module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str, shard_dim: int | None,
           minus: torch.Tensor | None = None, owner: int | None = None) -> None:
    """:func:`observe` with ``minus`` (the observation is ``tensor - minus``, same shape) and
    ``owner``: the entry of tmetrics' forward hooks, which pass their ``TensorMetrics``' owner
    number (:func:`new_owner`) so that an observer takes only its own hooks' calls (two objects measuring one model would
    otherwise each see every observation twice)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.observe(tensor, minus, id(module), name, kind, shard_dim, owner)
    else:
        _record(module, name, tensor, minus, kind, shard_dim, owner, compiled=False)


def record_residual(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *, accumulator: bool,
                    owner: int | None = None) -> None:
    """A block's output ``h`` (the residual stream, when ``accumulator``) and its input ``x``
    (for the contribution ``h - x``; None when not wanted): each part goes to the observer only
    when a due metric watches its kind (``owner`` as in :func:`record`)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.observe_residual(h, x, id(module), accumulator, owner)
    else:
        _record_residual(module, h, x, accumulator, owner)


def fail(reason: str, kinds: frozenset[str] | None = None, owner: int | None = None) -> None:
    """Fail the current step's metrics reading any of ``kinds`` (router outputs when None) with
    ``reason`` (an automatically found router whose output is not what it was recognised as);
    nothing on a step with no observer (``owner`` as in :func:`record`)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.fail(reason, None if kinds is None else ",".join(sorted(kinds)), owner)
    else:
        _fail(reason, kinds, owner)


def fail_unless(ok: torch.Tensor, reason: str, kinds: frozenset[str] | None = None, owner: int | None = None
                ) -> None:
    """:func:`fail` unless ``ok`` (a 0-d bool tensor on any device) is true, read at the step's
    end with the step's other results: a hook checks device values without a host
    synchronisation (and inside a compiled graph); nothing on a step with no observer."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.fail_unless(ok, reason, None if kinds is None else ",".join(sorted(kinds)), owner)
    else:
        _fail_unless(ok, reason, kinds, owner)


def watched(kind: str) -> bool:
    """Whether a due metric of the current step watches site ``kind``: lets an integration's
    hook skip preparing a tensor for :func:`observe` (one context-variable read). True while
    compiling: the graph prepares the tensor on every step and the observer decides when it runs."""
    if torch.compiler.is_compiling():
        return True
    observer = _ACTIVE.get()
    return observer is not None and kind in observer.kinds


@contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Make ``observer`` receive :func:`observe` calls inside the block (this thread/context)."""
    token = _ACTIVE.set(observer)
    try:
        yield observer
    finally:
        _ACTIVE.reset(token)


@contextmanager
def suspended() -> Iterator[None]:
    """No observation reaches any observer inside the block: for a framework's forward that is not
    training (``torch.distributed.pipelining``'s shape inference on placeholder inputs)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _current(owner: int | None) -> Observer | None:
    """The active observer, if any, and when ``owner`` is given only if it is that owner's."""
    observer = _ACTIVE.get()
    if observer is None or (owner is not None and getattr(observer, "owner", None) != owner):
        return None
    return observer


def _record(module: torch.nn.Module, name: str, tensor: torch.Tensor, minus: torch.Tensor | None, kind: str,
            shard_dim: int | None, owner: int | None, *, compiled: bool) -> None:
    observer = _current(owner)
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


def _record_residual(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, accumulator: bool,
                     owner: int | None) -> None:
    observer = _current(owner)
    if observer is None:
        return
    accumulator = accumulator and "residual_accumulator" in observer.kinds
    x = x if "residual_contribution" in observer.kinds else None
    if accumulator or x is not None:
        observer.record_residual(module, h, x, accumulator=accumulator)


def _fail(reason: str, kinds: frozenset[str] | None, owner: int | None) -> None:
    observer = _current(owner)
    if observer is not None:
        observer.fail(reason, kinds)


def _fail_unless(ok: torch.Tensor, reason: str, kinds: frozenset[str] | None, owner: int | None) -> None:
    observer = _current(owner)
    if observer is not None:
        observer.fail_unless(ok, reason, kinds)


@torch.library.custom_op("tmetrics::observe", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_op(tensor: torch.Tensor, minus: torch.Tensor | None, module: int, name: str, kind: str,
                shard_dim: int | None, owner: int | None) -> None:
    _record(_MODULES.get(module, _UNKNOWN), name, tensor, minus, kind, shard_dim, owner, compiled=True)


@torch.library.custom_op("tmetrics::observe_residual", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _observe_residual_op(h: torch.Tensor, x: torch.Tensor | None, module: int, accumulator: bool,
                         owner: int | None) -> None:
    _record_residual(_MODULES.get(module, _UNKNOWN), h, x, accumulator, owner)


@torch.library.custom_op("tmetrics::fail", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fail_op(reason: str, kinds: str | None, owner: int | None) -> None:
    # kinds comma-joined: a custom operator takes no list of strings
    _fail(reason, None if kinds is None else frozenset(kinds.split(",")), owner)


@torch.library.custom_op("tmetrics::fail_unless", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _fail_unless_op(ok: torch.Tensor, reason: str, kinds: str | None, owner: int | None) -> None:
    _fail_unless(ok.clone(), reason, None if kinds is None else frozenset(kinds.split(",")), owner)


@_observe_op.register_fake
def _(tensor: torch.Tensor, minus: torch.Tensor | None, module: int, name: str, kind: str,
      shard_dim: int | None, owner: int | None) -> None:
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


for _op in ("tmetrics::observe", "tmetrics::observe_residual", "tmetrics::fail", "tmetrics::fail_unless"):
    # An operator with no output and no mutated input would be dropped as dead code: an ordered
    # effect keeps it, in program order, in the forward graph.
    torch.library._register_effectful_op(_op, EffectType.ORDERED)
