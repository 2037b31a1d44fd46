"""The questions tmetrics asks ``torch.distributed`` about the job's ranks and groups.

Everything outside :mod:`tmetrics_core.distributed` that needs to know which rank it runs on,
how many ranks a group holds, or which global ranks are in it asks here: none of these moves
data between ranks. A process without an initialized default group is rank 0 of a world of 1.
Creating groups is the one collective here (every rank takes part); data moves through
:mod:`tmetrics_core.distributed.collectives` only.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["group_ranks", "is_initialized", "new_subgroups", "rank", "world_group", "world_size"]


def is_initialized() -> bool:
    """Whether torch.distributed is built in and its default process group initialized."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (None: its global rank); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (None: the world); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` in group-rank order; ``(this rank,)`` for None (an axis of
    size 1, which tmetrics keeps without a group)."""
    if group is None:
        return (rank(),)
    return tuple(dist.get_process_group_ranks(group))


def world_group() -> Any:
    """The default group (every rank), as a group object for ``axes={"dp": ...}``."""
    return dist.group.WORLD


def new_subgroups(lists: list[list[int]]) -> Any:
    """This rank's group among ``lists`` (a partition of the world's ranks). Collective: every
    rank calls it with the same lists, in the same order as its other group creations."""
    # torch leaves new_subgroups_by_enumeration unannotated (torch 2.13).
    group, _ = dist.new_subgroups_by_enumeration(lists)  # type: ignore[no-untyped-call]
    return group
