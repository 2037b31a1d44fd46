"""From observed local tensors to prepared metric states, Partial placements resolved.

``prepare_states`` is the local half of a step: it materializes tensors that are ``Partial``
on some axis when a metric's statistic does not commute with that partial reduction (one
packed collective round for all of them), then lets each metric prepare the sites it accepts,
sharing statistics between metrics through a per-step memo. Errors are caught per metric and
returned, so the executor can make every rank skip a metric that raised on any rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import torch

from tmetrics_core.axes import Topology
from tmetrics_core.executor import Executor
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.statistics import commutes
from tmetrics_core.placements import Replica
from tmetrics_core.site import Site, SiteKey

__all__ = ["PreparedStep", "SiteChoices", "prepare_states", "resolve_partials"]

PreparedStep = list[tuple[TensorMetric, dict[SiteKey, Any], str | None]]
"""``(metric, state, local error text or None)`` per due metric, in config order."""


class SiteChoices:
    """Which sites each metric accepts, remembered per list of site objects: a due step over
    the same sites (the manifest's, built once) skips a Python ``accepts`` call per metric and
    tensor. Keyed by the identity of the sites, which the entry keeps alive; a few lists at
    most are kept (transient sites, e.g. resolved Partial ones, are new objects every step)."""

    _KEEP = 8

    def __init__(self) -> None:
        self._known: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[Sequence[Site], list[list[int]]]] = {}

    def of(self, metrics: Sequence[TensorMetric], sites: Sequence[Site]) -> list[list[int]]:
        """Per metric, the indices of the sites it accepts, in order."""
        key = (tuple(m.name for m in metrics), tuple(map(id, sites)))
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= self._KEEP:
                self._known.clear()
            picks = [[i for i, s in enumerate(sites) if m.accepts(s)] for m in metrics]
            known = self._known[key] = (list(sites), picks)
        return known[1]


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
    locals_ = {i: tensors[i] if tensors[i] is not None else torch.zeros(_shape(sites[i], None, topology))
               for i in need}
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


def prepare_states(metrics: Sequence[TensorMetric], sites: Sequence[Site],
                   tensors: Sequence[torch.Tensor | None], topology: Topology,
                   memo: dict[Hashable, torch.Tensor] | None = None,
                   choices: SiteChoices | None = None) -> PreparedStep:
    """Prepare every metric on the sites it accepts; a metric that raises gets its error text
    instead of a state (its other sites are not prepared). ``choices``, kept by the caller
    across steps, remembers which of the same site objects each metric accepts."""
    memo = {} if memo is None else memo
    picks = (choices or SiteChoices()).of(metrics, sites)
    out: PreparedStep = []
    for metric, picked in zip(metrics, picks):
        try:
            state = metric.prepare([sites[i] for i in picked], [tensors[i] for i in picked], topology, memo)
            out.append((metric, state, None))
        except Exception as exc:  # noqa: BLE001 - reported, and skipped on every rank
            out.append((metric, {}, f"{type(exc).__name__}: {exc}"))
    return out
