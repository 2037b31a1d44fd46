"""The global shape of a plain tensor split by hand, from what each rank holds.

A DTensor knows its global shape. A plain tensor that a framework splits (Megatron's
tensor-parallel weights) or that the config declares ``Shard(d)`` on an axis holds only its
shard: each rank lists its local shape. The manifest needs the global one: statistics that
place lines or elements by coordinate (the mean row and column L2 norms, placeholders, replica
checks) derive each rank's local shape from it as ``torch.chunk`` splits it.

So each rank tags its manifest row of such a tensor with its coordinates on the axes a
framework or config ``Shard`` names (:func:`shard_tag`): the tagged rows differ along those
axes, the manifest exchange gathers them there (start-up only; bytes grow with those axes'
sizes and the tensor count), and :func:`global_shape` sums the local sizes along each sharded
dim and checks every rank's shard against ``torch.chunk``'s split of the result.
"""

from __future__ import annotations

import itertools
import math
from fnmatch import fnmatchcase
from typing import Mapping, Sequence

from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.placements import Placement, parse_placement
from tmetrics_core.topology import Topology

__all__ = ["global_shape", "shard_tag"]

Tag = tuple[tuple[str, int], ...]
"""``(axis, coordinate)`` of the listing rank on each axis that a ``Shard`` of the tensor names."""


def shard_tag(name: str, framework: Mapping[str, Placement], overrides: Mapping[str, Mapping[str, str]],
              topology: Topology) -> Tag:
    """This rank's coordinates on the axes of size > 1 where the framework's placements or a
    config override matching canonical ``name`` put a ``Shard`` on a tensor dim (in topology
    order); empty for a tensor no such ``Shard`` names. Never raises: a bad override is refused
    after the exchange, on every rank alike."""
    axes = {a for a, p in framework.items() if isinstance(p, Placement) and p.shard_dim() is not None}
    for pattern, spec in overrides.items():
        if fnmatchcase(name, pattern):
            for axis, text in spec.items():
                try:
                    if parse_placement(text).shard_dim() is not None:
                        axes.add(axis)
                except PlacementError:
                    continue
    coords = topology.coords()
    return tuple((a, coords[a]) for a in topology.names if a in axes and topology.axes[a].size > 1)


def global_shape(name: str, local: Mapping[Tag, tuple[int, ...]], placements: Sequence[tuple[str, Placement]],
                 origins: Mapping[str, str], topology: Topology) -> tuple[int, ...]:
    """The global shape of plain tensor ``name`` from its local shapes by tag (every rank's,
    after the exchange): along each dim that ``placements`` shard, the sum of the local sizes
    over the sharding axes' coordinates; elsewhere the local size.

    Raises:
        ConfigError: a coordinate of a sharding axis lists no shard (the tensor is not split
            over the whole axis), or a rank's shard is not ``torch.chunk``'s split of the global
            shape (``Shard`` follows ``torch.chunk``, as DTensor does): the message gives the local
            shapes by coordinate and the fix.
    """
    described = "; ".join(f"{dict(tag)}: {list(s)}" for tag, s in sorted(local.items()))
    tagged = [a for a, _ in next(iter(local))]
    if any([a for a, _ in tag] != tagged for tag in local):
        raise ConfigError(f"ranks place tensor {name!r} differently: some name a Shard on axes "
                          f"{sorted({a for tag in local for a, _ in tag})} that others do not (local shapes by "
                          f"coordinate: {described}). Pass the same placements on every rank", path="placements")
    sizes = {a: topology.axes[a].size for a in topology.names}
    shards = [(a, p, d) for a, p in placements if a in tagged and (d := p.shard_dim()) is not None]
    by_coords = {tuple(c for _, c in tag): shape for tag, shape in local.items()}
    base = tuple(min(coords[i] for coords in by_coords) for i in range(len(tagged)))
    shape = list(by_coords[base] if base in by_coords else next(iter(by_coords.values())))
    for dim in sorted({d for _, _, d in shards}):
        axes = [a for a, _, d in shards if d == dim]
        total = 0
        for combo in itertools.product(*(range(sizes[a]) for a in axes)):
            at = dict(zip(axes, combo))
            coords = tuple(at.get(a, base[i]) for i, a in enumerate(tagged))
            if coords not in by_coords:
                raise ConfigError(
                    f"tensor {name!r} is placed Shard({dim}) on {axes} ({_origins(axes, origins)}), but no rank at "
                    f"{at} lists a shard of it (local shapes by coordinate: {described}). A Shard must split the "
                    "tensor over every rank of its axis; fix the placement or the glob", path="placements")
            total += by_coords[coords][dim]
        shape[dim] = total
    for tag, seen in local.items():
        want = list(shape)
        at_tag = dict(tag)
        for axis, p in placements:
            d = p.shard_dim()
            if d is not None and axis in at_tag:
                want[d] = p.local_length(want[d], sizes[axis], at_tag[axis])  # type: ignore[attr-defined]
        if tuple(want) != tuple(seen):
            split = ", ".join(f"{a}={p}" for a, p, _ in shards) or "no Shard"
            raise ConfigError(
                f"tensor {name!r} ({split}; {_origins(tagged, origins)}) has local shapes {described}, so its global "
                f"shape is {shape} ({math.prod(shape)} elements); but {split} splits that as torch.chunk does, "
                f"giving {want} at {at_tag}. Split the tensor as torch.chunk does (or make it a DTensor), or declare "
                "the placement that matches how it is split", path="placements")
    return tuple(shape)


def _origins(axes: Sequence[str], origins: Mapping[str, str]) -> str:
    return ", ".join(f"{a}: {origins.get(a, 'no placement')}" for a in axes)
