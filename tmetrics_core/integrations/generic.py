"""The run without a framework tmetrics knows: plain torch, DDP, FSDP2 and DTensor models.

Always detected and listed last: the topology comes from the user's ``mesh=`` (a DeviceMesh
with dim names) or ``axes=`` (``{axis: process group}``); without either, one process. The
model and optimizer are read as they were given.
"""

from __future__ import annotations

from typing import Any, Mapping

from tmetrics_core.distributed import world
from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.adapter import BaseAdapter
from tmetrics_core.topology import Topology

__all__ = ["Generic"]


class Generic(BaseAdapter):
    """The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of no framework."""

    name = "torch"
    layouts: tuple[str, ...] = ("canonical",)

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return True

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology:
        """``Topology.from_mesh(mesh)``, ``Topology.from_groups(axes)``, else one process.

        Raises:
            ConfigError: torch.distributed runs several ranks but neither was given (tmetrics
                cannot guess which ranks hold replicas and which hold shards).
        """
        if mesh is not None:
            return Topology.from_mesh(mesh)
        if axes is not None:
            return Topology.from_groups(axes)
        if world.world_size() > 1:
            raise ConfigError(
                f"torch.distributed runs {world.world_size()} ranks but no topology was given; pass "
                "mesh=<DeviceMesh with dim names, or torchtitan's ParallelDims> or "
                "axes={'dp': process_group, ...} (plain DDP: "
                "axes={'dp': torch.distributed.group.WORLD})"
            )
        return Topology.single_process()
