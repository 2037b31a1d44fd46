"""In-model observation sites: ``tm.observe(module, name, tensor, kind=...)``.

A model calls :func:`observe` where a tensor of interest exists (router logits inside an MoE
block, say). On steps where no due metric watches that ``kind`` the call returns after one
context-variable read and one set lookup, so sites can stay in production code. The active
:class:`Observer` is installed by ``TensorMetrics.step()`` only for steps with due metrics.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch

__all__ = ["Observer", "observe", "observing", "watched"]


class Observer(Protocol):
    """Receives the observations of one step; ``kinds`` are the site kinds some due metric wants."""

    kinds: frozenset[str]

    def record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
               shard_dim: int | None, minus: torch.Tensor | None = None) -> None:
        """Observe ``tensor`` (minus ``minus``) for every due metric that accepts the site: read
        at once, or kept until the step's end where the source says so (router outputs)."""
        ...


_ACTIVE: ContextVar[Observer | None] = ContextVar("tmetrics_observer", default=None)


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
    read the site, on every rank.
    """
    observer = _ACTIVE.get()
    if observer is None or kind not in observer.kinds:
        return
    observer.record(module, name, tensor, kind=kind, shard_dim=shard_dim)


def watched(kind: str) -> bool:
    """Whether a due metric of the current step watches site ``kind``: lets an integration's
    hook skip preparing a tensor for :func:`observe` (one context-variable read)."""
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
