"""Named parallel axes bound to process groups: the :class:`Topology`.

Words used throughout tmetrics: an *axis* is a named dimension of the device mesh (``dp``,
``tp``, ``ep``, ``pp``, ``cp``, ``fsdp``...), bound to the process group of the ranks that
differ only along it; a *dim* is a tensor dimension. The *axis rank* is a rank's coordinate
along one axis; the *global rank* its rank in the default group.

A topology whose axes all have size 1 needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from tmetrics_core.distributed import world
from tmetrics_core.errors import ConfigError

__all__ = ["Axis", "Topology", "POPULATION_EXCLUDED_AXES"]

POPULATION_EXCLUDED_AXES = frozenset({"tp", "pp"})
"""Axes whose ranks see the same tokens. On every other axis (``dp``, ``fsdp``, ``ep``, ``cp``,
``dp_shard``...) ranks see different tokens, so activations are a population split there."""


@dataclass(frozen=True, slots=True)
class Axis:
    """One named axis as this rank sees it.

    ``size`` ranks form the axis group ``group`` (None when ``size == 1``); this rank is axis
    rank ``rank`` in it; ``ranks`` lists the group's global ranks in axis-rank order.
    """

    name: str
    size: int
    rank: int
    group: Any
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name}={self.size}"


class Topology:
    """The named axes of a run, in a fixed order (outer to inner, as the mesh lists them).

    Build with :meth:`single_process`, :meth:`from_mesh` or :meth:`from_groups`. Reductions run
    over axes in this order, on every rank alike.
    """

    __slots__ = ("axes", "global_rank", "world_size", "population_axes", "_mesh_ranks", "_new_groups", "_joint")

    def __init__(self, axes: Iterable[Axis], *, global_rank: int, world_size: int,
                 population_axes: Iterable[str] | None = None, mesh_ranks: Any = None,
                 new_groups: Callable[[list[list[int]]], Any] | None = None) -> None:
        self.axes: dict[str, Axis] = {a.name: a for a in axes}
        self.global_rank = global_rank
        self.world_size = world_size
        self._mesh_ranks = mesh_ranks
        self._new_groups = new_groups
        self._joint: dict[tuple[str, ...], Any] = {}
        names = tuple(self.axes)
        if population_axes is None:
            population_axes = [n for n in names if n not in POPULATION_EXCLUDED_AXES]
        unknown = set(population_axes) - set(names)
        if unknown:
            raise ConfigError(f"population_axes {sorted(unknown)} are not axes; axes are {list(names)}")
        self.population_axes: tuple[str, ...] = tuple(n for n in names if n in set(population_axes))

    @classmethod
    def single_process(cls) -> "Topology":
        """No parallel axes: rank 0 of 1, no ``torch.distributed`` needed."""
        return cls((), global_rank=0, world_size=1)

    @classmethod
    def from_mesh(cls, mesh: Any, *, population_axes: Iterable[str] | None = None) -> "Topology":
        """Axes from a ``DeviceMesh``: each mesh dim name becomes an axis with its group.

        Raises ``ConfigError`` when the mesh has unnamed dims (pass ``mesh_dim_names``).
        """
        names = mesh.mesh_dim_names
        if not names:
            raise ConfigError(
                "the DeviceMesh has no dim names; build it with init_device_mesh(..., "
                "mesh_dim_names=('dp', 'tp')) so each dim becomes a named axis"
            )
        axes = []
        for name in names:
            group = mesh.get_group(name)
            size = mesh.size(mesh_dim=names.index(name))
            axes.append(Axis(name, size, mesh.get_local_rank(name), group if size > 1 else None,
                             world.group_ranks(group)))
        return cls(axes, global_rank=world.rank(), world_size=world.world_size(),
                   population_axes=population_axes, mesh_ranks=mesh.mesh.clone(), new_groups=world.new_subgroups)

    @classmethod
    def from_groups(cls, groups: Mapping[str, Any], *,
                    population_axes: Iterable[str] | None = None) -> "Topology":
        """Axes from an explicit ``{name: process_group}`` mapping (``None`` means size 1).

        Axes left out are treated as replicated: nothing is reduced over them.
        """
        axes = []
        rank = world.rank()
        for name, group in groups.items():
            if group is None:
                axes.append(Axis(name, 1, 0, None, (rank,)))
                continue
            size = world.world_size(group)
            axes.append(Axis(name, size, world.rank(group), group if size > 1 else None, world.group_ranks(group)))
        return cls(axes, global_rank=rank, world_size=world.world_size(), population_axes=population_axes)

    @classmethod
    def from_meshes(cls, meshes: Iterable[Any], *, population_axes: Iterable[str] | None = None) -> "Topology":
        """Axes from several DeviceMeshes over the same ranks, each dim name an axis (torchtitan's
        dense ``(dp_replicate, fsdp, tp)`` and sparse ``(dp_replicate, efsdp, ep)`` meshes), in
        first-seen order. Axes of different meshes may overlap (``efsdp x ep`` spans the ranks of
        ``fsdp x tp``): each tensor is reduced over its own axes only, so pass
        ``population_axes`` naming the axes whose ranks see different tokens, once each.

        Raises ``ConfigError`` for a mesh without dim names, or one dim name bound to different
        ranks in two meshes.
        """
        groups: dict[str, Any] = {}
        ranks: dict[str, list[int]] = {}
        for mesh in meshes:
            if not mesh.mesh_dim_names:
                raise ConfigError("a DeviceMesh has no dim names; build it with init_device_mesh(..., "
                                  "mesh_dim_names=(...)) so each dim becomes a named axis")
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name)
                members = list(world.group_ranks(group))
                if name in ranks and ranks[name] != members:
                    raise ConfigError(f"mesh dim {name!r} holds ranks {ranks[name]} in one DeviceMesh and {members} "
                                      "in another; give the axes explicitly with axes={name: process_group}")
                ranks[name] = members
                groups.setdefault(name, group if len(members) > 1 else None)
        return cls.from_groups(groups, population_axes=population_axes)

    def joint_group(self, axes: tuple[str, ...]) -> Any:
        """The process group spanning several axes at once (ranks that differ only along
        ``axes``), so one collective replaces one per axis; None when the topology cannot build
        it (no mesh layout known), and callers then reduce axis after axis.

        Creating a group is collective: every rank must ask for the same ``axes`` in the same
        order, which holds because plans are rank-symmetric. Groups are cached.
        """
        if len(axes) == 1:
            return self.axes[axes[0]].group
        if axes in self._joint:
            return self._joint[axes]
        if self._mesh_ranks is None or self._new_groups is None:
            return None
        names = list(self.axes)
        keep = [names.index(a) for a in axes]
        other = [i for i in range(len(names)) if i not in keep]
        table = torch.as_tensor(self._mesh_ranks).permute(*other, *keep)
        lists = table.reshape(-1, table[(0,) * len(other)].numel() if other else table.numel()).tolist()
        group = self._new_groups(lists)
        self._joint[axes] = group
        return group

    def axis(self, name: str) -> Axis:
        """The axis called ``name``; ``KeyError`` lists the valid names."""
        try:
            return self.axes[name]
        except KeyError:
            raise KeyError(f"no axis {name!r}; this topology has axes {list(self.axes)}") from None

    @property
    def names(self) -> tuple[str, ...]:
        """Axis names in reduction order."""
        return tuple(self.axes)

    def logs(self, log_rank: int) -> bool:
        """Whether this rank is the logging rank: global rank ``log_rank`` (config
        ``distributed.log_rank``, default 0) writes records to the sinks and prints tmetrics'
        warnings; every other rank keeps quiet. The one place this is decided.

        Raises:
            ConfigError: ``log_rank`` is not a rank of this world (nothing would be logged).
        """
        if not 0 <= log_rank < self.world_size:
            raise ConfigError(f"log_rank {log_rank} is not a rank of this job, whose world has {self.world_size} "
                              f"rank(s) (0..{self.world_size - 1}): no rank would write to the sinks. Set a rank "
                              "in that range (default 0)", path="distributed.log_rank")
        return self.global_rank == log_rank

    def coords(self) -> dict[str, int]:
        """This rank's axis rank on every axis."""
        return {a.name: a.rank for a in self.axes.values()}

    def tags(self) -> dict[str, str]:
        """Short facts for trackers: ``{"world_size": "4", "dp": "2", "tp": "2"}``."""
        out = {"world_size": str(self.world_size)}
        out.update({a.name: str(a.size) for a in self.axes.values()})
        return out

    def __repr__(self) -> str:
        inner = ", ".join(str(a) for a in self.axes.values()) or "single process"
        return f"Topology({inner}; rank {self.global_rank} of {self.world_size})"

