"""DTensor placements in tmetrics' vocabulary, one per mesh dim, checked against the local shard.

=================================  ==========================================
DTensor placement                  tmetrics placement
=================================  ==========================================
``Shard(d)``                       ``Shard(d)``
``_StridedShard(d, split_factor)``  ``StridedShard(d, split_factor)``
``Replicate()``                    ``Replica()``
``Partial(op)``, op sum/avg/max/min  ``Partial(op)``
anything else                      :class:`~tmetrics_core.errors.PlacementError`
=================================  ==========================================

``_StridedShard`` is what ``fully_shard`` gives a parameter that tensor parallelism already
shards along the same dim (FSDP2 over TP, HSDP over TP). The mapping is exact by construction
and verified: the local shape the placements predict for this rank must equal the DTensor's
local tensor, else a ``PlacementError``.
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.placements import Partial, Placement, Replica, Shard, StridedShard
from tmetrics_core import torch_private

__all__ = ["dtensor_placements"]

_PARTIAL_OPS = ("sum", "avg", "max", "min")


def dtensor_placements(tensor: torch.Tensor, name: str = "") -> tuple[tuple[str, Placement], ...] | None:
    """``(axis, placement)`` pairs of a DTensor in mesh-dim order (mesh dim names as axes), or
    None for a plain tensor.

    Args:
        tensor: a parameter, gradient or activation; a DTensor of any global shape.
        name: the tensor's name, for error messages.

    Raises:
        ConfigError: the DeviceMesh has no dim names.
        PlacementError: a placement tmetrics does not know (``_MaskPartial``, a ``Partial``
            whose reduce op is not sum/avg/max/min, a new placement type), naming the tensor and
            the placement; or a local tensor whose shape is not what the placements give.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial as TorchPartial
    from torch.distributed.tensor.placement_types import Replicate
    from torch.distributed.tensor.placement_types import Shard as TorchShard

    if not isinstance(tensor, DTensor):
        return None
    label = f"tensor {name!r}" if name else "a DTensor"
    names = tensor.device_mesh.mesh_dim_names
    if not names:
        raise ConfigError(
            f"{label} lives on a DeviceMesh without dim names; build the mesh with "
            "init_device_mesh(..., mesh_dim_names=(...)) so tmetrics can map its dims to axes"
        )
    out: list[tuple[str, Placement]] = []
    strided = torch_private.strided_shard()
    for axis, p in zip(names, tensor.placements):
        exact = type(p)  # subclasses (_MaskPartial) are other placements
        if isinstance(p, strided) and exact is strided:
            out.append((axis, StridedShard(p.dim, split_factor=int(p.split_factor))))
        elif isinstance(p, TorchShard) and exact is TorchShard:
            out.append((axis, Shard(p.dim)))
        elif isinstance(p, Replicate) and exact is Replicate:
            out.append((axis, Replica()))
        elif isinstance(p, TorchPartial) and exact is TorchPartial and str(p.reduce_op) in _PARTIAL_OPS:
            out.append((axis, Partial(str(p.reduce_op))))
        else:
            raise PlacementError(
                f"{label} has placement {p!r} on mesh dim {axis!r}, which tmetrics does not know "
                f"(it knows Shard, _StridedShard, Replicate and Partial of {list(_PARTIAL_OPS)}); "
                "redistribute it to one of those, or leave it out of the metric's select"
            )
    _check_local_shape(tensor, out, label)
    return tuple(out)


def _check_local_shape(tensor: Any, placements: list[tuple[str, Placement]], label: str) -> None:
    """The shape the placements give this rank must be the local tensor's (an unknown layout
    would otherwise be measured as if it were the one tmetrics assumed)."""
    mesh = tensor.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:
        return
    shape = list(tensor.shape)
    for (axis, p), coord, size in zip(placements, coords, mesh.shape):
        d = p.shard_dim()
        if d is not None:
            shape[d] = p.local_length(shape[d], size, coord)  # type: ignore[attr-defined]
    local = tuple(torch_private.held_local(tensor).shape)  # type: ignore[union-attr]
    if tuple(shape) != local:
        raise PlacementError(
            f"{label}: placements {tensor.placements} on mesh {mesh.mesh_dim_names} give this rank (coordinate "
            f"{list(coords)}) a local shape {tuple(shape)}, but its local tensor is {local}; tmetrics cannot "
            "tell which elements it holds"
        )
