"""Rounds: one set of collective requests reduced with as few collectives as the axes allow.

The requests of a round are bucketed by (axes, op, dtype) and each bucket is reduced with one
collective over the joint group of its axes; ``min`` rides in the ``max`` bucket negated
(``min x = -max -x``, exact). A small round goes out as ONE ``all_gather`` over the joint group
of all its axes and is reduced locally (NOTE [gathered rounds]). :class:`Rounds` counts every
call in a :class:`CollectiveStats`; the executor owns one and runs every round through it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.metrics.base import CollectiveRequest
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.topology import Topology

__all__ = ["CollectiveStats", "Rounds"]

_GATHER_LIMIT = 1 << 19
"""Most elements an all_gather of buckets may collect on one rank (members x values; 4 MiB in
float64); larger buckets are all-reduced."""

_GATHER_MEMBERS = 16
"""Most members of a gathered round: what a rank receives grows with the members, what an
all_reduce moves does not, so past this many ranks the buckets are all-reduced (per-rank bytes
of a due step then stay flat as the axes grow)."""

_Buckets = dict[tuple[tuple[str, ...], ReduceOpName, torch.dtype], list[CollectiveRequest]]
"""Requests by (axes, op, dtype); ``min`` rides in ``max`` negated, so op is ``sum`` or ``max``."""


@dataclass(slots=True)
class CollectiveStats:
    """Counters for benchmarks and tests: collective calls and elements moved, per axis."""

    calls: dict[str, int] = field(default_factory=dict)
    """Collective calls per label: an axis (``dp``), a joint group (``dp+tp``) or ``world``."""
    elements: dict[str, int] = field(default_factory=dict)
    """Elements this rank sent per label, summed over its calls, of any dtype (a gather of
    picklable objects counts 1)."""
    rounds: int = 0
    """Rounds reduced (:meth:`Rounds.reduce`)."""
    seconds: float = 0.0
    """Wall time spent inside data collectives (the communication itself), seconds."""

    def add(self, axis: str, numel: int) -> None:
        """Count one collective call on ``axis`` (a label of :attr:`calls`) that sends ``numel``
        elements from this rank. Counts only: it checks nothing and raises nothing."""
        self.calls[axis] = self.calls.get(axis, 0) + 1
        self.elements[axis] = self.elements.get(axis, 0) + numel

    @property
    def total_calls(self) -> int:
        """All collective calls counted, control collectives included."""
        return sum(self.calls.values())


class Rounds:
    """Reduces rounds of :class:`CollectiveRequest` over a :class:`Topology` (see the module
    docstring), counting each collective in ``stats``.

    Args:
        topology: the named axes (their groups and joint groups).
        comm: how to talk to other ranks (bounded waits).
        device: where packed buffers live (the executor's).
        stats: the counters every call adds to.
    """

    def __init__(self, topology: Topology, comm: Collectives, device: torch.device, stats: CollectiveStats) -> None:
        self.topology = topology
        self.comm = comm
        self.device = device
        self.stats = stats
        self._distributed = topology.world_size > 1

    def reduce(self, requests: Sequence[CollectiveRequest]) -> dict[Hashable, torch.Tensor]:
        """One round: requests bucketed by (axes, op, dtype) and each bucket reduced with one
        collective over the joint group of its axes. ``min`` rides in the ``max`` bucket of the
        same axes negated (``min x = -max -x``, exact), so a round issues at most two calls per
        distinct axis set and dtype."""
        self.stats.rounds += 1
        current = {r.key: r.value if r.value.device == self.device else r.value.to(self.device) for r in requests}
        buckets: _Buckets = {}
        for r in requests:
            axes = tuple(a for a in self.topology.names if a in r.axes and self.topology.axes[a].size > 1)
            if axes:
                op: ReduceOpName = "max" if r.op == "min" else r.op
                buckets.setdefault((axes, op, current[r.key].dtype), []).append(r)
        # One collective for the whole round when every value has one length on all ranks;
        # else one per axis set that has several buckets (NOTE [gathered rounds]).
        if len(buckets) > 1 and all(r.uniform for r in requests):
            union = tuple(a for a in self.topology.names if any(a in axes for axes, _, _ in buckets))
            if self._gathered(union, buckets, current):
                return current
        by_axes: dict[tuple[str, ...], _Buckets] = {}
        for key, bucket in buckets.items():
            by_axes.setdefault(key[0], {})[key] = bucket
        for axes, same in by_axes.items():
            if len(same) > 1 and self._gathered(axes, same, current):
                for key in same:
                    del buckets[key]
        for (axes, op, _dtype), bucket in buckets.items():
            values = [-current[r.key] if r.op == "min" else current[r.key] for r in bucket]
            packed = torch.cat(values) if len(values) > 1 else values[0].clone()
            group = self.topology.joint_group(axes)
            if group is not None or len(axes) == 1:
                self.all_reduce(packed, op, group, "+".join(axes))
            else:
                for axis in axes:
                    self.all_reduce(packed, op, self.topology.axes[axis].group, axis)
            for r, piece in zip(bucket, packed.split([v.numel() for v in values])):
                current[r.key] = -piece if r.op == "min" else piece
        return current

    def _gathered(self, union: tuple[str, ...],
                  buckets: _Buckets,
                  current: dict[Hashable, torch.Tensor]) -> bool:
        """Reduce ``buckets`` (each over axes within ``union``) with ONE collective: their values
        are packed in one float64 buffer, all-gathered over the joint group of ``union``, and
        each bucket is reduced locally over the rows of its peers, the members that differ from
        this rank only along the bucket's own axes, in member order (so every peer computes
        identical results). The caller guarantees one layout on every member: the buckets are
        all over ``union``, or every request is ``uniform``. Returns False, doing nothing, when
        the joint group cannot be built, the gathered table would exceed ``_GATHER_LIMIT``
        elements or the group ``_GATHER_MEMBERS`` ranks (then one ``all_reduce`` per bucket
        moves less data).

        NOTE [gathered rounds]: metric rounds are latency-bound (a few thousand values), so one
        all_gather beats an all_reduce per (axes, op). Buckets over fewer axes than the union
        may only join when every request is ``uniform``: otherwise a value may have another
        length on a member outside the bucket's own group, and the gathered rows would not line
        up."""
        sizes = [self.topology.axes[a].size for a in union]
        members = math.prod(sizes)
        total = sum(current[r.key].numel() for bucket in buckets.values() for r in bucket)
        small = total * members <= _GATHER_LIMIT and members <= _GATHER_MEMBERS
        group = self.topology.joint_group(union) if small else None
        if group is None:
            return False
        # Widened (and ``min`` negated) only once the round is known to be gathered.
        values = [[(-current[r.key] if r.op == "min" else current[r.key]).to(torch.float64) for r in bucket]
                  for bucket in buckets.values()]
        packed = torch.cat([v for vs in values for v in vs])
        self.stats.add("+".join(union), total)
        start = time.perf_counter()
        table = torch.stack(self.comm.all_gather(packed, group))  # [members, total], row-major over union
        self.stats.seconds += time.perf_counter() - start
        coords = [self.topology.axes[a].rank for a in union]
        strides = [math.prod(sizes[i + 1:]) for i in range(len(union))]
        offset = 0
        for ((axes, op, dtype), bucket), vs in zip(buckets.items(), values):
            fixed = [i for i, a in enumerate(union) if a not in axes]
            peers = [j for j in range(members) if all((j // strides[i]) % sizes[i] == coords[i] for i in fixed)]
            width = sum(v.numel() for v in vs)
            block = table[peers, offset:offset + width]
            reduced = (block.sum(0) if op == "sum" else block.amax(0)).to(dtype)
            for r, piece in zip(bucket, reduced.split([v.numel() for v in vs])):
                current[r.key] = -piece if r.op == "min" else piece
            offset += width
        return True

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any, axis: str) -> None:
        """Reduce ``tensor`` in place with ``op`` over ``group`` (nothing to do with one
        process or no group), counted as one call on ``axis``."""
        self.stats.add(axis, tensor.numel())
        if self._distributed and group is not None:
            start = time.perf_counter()
            self.comm.all_reduce(tensor, op, group)
            self.stats.seconds += time.perf_counter() - start
