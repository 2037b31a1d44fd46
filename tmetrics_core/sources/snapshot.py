"""The update snapshot: the local parameters as they were before the optimizer step.

Update metrics read ``p - snapshot`` after the step, and metrics of parameters alone read the
snapshot itself when an update metric is due (see ``TensorMetrics``). Where the fused kernel
takes every selected parameter, :func:`snapshot` copies them all with one kernel call into one
flat buffer (``moments.copied``): a copy is a view of that buffer, made only when looked up.
The parameter program reads the buffer by address (:meth:`Snapshot.held`) and makes no view, so
a due step creates no tensor object per parameter for its snapshot. Elsewhere (accelerator,
float64 or non-contiguous parameters, the kernel off) torch copies them, one batched kernel.
"""

from __future__ import annotations

from typing import Iterator, MutableMapping, Sequence, cast

import torch

from tmetrics_core.naming.manifest import Manifest
from tmetrics_core.kernels import moments
from tmetrics_core.sources.params import local_view

__all__ = ["Snapshot", "snapshot"]


class Snapshot(MutableMapping[str, torch.Tensor]):
    """``parameter name -> copy`` of the local tensor before the optimizer step.

    Args:
        copies: the copies made by torch (no flat buffer), or None.
        flat: ``(buffer, {name: (byte offset, shape, dtype)})`` of a kernel copy, or None.

    Entries are the caller's to pop or change in place (the general path turns each copy
    into the update). :meth:`held` gives the buffer's addresses only while no copy has been
    handed out, so what it describes is still the parameters before the step.
    """

    __slots__ = ("_buffer", "_layout", "_copies", "_handed_out")

    def __init__(self, copies: dict[str, torch.Tensor] | None = None,
                 flat: tuple[torch.Tensor, dict[str, tuple[int, torch.Size, torch.dtype]]] | None = None) -> None:
        self._copies: dict[str, torch.Tensor] = dict(copies or {})
        self._buffer: torch.Tensor | None = None
        self._layout: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
        if flat is not None:
            self._buffer, self._layout = flat
        self._handed_out = False

    def held(self, names: Sequence[str]) -> list[moments.Held] | None:
        """Where the copies of ``names`` lie in the flat buffer, or None: no flat buffer, a name
        without a copy, or a copy already handed out (it may have been changed in place)."""
        if self._buffer is None or self._handed_out:
            return None
        base = self._buffer.data_ptr()
        out = []
        for name in names:
            place = self._layout.get(name)
            if place is None:
                return None
            offset, shape, dtype = place
            out.append((base + offset, shape.numel(), dtype))
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        copy = self._copies.get(name)
        if copy is None:
            offset, shape, dtype = self._layout[name]  # KeyError for a name without a copy
            assert self._buffer is not None  # layout entries lie in the flat buffer
            size = shape.numel() * dtype.itemsize
            copy = self._copies[name] = self._buffer[offset:offset + size].view(dtype).view(shape)
            del self._layout[name]
        self._handed_out = True
        return copy

    def __setitem__(self, name: str, copy: torch.Tensor) -> None:
        self._layout.pop(name, None)
        self._copies[name] = copy
        self._handed_out = True

    def __delitem__(self, name: str) -> None:
        if name in self._layout:
            del self._layout[name]
        else:
            del self._copies[name]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._copies)
        yield from list(self._layout)

    def __len__(self) -> int:
        return len(self._copies) + len(self._layout)

    def __contains__(self, name: object) -> bool:
        return name in self._copies or name in self._layout


@torch.no_grad()
def snapshot(manifest: Manifest, names: set[str] | frozenset[str] | None = None) -> Snapshot:
    """Copies of the local parameters (for updates), only of ``names`` when given: one kernel
    call into one flat buffer where the kernel takes every tensor, else one batched torch
    kernel (``x * 1.0`` is exact for every value: -0.0, NaN, inf).

    Raises:
        RuntimeError: the kernel ran out of memory.
    """
    # local_view of a parameter (never None) is a tensor
    chosen = cast("list[tuple[str, torch.Tensor]]",
                  [(n, manifest.viewed(n, local_view(p))) for n, p in manifest.local.items()
                   if names is None or n in names])
    tensors = [t for _, t in chosen]
    flat = moments.copied(tensors) if tensors else None
    if flat is None:
        copies = torch._foreach_mul(tensors, 1.0) if tensors else []
        return Snapshot(copies={n: c for (n, _), c in zip(chosen, copies)})
    buffer, offsets = flat
    return Snapshot(flat=(buffer, {n: (offset, t.shape, t.dtype) for (n, t), offset in zip(chosen, offsets)}))
