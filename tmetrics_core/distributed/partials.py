"""Partial placements materialized before preparation.

A site that is ``Partial`` on an axis, read by a metric whose statistic does not commute with
that partial reduction (a sum of squares of a partial sum), is reduced to the full tensor first:
one packed collective round per axis for every such site, through the executor.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.statistics import commutes
from tmetrics_core.placements import Replica
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["resolve_partials"]


def resolve_partials(metrics: Sequence[TensorMetric], sites: Sequence[Site],
                     tensors: Sequence[torch.Tensor | None], topology: Topology,
                     executor: Executor) -> tuple[list[Site], list[torch.Tensor | None]]:
    """Materialize sites that are ``Partial`` on an axis some accepting metric cannot reduce
    directly; such sites become ``Replica`` on that axis. Every rank takes part in the same
    packed round (sites are rank-symmetric); placeholders contribute zeros."""
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
        return list(sites), list(tensors)
    new_sites, new_tensors = list(sites), list(tensors)
    locals_: dict[int, torch.Tensor] = {}
    for i in need:
        held = tensors[i]
        locals_[i] = held if held is not None else torch.zeros(_shape(sites[i], None, topology))
    # NOTE [nested partials]: with Partial on several axes the logical tensor is the outer
    # axis's op over the inner axis's op, so reduce the innermost axis (last in topology order)
    # first; one packed round per axis that has partial sites.
    for axis in reversed(topology.names):
        todo = [i for i in need if sites[i].placement(axis).is_partial() and topology.axes[axis].size > 1]
        if not todo:
            continue
        ops = [sites[i].placement(axis).op for i in todo]  # type: ignore[attr-defined]
        full = executor.materialize([locals_[i] for i in todo], [(axis,)] * len(todo), ops)
        for i, t in zip(todo, full):
            locals_[i] = t
    for i in need:
        site = sites[i]
        placements = tuple((a, Replica() if p.is_partial() else p) for a, p in site.placements)
        new_sites[i] = dataclasses.replace(site, placements=placements)
        if new_tensors[i] is not None:
            new_tensors[i] = locals_[i]
    return new_sites, new_tensors


def _shape(site: Site, tensor: torch.Tensor | None, topology: Topology) -> tuple[int, ...]:
    if tensor is not None:
        return tuple(tensor.shape)
    return site.local_shape(topology.coords(), {n: a.size for n, a in topology.axes.items()})
