"""Parameter-side sources: parameters, gradients, Adam state and updates, as local tensors.

Each source kind maps every manifest entry to the local tensor this rank holds for it (the
DTensor's local shard, the plain tensor; for one expert of a stacked tensor a view of that
slice, never a copy) or None when the tensor is held elsewhere, which the metrics turn into a
neutral placeholder. A gradient is read from ``param.main_grad`` where the
parameter has one (Megatron-Core's DDP accumulates there and leaves ``.grad`` None), else from
``.grad``. A parameter without a gradient (a frozen weight, an expert no token reached, a branch
the loss does not use) is not part of gradient statistics: it joins with a placeholder, like a
tensor held elsewhere, never as zeros (which would lower RMS and raise zero fractions).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Mapping, Sequence, overload

import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.sources.optimizer_state import state_value
from tmetrics_core import torch_private

__all__ = ["grad_of", "grads_of", "has_none", "local_view", "read_kind"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@overload
def local_view(tensor: torch.Tensor) -> torch.Tensor: ...


@overload
def local_view(tensor: None) -> None: ...


@overload
def local_view(tensor: torch.Tensor | None) -> torch.Tensor | None: ...


def local_view(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The local data of a DTensor (unpadded, possibly empty shard, detached) or the tensor
    itself. A plain parameter is not detached (one op per tensor and read): metrics read it
    under ``torch.no_grad()``, so no graph is built. A DTensor's plain local tensor is taken as
    it is held (the data ``to_local()`` views, without its autograd function: some 7 us per
    tensor and read on CPU), not requiring grad; any other local tensor through ``to_local()``."""
    if tensor is None or type(tensor) in _PLAIN:
        return tensor  # the common case, without a failing attribute lookup
    held = torch_private.held_local(tensor)
    if held is not None and type(held) in _PLAIN and not held.requires_grad:
        return held
    to_local = getattr(tensor, "to_local", None)
    return to_local().detach() if to_local is not None else tensor


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``param``: ``param.main_grad`` where set (Megatron-Core's DDP and
    distributed optimizer keep it there, ``.grad`` None), else ``param.grad``; None when neither
    is (no gradient this step)."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


_GRAD = operator.attrgetter("grad")


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """:func:`grad_of` of each of ``params``, as two C-level maps over the list (no Python call
    per parameter: this runs on every due step, over every parameter)."""
    mains = list(map(getattr, params, itertools.repeat("main_grad"), itertools.repeat(None)))
    grads = list(map(_GRAD, params))
    if mains.count(None) == len(mains):
        return grads
    return [g if m is None else m for m, g in zip(mains, grads)]


def has_none(items: Sequence[object]) -> bool:
    """Whether ``items`` holds None, found by identity in a C-level loop (``list.count(None)``
    would call each tensor's Python ``__eq__``)."""
    return any(map(operator.is_, items, itertools.repeat(None)))


def read_kind(kind: str, manifest: Manifest, optimizer: Any,
              keys: Mapping[str, tuple[str, ...]] | None = None) -> list[torch.Tensor | None]:
    """Local tensors of ``kind`` for every manifest entry, in manifest order.

    ``param``: the parameter; ``grad``: its gradient (:func:`grad_of`; None, a placeholder, when
    it has none); ``exp_avg`` and ``exp_avg_sq``: the optimizer state of that meaning, under the
    first of ``keys[kind]`` (the owning optimizer's key:
    :func:`~tmetrics_core.sources.optimizer_state.state_keys`; ``kind`` itself by default) the
    parameter's state holds (None when it has none yet); ``update``: None for every entry (an
    update exists only against the snapshot of a step: the due set's program reads it,
    :meth:`~tmetrics_core.sources.param_reads.ParamReads.read`).

    Raises:
        ValueError: an expert slice's optimizer state not shaped as its stored parameter.
    """
    if kind == "update":
        return [None] * len(manifest.entries)
    out: list[torch.Tensor | None] = []
    for entry in manifest.entries:
        name = entry.name
        p = manifest.local.get(name)
        if p is None:
            out.append(None)
            continue
        if kind == "param":
            out.append(manifest.viewed(name, local_view(p)))
        elif kind == "grad":
            out.append(manifest.viewed(name, local_view(grad_of(p))))
        else:
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            value = local_view(state_value(state, keys.get(kind, (kind,)) if keys else (kind,)))
            stored = local_view(p)
            if value is not None and name in manifest.views and value.shape != stored.shape:
                raise ValueError(f"optimizer state {kind!r} of {name} has shape {list(value.shape)}, not its "
                                 f"stored parameter's {list(stored.shape)}: no expert slice of it")
            out.append(manifest.viewed(name, value))
    return out
