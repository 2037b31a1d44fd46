"""The topology a framework integration passes when the user gives none."""

from __future__ import annotations

from typing import Any

from tmetrics_core.distributed import world

__all__ = ["default_axes"]


def default_axes(mesh: Any, axes: Any) -> Any:
    """``axes`` as given; when neither ``mesh`` nor ``axes`` is given and torch.distributed runs
    several ranks (the framework started DDP), ``{"dp": WORLD}``: every rank holds a replica of
    the model, whose gradients are all-reduced before they are read. tmetrics checks that
    claim: parameters and gradients that differ across ranks are a ``PlacementError``."""
    if mesh is None and axes is None and world.world_size() > 1:
        return {"dp": world.world_group()}
    return axes
