"""How each axis of a manifest tensor gets its placement, from what every rank holds.

:func:`merge` turns the rows shared across ranks (:class:`~tmetrics_core.manifest.holdings.Holdings`)
into :class:`~tmetrics_core.manifest.entry.TensorEntry` objects, taking each axis's placement from the
first of the config's ``placements:``, a framework's, the DTensor's, or inference (the order of
:data:`~tmetrics_core.manifest.entry.ORIGINS`); :func:`covered_axes` finds the axes a DTensor's
own mesh already covers; :func:`slice_of` places one expert slice of a stacked tensor.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping, cast

import torch

from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.manifest.entry import TensorEntry
from tmetrics_core.manifest.hand_split import global_shape
from tmetrics_core.manifest.holdings import Holdings, Row
from tmetrics_core.manifest.slices import SliceView, place_slice
from tmetrics_core.naming.name import CanonicalName
from tmetrics_core.naming.nearest import nearest
from tmetrics_core.placements import Owned, Placement, Replica, parse_placement
from tmetrics_core.topology import Topology

__all__ = ["covered_axes", "merge", "slice_of"]


def slice_of(cn: CanonicalName, p: torch.Tensor, topology: Topology
             ) -> tuple[tuple[tuple[str, Placement], ...], SliceView | None]:
    """Placements of the expert slice ``cn`` of stored parameter ``p`` and its view here (None
    when another rank holds it); see `tmetrics_core.manifest.slices.place_slice`."""
    from torch.distributed.tensor import DTensor

    mesh_axes: tuple[tuple[str, Any], ...] = ()
    if isinstance(p, DTensor):
        mesh_axes = tuple(zip(p.device_mesh.mesh_dim_names or (), p.placements))
    squeeze = cn.expert_dim if cn.expert is not None else None
    sizes = {a: topology.axes[a].size for a in topology.names}
    return place_slice(cn.name, cn.original, cn.region, squeeze, cn.transposed, tuple(p.shape), mesh_axes,
                       topology.coords(), sizes, cn.groups)


def merge(everything: Holdings, topology: Topology,
          overrides: Mapping[str, Mapping[str, str]]) -> list[TensorEntry]:
    """One entry per canonical name in ``everything`` (sorted), each axis placed by the first
    origin that gives one (see the module docstring).

    Raises:
        ConfigError: an override that matches no tensor or names no axis of ``topology``, a
            plain tensor whose shape or dtype differs across ranks, a tensor held on some but
            not all coordinates of an axis with nothing declared.
    """
    entries = []
    by_name = cast(dict[str, dict[Row, int]], everything.rows)  # keyed by canonical name in build
    for pattern in overrides:
        if not any(fnmatchcase(name, pattern) for name in by_name):
            raise ConfigError(f"{pattern!r} matches no tensor of the model on any rank; placements: globs take "
                              f"canonical names (see `tmetrics names`); nearest: {nearest([pattern], by_name)!r}",
                              path=f"placements.{pattern}")
    for name in sorted(by_name):
        variants = sorted(by_name[name].items(), key=lambda item: item[1])
        row = variants[0][0]
        from_dtensor = {a: parse_placement(p) for a, p in row[8]}
        from_framework = {a: parse_placement(p) for a, p in row[9]}
        override = _override(name, tuple(row[6]), overrides, topology)
        covered = set(row[10]) - set(override) - set(from_framework)
        if not from_dtensor and not override and not from_framework:
            _same_everywhere(name, variants, topology)
        held = everything.held[name]
        placements = []
        origins = []
        for axis in topology.names:
            size = topology.axes[axis].size
            for origin, known in (("declared", override), ("framework", from_framework), ("dtensor", from_dtensor)):
                if axis in known:
                    placements.append((axis, known[axis]))
                    origins.append((axis, origin))
                    break
            else:
                if axis in covered:
                    origins.append((axis, "covered"))
                elif size > 1:
                    placements.append((axis, _infer(name, axis, size, held.get(axis, {0}))))
                    origins.append((axis, "inferred"))
        holders = tuple((a, tuple(sorted(held[a]))) for a in topology.names
                        if a in held and len(held[a]) < topology.axes[a].size)
        shape = tuple(row[6]) if not row[11] else global_shape(
            name, {r[11]: tuple(r[6]) for r, _ in variants}, placements, dict(origins), topology)
        entries.append(TensorEntry(
            name=name, original=row[1], layer=row[2], expert=row[3], component=row[4], family=row[5],
            shape=shape, dtype=row[7], placements=tuple(p for p in placements if not p[1].is_replica()),
            holders=holders, origins=tuple(origins), frozen=all(r[12] for r, _ in variants),
        ))
    return entries


def covered_axes(name: str, p: torch.Tensor, topology: Topology) -> tuple[str, ...]:
    """Axes of size > 1 outside the mesh of DTensor ``p`` whose ranks all lie in that mesh
    (empty for a plain tensor).

    Raises:
        PlacementError: an axis whose ranks lie partly in the mesh: the tensor's layout on it
            is neither the DTensor's nor independent of it.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ()
    dims = set(p.device_mesh.mesh_dim_names or ())
    mesh_ranks = set(p.device_mesh.mesh.flatten().tolist())
    out = []
    for axis in topology.names:
        ranks = set(topology.axes[axis].ranks)
        if axis in dims or len(ranks) < 2:
            continue
        inside = ranks & mesh_ranks
        if inside == ranks:
            out.append(axis)
        elif inside != {topology.global_rank}:
            raise PlacementError(
                f"parameter {name!r} is a DTensor on mesh {tuple(p.device_mesh.mesh_dim_names or ())} over ranks "
                f"{sorted(mesh_ranks)}; axis {axis!r} (ranks {sorted(ranks)}) lies partly inside that mesh, so "
                "the tensor's placement on it is neither the DTensor's nor independent of it. Build the axes "
                "from meshes that nest (torchtitan's ParallelDims does)")
    return tuple(out)


def _same_everywhere(name: str, variants: list[tuple[Row, int]], topology: Topology) -> None:
    """A plain tensor without declared placements is a replica or owned: the same shape and
    dtype wherever it is held. Different ones mean a tensor split by hand (tensor parallel
    without DTensor), which inferring Replica would measure from one shard per rank.

    Raises:
        ConfigError: naming the tensor, two ranks that disagree and the placements to declare.
    """
    first, first_rank = variants[0]
    for row, rank in variants[1:]:
        if row[6] == first[6] and row[7] != first[7]:
            raise ConfigError(
                f"tensor {name!r} is {first[7]} on rank {first_rank} but {row[7]} on rank {rank} (same shape "
                f"{list(row[6])}): every rank must hold the model in the same dtype. Cast the model on every "
                "rank (or on none) before creating TensorMetrics",
            )
        if row[6] != first[6]:
            split = [a for a in topology.names if topology.axes[a].size > 1] or ["tp"]
            raise ConfigError(
                f"tensor {name!r} is {first[7]} {list(first[6])} on rank {first_rank} but {row[7]} "
                f"{list(row[6])} on rank {rank}: a plain tensor (not a DTensor) split by hand across ranks. "
                "tmetrics cannot tell how it is split; declare its placement in the config, e.g. "
                f"placements: {{'{name}': {{'{split[-1]}': 'S0'}}}} (Shard along dim 0 of the full tensor)",
                path="placements",
            )


def _infer(name: str, axis: str, size: int, coords: set[int]) -> Placement:
    seen = sorted(coords)
    if len(seen) == size:
        return Replica()
    if len(seen) == 1:
        return Owned(seen[0])
    raise ConfigError(
        f"tensor {name!r} is held on coordinates {seen} of axis {axis!r} (size {size}): neither all of "
        "them (Replica) nor one (Owned). Declare its placement in the config, e.g. placements: "
        f"{{'{name}': {{'{axis}': 'S0'}}}}",
        path="placements",
    )


def _override(name: str, shape: tuple[int, ...], overrides: Mapping[str, Mapping[str, str]],
              topology: Topology) -> dict[str, Placement]:
    """The config's placements for tensor ``name``, each checked against its shape and axis."""
    out: dict[str, Placement] = {}
    for pattern, spec in overrides.items():
        if not fnmatchcase(name, pattern):
            continue
        for axis, text in spec.items():
            if axis not in topology.axes:
                raise ConfigError(f"axis {axis!r} is not in the topology {list(topology.names)}",
                                  path=f"placements.{pattern}")
            try:
                placement = parse_placement(text)
            except PlacementError as exc:
                raise ConfigError(str(exc), path=f"placements.{pattern}.{axis}") from exc
            where = f"placements.{pattern}.{axis}"
            size = topology.axes[axis].size
            dim = placement.shard_dim()
            if dim is not None and dim >= len(shape):
                raise ConfigError(f"{placement} on tensor {name!r} of shape {shape}: a {len(shape)}-dim tensor "
                                  f"has dims 0..{len(shape) - 1}; fix the dim or the glob", path=where)
            if placement.is_owned() and getattr(placement, "rank") >= size:
                raise ConfigError(f"{placement} on tensor {name!r}: axis {axis!r} has {size} rank(s), "
                                  f"0..{size - 1}; fix the rank or the glob", path=where)
            out[axis] = placement
    return out
