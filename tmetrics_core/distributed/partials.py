"""Partial placements materialized before preparation.

A site that is ``Partial`` on an axis, read by a metric whose statistic does not commute with
that partial reduction (a sum of squares of a partial sum), is reduced to the full tensor first:
one packed collective round per axis for every such site, through the executor.
:func:`plan_partials` finds, once per list of sites, which sites need it and what they become
(``Replica`` on the reduced axes); :func:`materialize_partials` runs the rounds on each step's
local tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.statistics import commutes
from tmetrics_core.placements import Replica
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["PartialPlan", "materialize_partials", "plan_partials"]


@dataclass(frozen=True, slots=True)
class PartialPlan:
    """Which sites of a list are materialized, and the list as it reads afterwards.

    Attributes:
        need: indices of the sites reduced to the full tensor.
        rounds: per axis with such sites, innermost first: ``(axis, indices, ops)``, the sites
            ``Partial`` on it and the reduction of each (``sum``, ``avg``, ``max``, ``min``).
        sites: every site of the list, those of ``need`` ``Replica`` where they were ``Partial``.
    """

    need: tuple[int, ...]
    rounds: tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]
    sites: tuple[Site, ...]


def plan_partials(metrics: Sequence[TensorMetric], sites: Sequence[Site], topology: Topology) -> PartialPlan | None:
    """The :class:`PartialPlan` of ``sites`` for ``metrics`` (those accepting a site decide
    whether it is reduced), or None when no site needs it. Depends on the sites and metrics
    alone, which every rank knows alike (sites are rank-symmetric)."""
    need: list[int] = []
    for i in [i for i, site in enumerate(sites) if site.partial]:
        site = sites[i]
        partial = [(a, p) for a, p in site.placements if p.is_partial() and topology.axes.get(a) and
                   topology.axes[a].size > 1]
        if not partial:
            continue
        stats = [s for m in metrics if m.accepts(site) for s in getattr(m, "statistics", ())]
        if any(not commutes(p.op, s.op, linear=s.linear) for _, p in partial for s in stats):  # type: ignore[attr-defined]
            need.append(i)
    if not need:
        return None
    # NOTE [nested partials]: with Partial on several axes the logical tensor is the outer
    # axis's op over the inner axis's op, so reduce the innermost axis (last in topology order)
    # first; one packed round per axis that has partial sites.
    rounds = []
    for axis in reversed(topology.names):
        todo = tuple(i for i in need if sites[i].placement(axis).is_partial() and topology.axes[axis].size > 1)
        if todo:
            rounds.append((axis, todo, tuple(sites[i].placement(axis).op for i in todo)))  # type: ignore[attr-defined]
    resolved = list(sites)
    for i in need:
        site = sites[i]
        resolved[i] = dataclasses.replace(site, placements=tuple((a, Replica() if p.is_partial() else p)
                                                                 for a, p in site.placements))
    return PartialPlan(tuple(need), tuple(rounds), tuple(resolved))


def materialize_partials(plan: PartialPlan, sites: Sequence[Site], tensors: Sequence[torch.Tensor | None],
                         topology: Topology, executor: Executor) -> list[torch.Tensor | None]:
    """``tensors`` (the local tensors of ``sites``, None where held elsewhere) with those of
    ``plan.need`` reduced over their ``Partial`` axes: one packed round per axis of
    ``plan.rounds``, on every rank alike (a tensor this rank does not hold contributes zeros of
    its local shape, on the device of the tensors it holds, and stays None).

    Raises:
        RuntimeError: from the executor, a collective that failed or timed out.
    """
    held: dict[int, torch.Tensor] = {}
    like = next((t for t in tensors if t is not None), None)
    device = like.device if like is not None else torch.device("cpu")
    for i in plan.need:
        tensor = tensors[i]
        held[i] = tensor if tensor is not None else torch.zeros(
            sites[i].local_shape(topology.coords(), {n: a.size for n, a in topology.axes.items()}), device=device)
    for axis, todo, ops in plan.rounds:
        for i, full in zip(todo, executor.materialize([held[i] for i in todo], [(axis,)] * len(todo), ops)):
            held[i] = full
    out = list(tensors)
    for i in plan.need:
        if out[i] is not None:
            out[i] = held[i]
    return out
