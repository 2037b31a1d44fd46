"""The plan check: do all ranks of each axis issue the same collectives, before any is issued?

Ranks that see different sites would pack different buckets and hang (or, worse, combine
unrelated values) in the first mismatched collective. :func:`check_plan` compares a fingerprint
of this rank's layout on each axis with the other ranks of that axis: one ``all_reduce(MAX)``
per axis of ``[fingerprint, -fingerprint]`` (the group's max and min), one host read of all
axes' results, then one over the world of the mismatch flags, so every rank raises together.
Per-rank bytes do not grow with the world size. Only on a mismatch are the layouts gathered, to
name the metric, the axis and the ranks that differ.

The executor owns the collectives and hands them in (so they are counted with its others).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from tmetrics_core.errors import PlanMismatchError
from tmetrics_core.metrics.base import CollectiveRequest
from tmetrics_core.topology import Topology

__all__ = ["check_plan"]

_Row = tuple[str, str, str, int, str]
"""One request part as an axis sees it: (key, op, dtype, elements, metric)."""


def check_plan(topology: Topology, requests: Sequence[CollectiveRequest], owner: Mapping[Hashable, str], *,
               device: torch.device, all_reduce: Callable[[torch.Tensor, str], None],
               world_max: Callable[[Sequence[int]], list[int]], gather_objects: Callable[[Any], list[Any]]) -> None:
    """Compare this round's per-axis layouts (``requests``; ``owner``: the metric that issued
    each request key) with the other ranks of each axis of more than one rank.

    Args:
        topology: the named axes.
        requests: the round's deduplicated requests.
        owner: request key -> name of the first metric that asked for it.
        device: where the fingerprints are reduced (the collectives' device).
        all_reduce: ``(tensor, axis)``: MAX-reduce in place over the group of ``axis``.
        world_max: host ints MAX-reduced over every rank.
        gather_objects: every rank's picklable object over the world, in rank order.

    Raises:
        PlanMismatchError: on every rank, naming the axis, the metric, the differing ranks and
            the first differing request of each side.
    """
    if topology.world_size <= 1:
        return
    names = [a for a in topology.names if topology.axes[a].size > 1]
    layouts = {a: _layout(requests, a, owner) for a in names}
    fps = {a: _fingerprint(layouts[a]) for a in names}
    # Row i: axis i's fingerprint and its negation, MAX-reduced over that axis in place (the
    # group's max and negated min); then one host read for every axis.
    spread = torch.tensor([[fps[a], -fps[a]] for a in names], dtype=torch.int64, device=device).reshape(-1, 2)
    for row, axis in enumerate(names):
        all_reduce(spread[row], axis)
    mismatched = [int(high != -low) for high, low in spread.tolist()]
    if not any(world_max(mismatched or [0])):
        return
    coords = {a: topology.axes[a].rank for a in names}
    table = gather_objects((coords, fps, layouts))
    for axis in names:
        groups: dict[tuple, list[int]] = {}
        for rank, (theirs, _, _) in enumerate(table):
            groups.setdefault(tuple(c for a, c in theirs.items() if a != axis), []).append(rank)
        for ranks in groups.values():
            ref = table[ranks[0]][1][axis]
            bad = tuple(r for r in ranks if table[r][1][axis] != ref)
            if bad:
                _raise_mismatch(axis, ranks[0], bad, table[ranks[0]][2][axis], table[bad[0]][2][axis])


def _raise_mismatch(axis: str, ref_rank: int, bad: tuple[int, ...], ref: list[Any], other: list[Any]) -> None:
    """Raise the mismatch of ``other`` (a layout of a rank of ``bad``) against ``ref``."""
    metric = next((row[4] for a, b in zip(ref + [None], other + [None]) if a != b
                   for row in (a or b,)), "?")
    raise PlanMismatchError(
        f"collective plans differ on axis {axis!r}: global rank(s) {list(bad)} disagree with "
        f"rank {ref_rank} for metric {metric!r} (first differing request: rank {ref_rank} has "
        f"{_first_diff(ref, other, 0)}, rank {bad[0]} has {_first_diff(ref, other, 1)}). Ranks must "
        "see the same sites: check that every rank builds the same model structure, config and "
        "select patterns, or declare sites held elsewhere in the manifest.",
        metric=metric, axis=axis, ranks=bad,
    )


def _layout(requests: Sequence[CollectiveRequest], axis: str, owner: Mapping[Hashable, str]) -> list[_Row]:
    """What this rank will send over ``axis``: (key, op, dtype, elements, metric) per request."""
    rows: list[_Row] = []
    for r in requests:
        if axis not in r.axes:
            continue
        parts = r.parts or (r.key,)
        size = r.value.numel() // len(parts)
        rows.extend((repr(part), r.op, str(r.value.dtype), size, owner.get(r.key, "?")) for part in parts)
    return rows


def _fingerprint(layout: list[_Row]) -> int:
    """56-bit hash of the layout without metric names (two metrics may own one shared request)."""
    digest = hashlib.blake2b(repr([row[:4] for row in layout]).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def _first_diff(a: list, b: list, which: int) -> str:
    for x, y in zip(a + [None], b + [None]):
        if x != y:
            row = (x, y)[which]
            return "nothing" if row is None else f"{row[0]} ({row[1]}, {row[2]}, {row[3]} elements)"
    return "nothing"
