"""Sharing the manifest's holdings across ranks, axis by axis, through the collectives seam.

Every rank must end with the same union of what all ranks hold (``Manifest`` infers placements
from it), but most axes carry no news: the ranks of a data-parallel or DTensor-sharded axis list
the same rows. So per axis of size > 1:

1. one ``all_reduce(MAX)`` of ``[fingerprint, -fingerprint]`` over the axis group says whether
   its ranks list the same rows (max = min);
2. one ``all_reduce(MAX)`` per axis of the vector of "differs" flags makes the verdict the same
   on every rank (a MAX over each axis in turn is a MAX over the whole mesh);
3. only the axes that differ (pipeline stages, expert parallelism, tensors split by hand)
   exchange holdings: one ``all_gather_object`` over their joint group, or one per axis, each
   sending the holdings gathered so far, when the topology cannot build a joint group.

On an axis whose ranks agree every tensor is held on every coordinate (:meth:`Holdings.spread`).
What a rank receives is the holdings of the ranks that differ from it only along differing axes:
each distinct tensor about once, whatever the number of data-parallel replicas; per-rank bytes
grow with the tensor count and the sizes of the differing axes, never with the world size.
"""

from __future__ import annotations

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.manifest.holdings import Holdings

__all__ = ["share_holdings"]


def share_holdings(holdings: Holdings, executor: Executor) -> Holdings:
    """The union of ``holdings`` over every rank of ``executor.topology``; call on every rank.

    Collectives go through ``executor.comm`` (bounded waits) and are counted in
    ``executor.stats`` under each axis name (or the joint name ``pp+ep``).

    Raises:
        TMetricsError: a rank never joined one of the collectives (from the seam).
    """
    topology = executor.topology
    axes = [a for a in topology.names if topology.axes[a].size > 1 and topology.axes[a].group is not None]
    if topology.world_size == 1 or not axes:
        return holdings
    fingerprint = holdings.fingerprint()
    differs = []
    for axis in axes:
        spread = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=executor.device)
        executor.all_reduce(spread, "max", axis)
        differs.append(int(spread[0].item() != -spread[1].item()))
    agreed = torch.tensor(differs, dtype=torch.int64, device=executor.device)
    for axis in axes:
        executor.all_reduce(agreed, "max", axis)
    differing = tuple(a for a, flag in zip(axes, agreed.tolist()) if flag)
    shared = Holdings()
    if not differing:
        shared.merge(holdings)
    elif (joint := topology.joint_group(differing)) is not None:
        for other in executor.gather_objects(holdings, joint, "+".join(differing)):
            shared.merge(other)
    else:
        shared = holdings
        for axis in differing:
            step = Holdings()
            for other in executor.gather_objects(shared, topology.axes[axis].group, axis):
                step.merge(other)
            shared = step
    for axis in axes:
        if axis not in differing:
            shared.spread(axis, topology.axes[axis].size)
    return shared
