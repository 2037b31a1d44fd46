"""Flat-sharded buffers (ZeRO / distributed optimizer): a source that reads a kind from them.

A ZeRO-2/3 or Megatron distributed optimizer keeps gradients, master weights or Adam state as
one flat buffer: the row-major flattenings of its parameters, concatenated, split into
contiguous ranges across the data-parallel axis. Rank ``r`` holds ``buffer`` = elements
``[offset, offset + buffer.numel())`` of that concatenation. Each parameter then appears on
each rank as a ``FlatShard`` (possibly empty, possibly cutting rows) of its logical shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.kinds import kinds_where
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.placements import FlatShard
from tmetrics_core.site import Site

__all__ = ["FLAT_KINDS", "FlatBuffer", "FlatSource", "Memory", "Reader", "kept", "owned_part"]

FLAT_KINDS = kinds_where(observed=False)
"""The source kinds a flat buffer may hold (``update``: the change of a flat ``param`` over the
optimizer step, for sharded weights the model does not hold whole, e.g. DeepSpeed ZeRO 3)."""


@dataclass(frozen=True)
class FlatBuffer:
    """This rank's range of a flat buffer holding source ``kind`` of ``params``.

    Attributes:
        kind: ``"grad"``, ``"param"`` (master weights), ``"exp_avg"``, ``"exp_avg_sq"`` or
            ``"update"`` (see :data:`FLAT_KINDS`).
        axis: the axis the buffer is sharded over (``"dp"``).
        params: the parameters in buffer order (every rank passes the same list).
        buffer: 1-D tensor, this rank's elements; read at each due step (update it in place).
        offset: index of ``buffer[0]`` in the whole concatenation.
    """

    kind: str
    axis: str
    params: Sequence[torch.nn.Parameter]
    buffer: torch.Tensor
    offset: int

    def covers(self, manifest: Manifest) -> list[bool]:
        """Per manifest entry, whether this buffer holds it (others are read as usual)."""
        ids = {id(p) for p in self.params}
        return [id(manifest.local.get(e.name)) in ids for e in manifest.entries]

    def layout(self, manifest: Manifest, topology_axes: Sequence[str]) -> tuple[list[Site], Reader]:
        """Sites (FlatShard on ``axis``) for every manifest entry, in manifest order (entries not
        in the buffer keep their site: see :meth:`covers`), and the reader of this rank's part
        of each at a due step (a 1-D view of the buffer, empty where this rank owns none of the
        entry; None where the entry is not in the buffer). Depends on the manifest and the
        ranges alone: found once per run.

        Raises ``ConfigError`` for an axis not in the topology or a parameter not in the model.
        """
        if self.axis not in topology_axes:
            raise ConfigError(f"flat buffer axis {self.axis!r} is not an axis of the topology {list(topology_axes)}")
        known = {id(p) for p in manifest.local.values()}
        ranges: dict[int, tuple[int, int]] = {}
        cursor = 0
        for p in self.params:
            if id(p) not in known:
                raise ConfigError("a flat buffer lists a parameter that is not in the model given to TensorMetrics")
            ranges[id(p)] = (cursor, cursor + p.numel())
            cursor += p.numel()
        lo, hi = self.offset, self.offset + self.buffer.numel()
        sites: list[Site] = []
        spans: list[tuple[int, int] | None] = []
        for entry in manifest.entries:
            site = entry.site(self.kind)
            param = manifest.local.get(entry.name)
            if param is None or id(param) not in ranges:
                sites.append(site)
                spans.append(None)
                continue
            owned, a, b = owned_part(site, entry.shape, _range_of(entry.name, manifest, param, ranges[id(param)]),
                                     (lo, hi), self.axis, topology_axes)
            sites.append(owned)
            spans.append((a - lo, b - lo) if a < b else (0, 0))
        return sites, _Split(self.buffer, spans, f"the flat buffer of {self.kind!r} on {self.axis!r}")


Reader = Callable[[], list[torch.Tensor | None]]
"""A flat source's local tensor of every manifest entry at a due step (None: not held there)."""


class _Split:
    """Views of ``buffer`` at ``spans`` (per manifest entry ``(start, end)``, or None) from one
    ``split`` of the buffer, made again only when the buffer's memory changes (:func:`kept`): no
    torch op per entry at a due step. Spans do not overlap: each lies in its own parameter's
    range.

    Raises (when called):
        ValueError: the buffer's element count is not the one it was laid out with (the sites'
            ranges would be wrong); ``label`` names the buffer.
    """

    def __init__(self, buffer: torch.Tensor, spans: Sequence[tuple[int, int] | None], label: str) -> None:
        self._buffer = buffer
        self._numel = buffer.numel()
        self._label = label
        self._views: tuple[Memory, list[torch.Tensor | None]] | None = None
        self._sizes: list[int] = []
        self._at: list[int | None] = [None] * len(spans)
        cursor = 0
        for start, end, i in sorted((*span, i) for i, span in enumerate(spans) if span is not None):
            if start < end:
                if start > cursor:
                    self._sizes.append(start - cursor)  # elements no entry reads (padding)
                cursor = end
            self._sizes.append(end - start)
            self._at[i] = len(self._sizes) - 1
        if cursor < buffer.numel():
            self._sizes.append(buffer.numel() - cursor)

    def __call__(self) -> list[torch.Tensor | None]:
        buffer = self._buffer
        if buffer.numel() != self._numel:
            raise ValueError(f"{self._label} has {buffer.numel()} elements, not the {self._numel} it had when "
                             "TensorMetrics was built: keep its size (update it in place), or build TensorMetrics again")
        # The views of the last call while the buffer keeps its memory (updated in place, as
        # FlatBuffer asks): they see its current values.
        cached = self._views
        if cached is None or not kept(cached[0], buffer):
            parts = buffer.detach().split(self._sizes)
            cached = self._views = (Memory.of(buffer), [None if k is None else parts[k] for k in self._at])
        return list(cached[1])


@dataclass(frozen=True, slots=True)
class Memory:
    """Where a tensor's elements lie, as views made from it depend on it: its storage (a view of
    it holds it alive), the storage's address, the first element and the dtype."""

    storage: torch.UntypedStorage
    address: int
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Memory:
        """``tensor``'s memory now (its storage object is held from here on)."""
        storage = tensor.untyped_storage()
        return cls(storage, storage.data_ptr(), int(tensor.storage_offset()), tensor.dtype)


def kept(memory: Memory, tensor: torch.Tensor) -> bool:
    """Whether views made from ``tensor`` when it had ``memory`` still read its elements: the
    same storage object (``memory`` holds it alive, so no other storage can take its place),
    not reallocated since (freed with ``resize_(0)`` and grown again), from the same element,
    as the same dtype."""
    storage = tensor.untyped_storage()
    return (storage._cdata == memory.storage._cdata and storage.data_ptr() == memory.address
            and tensor.storage_offset() == memory.offset and tensor.dtype == memory.dtype)


class FlatSource:
    """One source kind read from all its flat buffers (a distributed optimizer keeps several:
    dense and expert parameters, one per dtype or per bucket): the sites and readers are found
    once, the tensors at each due step (:meth:`tensors`).

    Attributes:
        sites: per manifest entry, its FlatShard site where a buffer holds it, else its own.
        covered: per manifest entry, whether a buffer holds it (others are read as usual).
        complete: whether the buffers hold every manifest entry.

    Raises:
        ConfigError: a parameter listed in two buffers of the kind (it would count twice), or
            what :meth:`FlatBuffer.layout` raises.
    """

    def __init__(self, buffers: Sequence[FlatBuffer], manifest: Manifest, topology_axes: Sequence[str]) -> None:
        self.sites = [e.site(buffers[0].kind) for e in manifest.entries]
        self.covered = [False] * len(self.sites)
        self._readers: list[tuple[list[int], Reader]] = []
        for fb in buffers:
            mine, reader = fb.layout(manifest, topology_axes)
            held = [i for i, covers in enumerate(fb.covers(manifest)) if covers]
            for i in held:
                if self.covered[i]:
                    raise ConfigError(f"parameter {manifest.entries[i].name!r} is in two flat buffers of kind "
                                      f"{fb.kind!r}; list each parameter in one buffer per kind")
                self.sites[i], self.covered[i] = mine[i], True
            self._readers.append((held, reader))
        self.complete = all(self.covered)

    def tensors(self) -> list[torch.Tensor | None]:
        """Per manifest entry, this due step's local tensor from its buffer; None where no
        buffer holds it (or the buffer has no value yet: Adam state before the first step)."""
        if len(self._readers) == 1 and self.complete:
            return self._readers[0][1]()
        out: list[torch.Tensor | None] = [None] * len(self.sites)
        for held, reader in self._readers:
            read = reader()
            for i in held:
                out[i] = read[i]
        return out


def owned_part(site: Site, shape: tuple[int, ...], entry: tuple[int, int], owned: tuple[int, int], axis: str,
               topology_axes: Sequence[str]) -> tuple[Site, int, int]:
    """The site of an entry of logical ``shape`` whose elements ``entry = (start, end)`` of a
    flat concatenation meet this rank's ``owned = (lo, hi)`` range of it, sharded on ``axis``:
    ``FlatShard`` of the overlap on ``axis`` (empty where they do not meet), the site's other
    placements kept, in ``topology_axes`` order; and the overlap's bounds ``(a, b)`` in the
    concatenation (``a == b`` when empty). Shared by every flat-buffer reader (ZeRO buffers,
    Megatron's distributed optimizer)."""
    (start, end), (lo, hi) = entry, owned
    a, b = max(start, lo), min(end, hi)
    a, b = (a, b) if a < b else (start, start)
    shard = FlatShard(shape, start=a - start, end=b - start)
    placements = tuple(p for p in site.placements if p[0] != axis) + ((axis, shard),)
    order = {n: i for i, n in enumerate(topology_axes)}
    placements = tuple(sorted(placements, key=lambda ap: order.get(ap[0], 0)))
    return dataclasses.replace(site, placements=placements), a, b


def _range_of(name: str, manifest: Manifest, param: torch.Tensor, stored: tuple[int, int]) -> tuple[int, int]:
    """Elements of entry ``name`` in the flat concatenation: its stored parameter's ``stored``
    range, or the part of it an expert slice of a stacked tensor covers (a contiguous run).

    Raises ``ConfigError`` for a slice that is not one run of the flattened parameter in its
    logical order (a transposed or non-contiguous slice).
    """
    view = manifest.views.get(name)
    if view is None:
        return stored
    piece = view(torch.empty(tuple(param.shape), device="meta"))
    if view.transposed or not piece.is_contiguous():
        raise ConfigError(f"{name} is a slice of {list(param.shape)} that is not one run of the flattened "
                          "parameter in its own row-major order, so its part of the flat buffer has no FlatShard "
                          "placement; keep that parameter out of the flat buffer")
    start = stored[0] + int(piece.storage_offset())
    return start, start + int(piece.numel())
