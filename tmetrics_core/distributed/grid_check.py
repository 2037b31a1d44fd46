"""Whether named axis groups tile the world as a grid, in collectives of a fixed size.

A framework that hands tmetrics one process group per axis (Megatron-Core's parallel state)
claims that its groups are the rows of a grid: each rank has one coordinate per axis (its index
in that axis' group) and the group of an axis holds exactly the ranks that differ from it along
that axis only. :func:`check_grid` verifies the claim without gathering anything from every
rank, so its cost does not grow with the world size:

1. within each axis group (one all-reduce per axis of size > 1, 2 x (axes + 1) int64 values):
   every member names the same members (a CRC-32 of the ordered global ranks) and has the
   same coordinate on every *other* axis;
2. over the world (one all-reduce, 2 x axes + 1 values): every rank has the same axis sizes,
   and no rank found a disagreement in step 1 (so every rank raises, or none).

With the sizes' product equal to the world size this is the grid: walking along the groups
reaches every coordinate vector from any rank, so the coordinates are one-to-one with the
ranks, and a group whose members share every other coordinate is then exactly the ranks that
differ only along its axis. Each value is sent as ``x`` and ``-x`` and reduced by MAX, so one
reduction gives both the largest and the smallest. The collectives are
:class:`~tmetrics_core.distributed.collectives.TorchCollectives` (each wait bounded by its
timeout) unless the caller passes another :class:`Collectives`.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import torch

from tmetrics_core.distributed import world
from tmetrics_core.distributed.backends import object_device
from tmetrics_core.distributed.collectives import Collectives, TorchCollectives
from tmetrics_core.errors import ConfigError

__all__ = ["check_grid"]


def _fingerprint(ranks: tuple[int, ...]) -> int:
    """A CRC-32 of the ordered global ranks (fits int64 with its negation)."""
    return zlib.crc32(",".join(map(str, ranks)).encode())


def _spread(values: list[int], group: Any, collectives: Collectives) -> tuple[list[int], list[int]]:
    """The largest and the smallest of each of ``values`` over ``group``, in one all-reduce."""
    device = object_device(group)
    packed = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    collectives.all_reduce(packed, "max", group)
    reduced = packed.tolist()
    return reduced[:len(values)], [-v for v in reduced[len(values):]]


def check_grid(groups: Mapping[str, Any], *, framework: str, timeout_s: float = 60.0,
               collectives: Collectives | None = None) -> None:
    """Raise ``ConfigError`` on every rank unless the axis groups ``{axis: group or None}``
    (None: size 1) tile the world as a grid (see the module docstring). ``framework`` names
    whose groups they are in the message. Collective: every rank calls it with the same axes
    in the same order; 1 + (axes of size > 1) all-reduces, whatever the world size.

    Raises:
        ConfigError: the sizes do not multiply to the world size, ranks disagree on an axis'
            size, or an axis group's members differ on another axis' coordinate.
        TMetricsError: a collective did not complete within ``timeout_s``.
    """
    members = {axis: world.group_ranks(group) for axis, group in groups.items()}
    sizes = {axis: len(ranks) for axis, ranks in members.items()}
    total = world.world_size()
    product = 1
    for size in sizes.values():
        product *= size
    tiles = "" if product == total else (
        f"{framework}'s groups {sizes} multiply to {product} ranks, not the world size {total} (expert "
        "parallelism across context parallelism?)")
    if total == 1 and tiles:
        raise ConfigError(f"{tiles}; pass axes={{...}} yourself")
    if total == 1:
        return
    collectives = collectives if collectives is not None else TorchCollectives(timeout_s)
    here = world.rank()
    coords = {axis: ranks.index(here) for axis, ranks in members.items()}
    bad = tiles
    for axis, group in groups.items():
        if sizes[axis] == 1:
            continue
        others = [a for a in members if a != axis]
        mine = [_fingerprint(members[axis]), *(coords[a] for a in others)]
        high, low = _spread(mine, group, collectives)
        if not bad and high != low:
            split = [a for a, hi, lo in zip(others, high[1:], low[1:]) if hi != lo]
            bad = (f"{framework}'s {axis} group of rank {here} is {list(members[axis])}, but its members differ "
                   + (f"along {', '.join(split)}" if split else "on who the members are")
                   + f" (ranks differing only along {axis} would share every other coordinate)")
    names = list(members)
    high, low = _spread([int(bool(bad)), *(sizes[a] for a in names)], None, collectives)
    grid = f"its groups are not a grid of {', '.join(names)}; pass axes={{...}} yourself"
    if bad:
        raise ConfigError(f"{bad}: {grid}")
    if high[0]:
        raise ConfigError(f"another rank's {framework} axis group holds ranks that differ along another axis: {grid}")
    if high[1:] != low[1:]:
        raise ConfigError(f"{framework}'s {'/'.join(names)} sizes differ across ranks ({low[1:]} to {high[1:]}): "
                          f"{grid}")
