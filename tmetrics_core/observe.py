"""In-model observation sites: ``tm.observe(module, name, tensor, kind=...)``.

A model calls :func:`observe` where a tensor of interest exists (router logits inside an MoE
block, say); tmetrics' own forward hooks call :func:`record`, :func:`record_residual` and
:func:`fail` the same way. The active :class:`Observer` is installed by ``TensorMetrics.step()``
only for steps with due metrics; on other steps, and for a ``kind`` no due metric watches, a
call returns after one context-variable read and one set lookup, so sites can stay in
production code.

Under ``torch.compile`` each call is one ``tmetrics::observe`` (``tmetrics::observe_residual``,
``tmetrics::observe_attention``, ``tmetrics::fail``, ``tmetrics::fail_unless``) custom operator in the user's graph: opaque to dynamo (no graph break, no
guard on whether a metric is due, so no recompile when the cadence changes), kept by AOT
autograd and inductor as an ordered side effect, and run eagerly at its place in the compiled
forward, where it does exactly what the uncompiled call does. The module travels as its
``id`` (a constant of the graph) and is looked up in :func:`register_modules`' registry; a
hook's owner number travels the same way. The
operators are tagged ``cudagraph_unsafe``: inductor does not capture them in a CUDA graph
(a replayed graph would skip them), it splits the graph around them.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core import torch_private
from tmetrics_core.observer import (IN_BACKWARD, MODULES, Observer, _ACTIVE, compiled_cotangent, deliver,
                                    deliver_attention, deliver_fail, deliver_fail_unless, deliver_residual,
                                    grad_observer)

__all__ = ["fail", "fail_unless", "in_backward", "new_owner", "observe", "observing", "record",
           "record_attention", "record_residual", "register_modules", "suspended", "tap", "watched"]


_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A number no other owner of hooks got in this process (an ``id`` may be reused once its
    object is collected, and the hooks of an object never closed are still installed)."""
    return next(_OWNERS)


def register_modules(modules: Iterable[torch.nn.Module]) -> None:
    """Make ``modules`` known to the compiled path by ``id`` (``ModuleIndex`` registers every
    module of the measured model; the registry holds them weakly)."""
    for module in modules:
        MODULES[id(module)] = module


def observe(module: torch.nn.Module, name: str, tensor: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
            kind: str, shard_dim: int | None = None, grad: bool = False,
            attention: AttentionSpec | None = None) -> None:
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

    ``kind="attn_qk"`` takes ``tensor=(q, k)``: queries ``[B, Hq, Tq, D]`` after RoPE and keys
    ``[B, Hkv, Tk, D]`` of one attention layer, with ``attention`` (an
    :class:`~tmetrics_core.attention_spec.AttentionSpec`: scale, causal, window, padding,
    packing, soft cap; None: unmasked, ``D ** -0.5``) and ``shard_dim=1`` when the heads are
    split over ``tp``. The attention metrics (``layer-attn-*``) read them on due steps without
    forming the ``[T x T]`` attention matrix.
    """
    if kind == "attn_qk":
        if not isinstance(tensor, tuple) or len(tensor) != 2:
            raise TypeError(f"tm.observe(..., kind='attn_qk') takes (q, k) as its tensor; got {type(tensor).__name__}")
        record_attention(module, name, tensor[0], tensor[1], spec=attention, shard_dim=shard_dim)
        return
    assert isinstance(tensor, torch.Tensor), "a tuple is taken only with kind='attn_qk'"
    record(module, name, tensor, kind=kind, shard_dim=shard_dim)
    if grad:
        tap(module, name, tensor, kind=f"{kind}_grad", shard_dim=shard_dim)


def tap(module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str, shard_dim: int | None = None,
        owner: int | None = None) -> None:
    """Observe the cotangent of ``tensor`` as site ``<module path>.<name>`` of ``kind``
    (``residual_grad``, ``logits_grad``, ``activation_grad``...) when backward reaches it.

    Called in the forward, where ``tensor`` is made. On a step where a due metric watches
    ``kind`` (eager), a tensor hook is registered on ``tensor`` that hands the cotangent to
    that step's observer (captured, so the hook works on the autograd engine's device
    threads too); elsewhere nothing happens after one context-variable read. A tensor that
    does not require grad has no cotangent: nothing is registered (under reentrant activation
    checkpointing the first forward runs without grad and the recomputation, whose graph
    backward runs, registers the hook; a non-reentrant recomputation's graph is never run
    backward, so its hooks never fire; a recomputation's inputs are detached leaves whose
    originals the first forward tapped, and are left alone: either way each micro-batch's
    cotangent is observed once).
    Under ``torch.compile`` the hook is in the graph on every step, a
    ``tmetrics::observe_grad`` operator in the compiled backward that drops the cotangent
    after one lookup on a step with no due metric of ``kind``.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
        return
    if torch.compiler.is_compiling():
        hook = functools.partial(compiled_cotangent, id(module), name, kind, shard_dim, owner)
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        return
    observer = grad_observer(owner)
    if observer is None or kind not in observer.kinds:
        return
    if tensor.grad_fn is None and torch_private.in_backward():
        return  # a reentrant recomputation's detached input: the first forward tapped the tensor it copies
    observer.tap(module, name, tensor, kind=kind, shard_dim=shard_dim)


@contextmanager
def in_backward(owner: int, observer: Observer) -> Iterator[None]:
    """Let ``owner``'s cotangent hooks find ``observer`` inside a backward on any thread."""
    IN_BACKWARD[owner] = observer
    try:
        yield
    finally:
        IN_BACKWARD.pop(owner, None)


def record(module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str, shard_dim: int | None,
           minus: torch.Tensor | None = None, owner: int | None = None) -> None:
    """:func:`observe` with ``minus`` (the observation is ``tensor - minus``, same shape) and
    ``owner``: the entry of tmetrics' forward hooks, which pass their ``TensorMetrics``' owner
    number (:func:`new_owner`) so that an observer takes only its own hooks' calls (two objects measuring one model would
    otherwise each see every observation twice)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.observe(tensor, minus, id(module), name, kind, shard_dim, owner)
    else:
        deliver(module, name, tensor, minus, kind, shard_dim, owner, compiled=False)


def record_attention(module: torch.nn.Module, name: str, q: torch.Tensor, k: torch.Tensor, *,
                     spec: AttentionSpec | None, shard_dim: int | None = None, owner: int | None = None) -> None:
    """An attention layer's queries and keys (see :func:`observe`) to an observer that has due
    attention metrics; nothing else is done on other steps (one context-variable read)."""
    if torch.compiler.is_compiling():
        spec = spec if spec is not None else AttentionSpec()
        torch.ops.tmetrics.observe_attention(
            q, k, spec.token_mask, spec.segment_ids, spec.mask, spec.q_positions, spec.k_positions, id(module), name,
            shard_dim, spec.scale, spec.causal, spec.window, spec.softcap, spec.key_split, owner)
    else:
        deliver_attention(module, name, q, k, spec, shard_dim, owner)


def record_residual(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *, accumulator: bool,
                    owner: int | None = None) -> None:
    """A block's output ``h`` (the residual stream, when ``accumulator``) and its input ``x``
    (for the contribution ``h - x``; None when not wanted): each part goes to the observer only
    when a due metric watches its kind (``owner`` as in :func:`record`)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.observe_residual(h, x, id(module), accumulator, owner)
    else:
        deliver_residual(module, h, x, accumulator, owner)


def fail(reason: str, kinds: frozenset[str] | None = None, owner: int | None = None) -> None:
    """Fail the current step's metrics reading any of ``kinds`` (router outputs when None) with
    ``reason`` (an automatically found router whose output is not what it was recognised as);
    nothing on a step with no observer (``owner`` as in :func:`record`)."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.fail(reason, None if kinds is None else ",".join(sorted(kinds)), owner)
    else:
        deliver_fail(reason, kinds, owner)


def fail_unless(ok: torch.Tensor, reason: str, kinds: frozenset[str] | None = None, owner: int | None = None
                ) -> None:
    """:func:`fail` unless ``ok`` (a 0-d bool tensor on any device) is true, read at the step's
    end with the step's other results: a hook checks device values without a host
    synchronisation (and inside a compiled graph); nothing on a step with no observer."""
    if torch.compiler.is_compiling():
        torch.ops.tmetrics.fail_unless(ok, reason, None if kinds is None else ",".join(sorted(kinds)), owner)
    else:
        deliver_fail_unless(ok, reason, kinds, owner)


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


