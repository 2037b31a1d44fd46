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

from typing import Iterator, MutableMapping, Sequence

import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.kernels import moments
from tmetrics_core.sources.params import local_view
from tmetrics_core import torch_private

__all__ = ["Snapshot", "snapshot"]

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


class Snapshot(MutableMapping[str, torch.Tensor]):
    """``parameter name -> copy`` of the local tensor before the optimizer step.

    Args:
        copies: the copies made by torch (no flat buffer), or None.
        flat: ``(buffer, names, held, tensors)`` of a kernel copy (``moments.copied``): the
            copy of ``names[i]`` lies in ``buffer`` where ``held`` says, a copy of
            ``tensors[i]``, whose shape it takes when looked up (no ``torch.Size`` is made per
            parameter on a due step); or None.

    Entries are the caller's to pop or change in place (the general path turns each copy
    into the update). :meth:`held` describes the buffer only while no entry has been handed
    out, changed or removed, so what it describes is still the parameters before the step;
    the per-name layout is built only when an entry is looked up.
    """

    __slots__ = ("_buffer", "_flat", "_layout", "_copies", "_pristine")

    def __init__(self, copies: dict[str, torch.Tensor] | None = None,
                 flat: tuple[torch.Tensor, Sequence[str], moments.Held, Sequence[torch.Tensor]] | None = None
                 ) -> None:
        self._copies: dict[str, torch.Tensor] = dict(copies or {})
        self._buffer: torch.Tensor | None = None
        self._flat: tuple[tuple[str, ...], moments.Held, Sequence[torch.Tensor]] | None = None
        self._layout: dict[str, tuple[int, int, torch.dtype, torch.Tensor]] | None = None
        if flat is not None:
            self._buffer, names, held, tensors = flat
            self._flat = (tuple(names), held, tensors)
        self._pristine = flat is not None

    def held(self, names: Sequence[str]) -> moments.Held | None:
        """Where the copies of ``names`` lie in the flat buffer (in that order), or None: no flat
        buffer, a name without a copy, or an entry already handed out, changed or removed (it
        may have been changed in place)."""
        if not self._pristine or self._flat is None:
            return None
        flat_names, held, _ = self._flat
        names = tuple(names)
        if names == flat_names[:len(names)]:  # the usual case: the program's names come first
            return held if len(names) == len(flat_names) else held.head(len(names))
        at = {name: i for i, name in enumerate(flat_names)}
        if any(name not in at for name in names):
            return None
        return held.pick([at[name] for name in names])

    def spare(self) -> torch.Tensor | None:
        """The flat buffer, for the next snapshot to write into, when no copy in it was ever
        handed out (then nothing outside this snapshot reads it); else None."""
        return self._buffer if self._pristine else None

    def copies(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The copies of ``names``, in that order, as :meth:`__getitem__` gives each.

        Raises:
            KeyError: a name without a copy.
        """
        if self._flat is None:  # torch made every copy: one C-level lookup per name
            return list(map(self._copies.__getitem__, names))
        return [self[name] for name in names]

    def _places(self) -> dict[str, tuple[int, int, torch.dtype, torch.Tensor]]:
        """The flat copies not yet looked up, by name: (byte offset, element count, dtype, the
        tensor copied), built on first use."""
        if self._layout is None:
            self._layout = {}
            if self._flat is not None and self._buffer is not None:
                names, held, tensors = self._flat
                base = self._buffer.data_ptr()
                self._layout = {n: (address - base, numel, dtype, tensor) for n, address, numel, dtype, tensor
                                in zip(names, held.addresses, held.numels, held.dtypes, tensors)}
        return self._layout

    def __getitem__(self, name: str) -> torch.Tensor:
        """The copy of ``name``, shaped as its tensor; flat (one dimension, the elements copied)
        when the tensor no longer has as many elements (resized since: a reader comparing
        shapes then finds the mismatch).

        Raises:
            KeyError: a name without a copy.
        """
        copy = self._copies.get(name)
        if copy is None:
            places = self._places()
            offset, numel, dtype, tensor = places[name]
            assert self._buffer is not None  # layout entries lie in the flat buffer
            flat = self._buffer[offset:offset + numel * dtype.itemsize].view(dtype)
            copy = self._copies[name] = flat.view(tensor.shape) if tensor.numel() == numel else flat
            del places[name]
        self._pristine = False
        return copy

    def __setitem__(self, name: str, copy: torch.Tensor) -> None:
        self._places().pop(name, None)
        self._copies[name] = copy
        self._pristine = False

    def __delitem__(self, name: str) -> None:
        places = self._places()
        self._pristine = False
        if name in places:
            del places[name]
        else:
            del self._copies[name]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._copies)
        yield from list(self._places())

    def __len__(self) -> int:
        return len(self._copies) + len(self._places())

    def __contains__(self, name: object) -> bool:
        return name in self._copies or name in self._places()


@torch.no_grad()
def snapshot(manifest: Manifest, names: Sequence[str] | None = None,
             spare: torch.Tensor | None = None) -> Snapshot:
    """Copies of the local parameters (for updates), only of ``names`` when given (in that
    order; names without a local parameter are skipped), else of all in manifest order: one kernel
    call into one flat buffer (``spare``, an earlier snapshot's :meth:`Snapshot.spare`, where
    large enough) where the kernel takes every tensor, else one batched torch kernel
    (``x * 1.0`` is exact for every value: -0.0, NaN, inf).

    Raises:
        RuntimeError: the kernel ran out of memory.
    """
    views = manifest.views
    local = manifest.local
    chosen = list(local) if names is None else list(filter(local.__contains__, names))  # C-level, per due step
    # local_view of a parameter (never None) is a tensor; a plain parameter is itself.
    tensors: list[torch.Tensor] = list(map(local.__getitem__, chosen))
    if not set(map(type, tensors)) <= _PLAIN:
        tensors = list(map(local_view, tensors))
    if views:
        tensors = [manifest.viewed(n, t) for n, t in zip(chosen, tensors)]
    flat = moments.copied(tensors, spare) if tensors else None
    if flat is None:
        copies = torch_private.foreach_mul(tensors, 1.0) if tensors else []
        return Snapshot(copies=dict(zip(chosen, copies)))
    buffer, held = flat
    return Snapshot(flat=(buffer, chosen, held, tensors))
