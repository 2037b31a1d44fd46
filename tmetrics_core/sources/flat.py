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
from typing import Sequence

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.naming.manifest import Manifest
from tmetrics_core.placements import FlatShard
from tmetrics_core.site import Site

__all__ = ["FlatBuffer", "owned_part", "read_buffers"]


@dataclass(frozen=True)
class FlatBuffer:
    """This rank's range of a flat buffer holding source ``kind`` of ``params``.

    Attributes:
        kind: ``"grad"``, ``"param"`` (master weights), ``"exp_avg"`` or ``"exp_avg_sq"``.
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

    def read(self, manifest: Manifest, topology_axes: Sequence[str]) -> tuple[list[Site], list[torch.Tensor | None]]:
        """Sites (FlatShard on ``axis``) and local views for every manifest entry, in manifest
        order; entries not in the buffer keep their site and get None (see :meth:`covers`).

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
        tensors: list[torch.Tensor | None] = []
        for entry in manifest.entries:
            site = entry.site(self.kind)
            param = manifest.local.get(entry.name)
            if param is None or id(param) not in ranges:
                sites.append(site)
                tensors.append(None)
                continue
            owned, a, b = owned_part(site, entry.shape, _range_of(entry.name, manifest, param, ranges[id(param)]),
                                     (lo, hi), self.axis, topology_axes)
            sites.append(owned)
            tensors.append(self.buffer.detach()[a - lo:b - lo] if a < b else self.buffer.detach()[:0])
        return sites, tensors


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


def read_buffers(buffers: Sequence[FlatBuffer], manifest: Manifest, topology_axes: Sequence[str]
                 ) -> tuple[list[Site], list[torch.Tensor | None], list[bool]]:
    """Sites, local views and whether a buffer holds it, for every manifest entry, from all the
    buffers of one kind (a distributed optimizer keeps several: dense and expert parameters,
    one per dtype or per bucket). An entry in no buffer keeps its site and gets None, and is
    read as usual by the caller.

    Raises:
        ConfigError: a parameter listed in two buffers of the kind (it would count twice), or
            what :meth:`FlatBuffer.read` raises.
    """
    sites = [e.site(buffers[0].kind) for e in manifest.entries]
    tensors: list[torch.Tensor | None] = [None] * len(sites)
    covered = [False] * len(sites)
    for fb in buffers:
        mine, local = fb.read(manifest, topology_axes)
        for i, held in enumerate(fb.covers(manifest)):
            if not held:
                continue
            if covered[i]:
                raise ConfigError(f"parameter {manifest.entries[i].name!r} is in two flat buffers of kind "
                                  f"{fb.kind!r}; list each parameter in one buffer per kind")
            sites[i], tensors[i], covered[i] = mine[i], local[i], True
    return sites, tensors, covered


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
