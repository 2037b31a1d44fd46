"""Slices of stacked tensors: where one expert (and fused part) of a stored tensor lies on each rank.

transformers 5.x, torchtitan ``GroupedExperts`` and other grouped-GEMM code keep every expert
of a layer in one stored tensor ``[E, ...]`` (``canonicalize(..., split_stacked=True)`` names
each slice and gives its ``region`` in the stored tensor's global coordinates). The manifest
lists one site per slice; this module says, for one rank, which placement each slice has on
every axis and how to read its local part as a view of the local stored tensor (parameter,
gradient, optimizer state, snapshot: all share the stored tensor's local shape).

A DTensor axis that shards a dim the slice is narrowed on (the expert dim, a fused-part dim)
makes the slice ``Owned`` by the axis coordinate whose ``torch.chunk`` piece contains the
slice's whole range (uneven and empty pieces included); a range cut by a piece boundary has no
exact placement and is a :class:`~tmetrics_core.errors.PlacementError`. An axis that shards a dim
the slice spans whole keeps ``Shard`` on that dim of the slice's logical shape. An axis of size 1
holds the whole piece under any placement (torchtitan's ``efsdp`` of size 1 under expert
parallelism gives the experts ``_StridedShard`` there) and is ``Replica``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.errors import PlacementError
from tmetrics_core.placements import Owned, Partial, Placement, Replica, Shard, chunk_range

__all__ = ["SliceView", "place_slice"]


@dataclass(frozen=True, slots=True)
class SliceView:
    """How to read one slice from the LOCAL stored tensor, as a view (no copy).

    - ``region``: ``(dim, start, stop)`` ranges of the local tensor holding the slice.
    - ``squeeze``: the expert dim, dropped after narrowing (None for a fused part alone).
    - ``transposed``: the slice's logical form is the transpose of its last two dims.
    - ``groups``: ``(dim, length)``: dim ``dim`` is unflattened into ``[-1, length]`` before
      narrowing (``region`` is in those coordinates), or None.
    """

    region: tuple[tuple[int, int, int], ...]
    squeeze: int | None
    transposed: bool
    groups: tuple[int, int] | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The slice of ``tensor`` (the local stored tensor, or one of its shape), a view."""
        out = tensor
        if self.groups is not None:
            out = out.unflatten(self.groups[0], (-1, self.groups[1]))
        for dim, start, stop in self.region:
            out = out.narrow(dim, start, stop - start)
        if self.squeeze is not None:
            out = out.squeeze(self.squeeze)
        if self.transposed and out.dim() >= 2:
            out = out.transpose(-2, -1)
        return out


def place_slice(name: str, original: str, region: Sequence[tuple[int, int, int]], squeeze: int | None,
                transposed: bool, global_shape: Sequence[int],
                axes: Sequence[tuple[str, Any]], coords: Mapping[str, int], sizes: Mapping[str, int],
                groups: tuple[int, int] | None = None
                ) -> tuple[tuple[tuple[str, Placement], ...], SliceView | None]:
    """The slice's placements (``(axis, placement)`` per mesh dim) and its view on the
    rank at ``coords``, or None for the view when that rank does not hold it.

    Args:
        name, original: the slice's canonical name and the stored tensor's name (for errors).
        region: the slice's ``(dim, start, stop)`` ranges in the stored tensor's GLOBAL shape.
        squeeze: the stored dim indexing experts (dropped in the slice), or None.
        transposed: the slice's logical form swaps its last two dims.
        global_shape: the stored tensor's global shape.
        axes: ``(axis name, torch DTensor placement)`` per mesh dim, in mesh order; empty for
            a plain tensor (which every rank holding it holds whole).
        coords, sizes: this rank's coordinate on, and the size of, every axis.
        groups: ``(dim, length)``: the stored dim ``dim`` read as ``[groups, length]`` (a fused
            q/k/v tensor's rows per key/value head); ``region`` is in those coordinates. A
            ``Shard`` of that dim must cut it between groups on every rank of its axis.

    Raises:
        PlacementError: a mesh dim of more than one rank places the tensor otherwise than DTensor's plain ``Shard``,
            ``Replicate`` or ``Partial`` (``_StridedShard`` interleaves a dim across ranks), or a
            piece boundary cuts the slice's range (it would be split unevenly across some of the
            axis ranks, which no placement expresses), or a ``Shard`` of a grouped dim that cuts
            a group.
    """
    from torch.distributed.tensor import Shard as DTensorShard

    if groups is not None:
        global_shape, axes = _regrouped(name, original, global_shape, axes, sizes, groups)

    wanted = {dim: (start, stop) for dim, start, stop in region}
    held_lo = {dim: 0 for dim in range(len(global_shape))}  # start of the held piece, per dim
    held_len = dict(enumerate(global_shape))
    placements: list[tuple[str, Placement]] = []
    here = True
    for axis, p in axes:
        size, mine = sizes[axis], coords.get(axis, 0)
        if size == 1:  # one rank holds the whole piece, whatever the placement says
            placements.append((axis, Replica()))
            continue
        if p.is_partial():
            op = str(getattr(p, "reduce_op", "sum"))
            placements.append((axis, Partial(op if op in ("sum", "avg", "max", "min") else "sum")))  # type: ignore[arg-type]
            continue
        if type(p) is not DTensorShard:
            if p.is_replicate():
                placements.append((axis, Replica()))
                continue
            raise PlacementError(
                f"{name}: its stored tensor {original!r} is placed {p!r} on axis {axis!r}; tmetrics places expert "
                "slices of tensors that are Shard(dim) (plain), Replicate or Partial on each mesh dim, and this "
                "placement (e.g. _StridedShard, which interleaves a dim across ranks) it cannot place exactly. "
                "Shard the experts with a plain Shard(dim) (e.g. FSDP2 shard_placement_fn) or leave the tensor "
                "unsharded there")
        dim = p.dim % len(global_shape)
        if dim not in wanted:
            logical = _logical_dim(dim, squeeze, transposed, len(global_shape))
            placements.append((axis, Shard(logical)))
            start, length = chunk_range(held_len[dim], size, mine)
            held_lo[dim] += start
            held_len[dim] = length
            continue
        start, stop = wanted[dim]
        owner = None
        for c in range(size):
            lo, length = chunk_range(held_len[dim], size, c)
            lo += held_lo[dim]
            if lo <= start and stop <= lo + length:
                owner = (c, lo, length)
                break
        if owner is None:
            pieces = [chunk_range(held_len[dim], size, c) for c in range(size)]
            raise PlacementError(
                f"{name}: rows [{start}, {stop}) of dim {dim} of {original!r} {list(global_shape)} are cut by "
                f"the Shard({dim}) pieces over axis {axis!r} (starts, lengths {pieces} from {held_lo[dim]}), so "
                "the slice is split unevenly across some ranks of the axis and has no exact placement. Shard "
                "a dim the slice spans whole, or a number of rows the fused parts split evenly")
        c, lo, length = owner
        placements.append((axis, Owned(c)))
        here = here and c == mine
        held_lo[dim], held_len[dim] = lo, length
    if not here:
        return tuple(placements), None
    local = tuple((dim, start - held_lo[dim], stop - held_lo[dim]) for dim, (start, stop) in sorted(wanted.items()))
    return tuple(placements), SliceView(local, squeeze, transposed, groups)


def _regrouped(name: str, original: str, global_shape: Sequence[int], axes: Sequence[tuple[str, Any]],
               sizes: Mapping[str, int], groups: tuple[int, int]) -> tuple[tuple[int, ...], tuple[tuple[str, Any], ...]]:
    """The stored shape with dim ``groups[0]`` unflattened into ``[n, length]``, and the mesh
    placements on it: a plain ``Shard`` of a later dim moves one dim on; one of the grouped dim
    becomes a ``Shard`` of the group dim when every rank's ``torch.chunk`` piece is whole groups
    (then it is exactly the chunk of the groups), else a PlacementError."""
    from torch.distributed.tensor import Shard as DTensorShard

    gdim, length = groups
    rows = global_shape[gdim]
    n = rows // length
    shape = (*global_shape[:gdim], n, length, *global_shape[gdim + 1:])
    out = []
    for axis, p in axes:
        if type(p) is DTensorShard and sizes[axis] > 1:
            dim = p.dim % len(global_shape)
            if dim == gdim:
                size = sizes[axis]
                pieces = [chunk_range(rows, size, c) for c in range(size)]
                if pieces != [(s * length, k * length) for s, k in (chunk_range(n, size, c) for c in range(size))]:
                    raise PlacementError(
                        f"{name}: {original!r} {list(global_shape)} is split on axis {axis!r} into row pieces "
                        f"(starts, lengths) {pieces}, which cut its groups of {length} rows (one key/value head "
                        "with its query heads); its q/k/v views have no exact placement. Shard it by whole key/"
                        "value heads (n_kv_heads divisible by the axis size) or measure attn.qkv whole")
                p = DTensorShard(gdim)
            elif dim > gdim:
                p = DTensorShard(dim + 1)
        out.append((axis, p))
    return shape, tuple(out)


def _logical_dim(dim: int, squeeze: int | None, transposed: bool, ndim: int) -> int:
    """The dim of the slice's logical form that stored dim ``dim`` becomes."""
    out = dim - 1 if squeeze is not None and dim > squeeze else dim
    rank = ndim - (1 if squeeze is not None else 0)
    if transposed and rank >= 2 and out >= rank - 2:
        out = 2 * rank - 3 - out  # rank-2 <-> rank-1
    return out
