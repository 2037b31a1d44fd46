"""torchtitan without glue: the topology from its ``ParallelDims`` (or from the DeviceMeshes the
parameters carry). Its ``TokenChoiceTopKRouter`` modules are observed by
`tmetrics_core.sources.routers`, like every framework's routers.

torchtitan builds two meshes over the same ranks: a dense one, ``(pp, dp_replicate, fsdp, tp)``
(``dp_shard`` and ``cp`` instead of ``fsdp`` under its ``spmd_types`` and ``full_dtensor``
backends), and, with expert parallelism, a sparse one, ``(pp, dp_replicate, efsdp, ep)`` with
``efsdp * ep == fsdp * tp``. Every dim of both becomes a tmetrics axis; each parameter is
reduced over the axes of its own DTensor, and the other mesh's axes, whose ranks lie inside
its mesh, are ``covered`` for it (:mod:`tmetrics_core.manifest.table`): no placement, no
reduction, no Replica claim, so the overlap counts nothing twice. Tokens differ across the
data-parallel axes only (``dp_replicate``, ``fsdp`` or ``dp_shard`` and ``cp``): those are the
population axes, so a token on an ``ep`` rank is not counted twice.

torchtitan is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.adapter import BaseAdapter, Prepared
from tmetrics_core.topology import Topology

__all__ = ["Torchtitan", "is_parallel_dims", "parallel_dims_topology", "parameter_topology"]

_AXES = ("pp", "dp_replicate", "fsdp", "dp_shard", "cp", "tp", "efsdp", "ep")
"""torchtitan's one-dimensional mesh names that parameters and tokens are placed on, outer to
inner (``batch``, ``loss`` and ``dp`` are flattened views of these and left out)."""
_DATA_AXES = frozenset({"dp_replicate", "fsdp", "dp_shard", "cp"})


def is_parallel_dims(obj: Any) -> bool:
    """Whether ``obj`` is a torchtitan ``ParallelDims`` (checked by type name and the method
    tmetrics reads, so torchtitan need not be imported)."""
    return type(obj).__name__ == "ParallelDims" and callable(getattr(obj, "get_optional_mesh", None))


def parallel_dims_topology(parallel_dims: Any) -> Topology:
    """The topology of a torchtitan run from its ``ParallelDims`` (the meshes are built on first
    use, as torchtitan's own accessors do).

    Axes: ``pp``, ``dp_replicate``, ``fsdp`` (or ``dp_shard`` and ``cp``), ``tp``, ``efsdp``,
    ``ep``, each bound to torchtitan's process group, size 1 where the degree is 1. Under the
    legacy backend ``cp`` is folded into ``fsdp`` and is not a separate axis.

    Raises:
        ConfigError: ``parallel_dims`` is not a ``ParallelDims``.
    """
    if not is_parallel_dims(parallel_dims):
        raise ConfigError(f"expected torchtitan's ParallelDims, got {type(parallel_dims).__name__}")
    meshes: dict[str, Any] = {}
    for name in _AXES:
        try:
            meshes[name] = parallel_dims.get_optional_mesh(name)
        except ValueError:  # not a mesh dim under this spmd_backend
            continue
    if "fsdp" in meshes:
        meshes.pop("cp", None)
    groups = {name: (mesh.get_group() if mesh is not None and mesh.size() > 1 else None)
              for name, mesh in meshes.items()}
    return Topology.from_groups(groups, population_axes=[n for n in groups if n in _DATA_AXES])


def parameter_topology(model: torch.nn.Module) -> Topology | None:
    """The topology from the DeviceMeshes of ``model``'s parameters when every parameter is a
    DTensor (torchtitan with FSDP2 always is), else None. Population axes are the
    data-parallel ones named as torchtitan names them (``dp_replicate``, ``fsdp``, ``dp_shard``,
    ``cp``, ``dp``); name the axes with ``axes=`` when a model uses other names.

    Raises:
        ConfigError: a mesh without dim names, or one dim name on different ranks in two meshes.
    """
    from torch.distributed.tensor import DTensor

    meshes: dict[int, Any] = {}
    for param in model.parameters():
        if not isinstance(param, DTensor):
            return None
        meshes.setdefault(id(param.device_mesh), param.device_mesh)
    if not meshes:
        return None
    names = [n for m in meshes.values() for n in (m.mesh_dim_names or ())]
    return Topology.from_meshes(meshes.values(), population_axes=[n for n in dict.fromkeys(names)
                                                                  if n in _DATA_AXES | {"dp"}])


class Torchtitan(BaseAdapter):
    """The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of torchtitan and of
    models whose every parameter is a DTensor (FSDP2, tensor parallelism): detected from
    ``mesh=ParallelDims`` or such a model; the topology from the ``ParallelDims``, or, when
    neither ``mesh=`` nor ``axes=`` is given and the parameters' meshes span several ranks,
    from those meshes (:func:`parameter_topology`). Placements come from the DTensors
    themselves (:mod:`tmetrics_core.manifest.dtensor`); model and optimizer are read as given."""

    name = "torchtitan"
    layouts: tuple[str, ...] = ("torchtitan",)

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        if is_parallel_dims(mesh):
            return True
        from torch.distributed.tensor import DTensor

        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
        return bool(params) and all(isinstance(p, DTensor) for p in params)

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        if is_parallel_dims(mesh):
            return parallel_dims_topology(mesh)
        if mesh is not None or axes is not None:
            return None
        found = parameter_topology(model)
        return found if found is not None and found.world_size > 1 else None

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        return Prepared(model=model, optimizer=optimizer)
