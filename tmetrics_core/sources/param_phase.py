"""One phase of the parameter-side program: kernel rows to each metric's block state.

A :class:`PhasePlan` holds, per metric the phase prepares, the kernel rows of its sites (as a
slice where evenly spaced, else an index tensor) and its state keys: :meth:`PhasePlan.states`
turns one phase's moments rows into each metric's
:class:`~tmetrics_core.metrics.block_state.BlockState` with one row gather and its statistics'
arithmetic, and puts each statistic's neutral element in the rows of tensors this rank does not
have this step. :func:`phase_plan` builds one; :class:`~tmetrics_core.sources.param_program.ParamProgram`
plans which rows each metric reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, cast, overload

import torch

from tmetrics_core.kernels.rows import spaced
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.metrics.statistics import NEUTRAL, Statistic
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.topology import Topology

__all__ = ["PhasePlan", "Recipe", "phase_plan"]


@dataclass(frozen=True, slots=True)
class Recipe:
    """One metric of a phase: the kernel rows of its sites in site order (as a list and as an
    index tensor) and its state keys."""

    metric: StatMetric
    rows: tuple[int, ...]
    index: torch.Tensor | slice
    """The rows as a slice where they are evenly spaced (a view: no gather), else a tensor."""
    keys: tuple[SiteKey, ...]
    sites: tuple[Site, ...]
    """The site of each key (handed on with the state: see ``BlockState.sites``)."""


class _Inputs(Sequence[torch.Tensor]):
    """The tensors a metric's rows were read from, in site order, made only when a statistic
    reads them (element counts, shapes): ``inputs(row)`` gives each."""

    __slots__ = ("_rows", "_inputs")

    def __init__(self, rows: tuple[int, ...], inputs: Callable[[int], torch.Tensor]) -> None:
        self._rows = rows
        self._inputs = inputs

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._inputs(r) for r in self._rows[i]]
        return self._inputs(self._rows[i])


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """The metrics of one phase with their recipes, and the sites their states name."""

    recipes: tuple[Recipe, ...]
    sites: dict[SiteKey, Site]
    _on_device: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """Recipe row indices copied to the device of the rows (an accelerator's), once per device."""
    _fills: dict[tuple, list[tuple[float, torch.Tensor]]] = field(default_factory=dict, compare=False, repr=False)
    """Placeholder rows per (recipe, statistic, absent rows, device): the indices to fill, made
    once per pattern of missing gradients (a frozen weight's recurs every step)."""

    def states(self, rows: torch.Tensor, inputs: Callable[[int], torch.Tensor],
               absent: frozenset[int] = frozenset(), topology: Topology | None = None
               ) -> list[tuple[StatMetric, BlockState]]:
        """Each metric's state from ``rows`` (the phase's kernel output, float64 ``[n, 5]``);
        ``inputs(i)`` is the tensor row ``i`` was read from (an empty stand-in where ``absent``), for statistics that read shapes. The rows in ``absent`` (a gradient this rank
        does not have) hold, as ``Statistic.placeholder``, the neutral element of each
        statistic's first reduction on ``topology`` (0, -inf or +inf): left out of the
        statistic, with the same collectives on every rank."""
        out = []
        device = rows.device
        for k, recipe in enumerate(self.recipes):
            index = recipe.index
            if type(index) is not slice and index.device != device:
                moved = self._on_device.get((k, device))
                if moved is None:
                    moved = self._on_device[(k, device)] = index.to(device)
                index = moved
            picked = rows[index] if type(index) is slice else rows.index_select(0, index)
            tensors = _Inputs(recipe.rows, inputs)
            matrices = [cast("torch.Tensor", stat.compute(tensors, recipe.sites, cast(Topology, topology), picked))
                        for stat in recipe.metric.statistics]  # row statistics: matrices, topology unread
            gone = tuple(p for p, r in enumerate(recipe.rows) if r in absent) if absent else ()
            if gone:
                assert topology is not None  # absent rows come with the topology of their stages
                matrices = [_neutral_rows(m, self._fill(k, j, stat, gone, recipe.sites, topology, m.device))
                            for j, (stat, m) in enumerate(zip(recipe.metric.statistics, matrices))]
            out.append((recipe.metric, BlockState(recipe.keys, matrices, recipe.sites)))
        return out

    def _fill(self, recipe: int, position: int, stat: Statistic, gone: tuple[int, ...], sites: Sequence[Site],
              topology: Topology, device: torch.device) -> list[tuple[float, torch.Tensor]]:
        """``(neutral element, row indices on device)`` per first-reduction op of ``stat`` over
        the rows ``gone`` (see :func:`_neutral_rows`), remembered per pattern (at most 64)."""
        key = (recipe, position, gone, device)
        fills = self._fills.get(key)
        if fills is None:
            by_op: dict[str, list[int]] = {}
            for p in gone:
                by_op.setdefault(stat.stages(sites[p], topology)[0].op, []).append(p)
            fills = [(NEUTRAL[op], torch.tensor(at, device=device)) for op, at in by_op.items()]
            if len(self._fills) >= 64:  # patterns that change every step (experts no token reached)
                self._fills.clear()
            self._fills[key] = fills
        return fills


def _neutral_rows(matrix: torch.Tensor, fills: Sequence[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``matrix`` (not changed: it may be a view of rows other states read) with the rows of
    each index of ``fills`` set to its value: the neutral element of a statistic's first
    reduction at those rows' sites (``PhasePlan._fill``)."""
    for value, at in fills:
        matrix = matrix.index_fill(0, at, value)
    return matrix


def _index(rows: Sequence[int]) -> torch.Tensor | slice:
    """``rows`` of a kernel output as a slice when evenly spaced, else as an index tensor."""
    even = spaced(rows)
    return even if even is not None else torch.tensor(rows, dtype=torch.int64)


def phase_plan(metrics: Sequence[StatMetric], chosen: Sequence[Sequence[int]], sites: Sequence[Site],
           rows: Sequence[Sequence[int]]) -> PhasePlan:
    """Recipes of ``metrics``: ``chosen[k]`` the indices of the ``sites`` metric ``k`` accepts
    (at least one) and ``rows[k]`` their kernel rows."""
    recipes = []
    named: dict[SiteKey, Site] = {}
    for metric, picked, at in zip(metrics, chosen, rows):
        chosen_sites = tuple(sites[i] for i in picked)
        recipes.append(Recipe(metric, tuple(at), _index(at), tuple(s.key for s in chosen_sites), chosen_sites))
        named.update((sites[i].key, sites[i]) for i in picked)
    return PhasePlan(tuple(recipes), named)
