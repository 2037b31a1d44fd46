"""The parameter side of a due step, planned once per due set: kernel rows straight to states.

On a due step the metrics of parameters, gradients and updates turn fused moments rows into one
matrix per statistic (a :class:`~tmetrics_core.metrics.block_state.BlockState`). Which tensors
they read, which kernel row holds each tensor and the keys of each state depend only on the due
set (the manifest and its sites do not change). The general path finds them again every step,
per tensor and per metric: site lookups, a memo table of rows, input lists per metric. On the
demo model that Python costs more than the kernel passes themselves, and most of it runs with
cold caches, right after the backward pass.

A :class:`ParamProgram` finds them once. A due step then runs one moments pass per phase (the
gradients and parameters read before the optimizer step; each parameter, its snapshot and their
difference after it) and, per metric, one row gather and its statistics' arithmetic. The pass
is batched torch ops (:func:`tmetrics_core.kernels.rows.rows`) on any device: a fixed
number of ops per statistic and ``(device, dtype)`` group, whatever the tensor count. The
states are those the general path prepares, bit for bit: the same backends, the same rows, the
same statistic code. :meth:`ParamProgram.plan` says when it applies (plain parameters held
here, metrics that declare ``StatMetric.planned``); otherwise the parameter side takes the
general path. A parameter without a gradient on a step (frozen, or an expert no token reached)
gets the general path's placeholder in its rows: the program still runs.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence, cast

import torch

from tmetrics_core.kernels.rows import FIELDS, rows as moments_rows
from tmetrics_core.kinds import AFTER_STEP_KINDS as _POST_KINDS, PARAM_KINDS as _PRE_KINDS, STATE_KINDS as _STATE_KINDS
from tmetrics_core.metrics.base import StatMetric, TensorMetric
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.param_phase import PhasePlan, Recipe, phase_plan
from tmetrics_core.sources.params import grads_of
from tmetrics_core.topology import Topology
from tmetrics_core import torch_private

__all__ = ["ParamProgram"]

Local = Callable[[Sequence[torch.Tensor | None]], list[torch.Tensor | None]]
"""Maps parameters or gradients to the local tensors read (a DTensor's shard); None stays None."""

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")

_LOW = frozenset({torch.bfloat16, torch.float16})

_UPDATE, _AFTER, _BEFORE = 0, 1, 2
"""Rows of one tensor in the ``parts`` pass: ``p - snapshot``, ``p`` after the step, the snapshot."""


def _eligible(metric: TensorMetric, kinds: frozenset[str], *, elements: bool = False) -> bool:
    """Whether the program prepares ``metric``: a :class:`StatMetric` that declares its state
    the vectors of its statistics (``StatMetric.planned``), reading only ``kinds``, every
    statistic derived from moments rows (or the shape), with ``elements`` where a statistic may
    also read the tensors' elements (``reads_elements``: only where the inputs are the tensors
    the rows were read from, not a stand-in)."""
    return (isinstance(metric, StatMetric) and metric.planned
            and bool(metric.source_kinds) and metric.source_kinds <= kinds
            and all(not s.elements or (elements and bool(s.reads)) for s in metric.statistics)
            and any(stat.reads for stat in metric.statistics))


def _columns(plan: PhasePlan) -> frozenset[str]:
    """The moments columns the statistics of ``plan`` read (``Statistic.reads``)."""
    return frozenset(c for recipe in plan.recipes for stat in recipe.metric.statistics for c in stat.reads)


class ParamProgram:
    """The parameter-side metrics of one due set, planned (see the module docstring).

    Args:
        pre: the metrics prepared before the optimizer step (parameters and gradients, read in
            one kernel call); ``reads``: ``(kind, manifest entry)`` of each row of that call.
        post: the metrics prepared after it, from the ``parts`` pass over the parameters of
            ``stepped`` (``(manifest entry, name)`` of those with a snapshot, in manifest order)
            and their snapshots, then one moments pass over the Adam state of ``state_reads``
            (``(kind, manifest entry)``, ``exp_avg`` or ``exp_avg_sq``; rows after the parts rows).
    """

    def __init__(self, pre: PhasePlan, reads: Sequence[tuple[str, int]], post: PhasePlan,
                 stepped: Sequence[tuple[int, str]], state_reads: Sequence[tuple[str, int]] = ()) -> None:
        self.pre = pre
        self.reads = tuple(reads)
        self._indices = tuple(i for _, i in self.reads)
        self._grads = sum(kind == "grad" for kind, _ in self.reads)
        if any(kind != "grad" for kind, _ in self.reads[:self._grads]):
            raise ValueError("a ParamProgram reads its gradient rows before its parameter rows")
        self.post = post
        self.stepped = tuple(i for i, _ in stepped)
        self.names = tuple(name for _, name in stepped)
        self.state_reads = tuple(state_reads)
        # Only the columns some statistic reads are computed (L2 norms, update ratios: the sum
        # of squares alone).
        self._columns = (_columns(pre), _columns(post))

    @classmethod
    def plan(cls, pre: Sequence[TensorMetric], post: Sequence[TensorMetric], before: Sequence[TensorMetric],
             sites_of: Callable[[str], list[Site]], picks: Callable[[Sequence[TensorMetric], list[Site]], list[list[int]]],
             snapshot: frozenset[str], num_entries: int) -> ParamProgram | None:
        """The program of a due set, or None where the general path must run.

        Args:
            pre, post: the due metrics of the two phases; ``before``: those prepared after the
                step on the snapshot (the parameters as they were before it).
            sites_of: the manifest's sites of a kind (plain: no Partial, flat or DTensor
                placement the general path would change), one per manifest entry.
            picks: per metric, the indices of the sites it accepts (``SiteChoices.of``).
            snapshot: names of the parameters the snapshot holds.
            num_entries: manifest entries (every one held here, as a local tensor).

        The program prepares the metrics that ``StatMetric`` prepares as a block of moments rows
        and that read only parameters and gradients before the step and parameters and updates
        after it; the general path the others. Returns None when it prepares none, or a
        metric it would prepare accepts no site whose rows it has.
        """
        # The metrics the program prepares; the general path prepares the others (histograms,
        # Adam state, custom metrics that do not declare StatMetric.planned) in the same step.
        pre = [m for m in pre if _eligible(m, _PRE_KINDS, elements=True)]
        post = [m for m in post if _eligible(m, _POST_KINDS)]
        before = [m for m in before if _eligible(m, frozenset({"param"}))]
        if not pre and not post and not before:
            return None
        if any(len(sites_of(kind)) != num_entries for kind in sorted(_PRE_KINDS | _POST_KINDS)):
            return None  # rows are found by manifest entry: one site per entry and kind
        # Every metric passed _eligible: all are StatMetrics.
        first, post, before = (cast("Sequence[StatMetric]", ms) for ms in (pre, post, before))
        kinds = sorted({k for m in first for k in m.source_kinds})
        sites = [s for kind in kinds for s in sites_of(kind)]
        picked_pre = [_kept(m, p, sites) for m, p in zip(first, picks(first, sites))] if first else []
        # A metric that accepts no site here is left to the general path (it reports it).
        planned = [m for m, c in zip(first, picked_pre) if c]
        chosen = [c for c in picked_pre if c]
        union = sorted({i for p in chosen for i in p})
        position = {i: n for n, i in enumerate(union)}
        pre_rows = [[position[i] for i in p] for p in chosen]
        pre_plan = phase_plan(planned, chosen, sites, pre_rows)
        names = [s.name for s in sites_of("param")] if post or before else []
        stepped = [i for i, name in enumerate(names) if name in snapshot]
        slot = {i: n for n, i in enumerate(stepped)}
        read: list[tuple[StatMetric, bool, list[Site], list[int], list[tuple[str, int]]]] = []
        for metric, after in [*((m, True) for m in post), *((m, False) for m in before)]:
            # The general path lists a phase's sites by kind in sorted order (exp_avg, exp_avg_sq,
            # param, update); the metrics of the snapshot read the parameters' "before" rows.
            listed = [s for kind in (sorted(metric.source_kinds) if after else ["param"]) for s in sites_of(kind)]
            picked = _kept(metric, picks([metric], listed)[0], listed)
            at = [(listed[i].kind, i % num_entries) for i in picked]
            if picked and all(kind in _STATE_KINDS or entry in slot for kind, entry in at):
                read.append((metric, after, listed, picked, at))
        # Adam state rows follow the parts rows: one moments pass over the state tensors read.
        state_reads = sorted({(kind, entry) for *_, at in read for kind, entry in at if kind in _STATE_KINDS})
        state_slot = {r: 3 * len(stepped) + n for n, r in enumerate(state_reads)}
        recipes: list[Recipe] = []
        post_sites: dict[SiteKey, Site] = {}
        for metric, after, listed, picked, at in read:
            rows = [state_slot[(kind, entry)] if kind in _STATE_KINDS
                    else 3 * slot[entry] + (_UPDATE if kind == "update" else _AFTER if after else _BEFORE)
                    for kind, entry in at]
            plan = phase_plan([metric], [picked], listed, [rows])
            recipes.extend(plan.recipes)
            post_sites.update(plan.sites)
        if not pre_plan.recipes and not recipes:
            return None
        return cls(pre_plan, [(sites[i].kind, i % num_entries) for i in union],
                   PhasePlan(tuple(recipes), post_sites), [(i, names[i]) for i in stepped], state_reads)

    def read_pre(self, params: Sequence[torch.Tensor], views: Sequence[Callable[[torch.Tensor], torch.Tensor] | None]
                 = (), topology: Topology | None = None, local: Local | None = None,
                 grads: Callable[[Sequence[int]], list[torch.Tensor | None]] | None = None
                 ) -> tuple[list[tuple[StatMetric, BlockState]], list[int]]:
        """States of the ``pre`` metrics from ``params`` (the local parameter of every manifest
        entry, plain tensors) and their gradients (:func:`~tmetrics_core.sources.params.grads_of`),
        from one moments pass (:func:`~tmetrics_core.kernels.rows.rows`), and the rows of the gradients this
        rank does not have this step (:meth:`entries` names their manifest entries): their
        gradients are left out of the statistics with placeholders (see :meth:`PhasePlan.states`,
        on ``topology``), as the general path does. ``views[i]``, where given and not None, reads entry ``i`` (an expert slice of a
        stacked tensor) as a view of its parameter and gradient (``Manifest.views``). ``local``,
        where given, maps parameters and gradients to the local tensors read (DTensors' shards).
        ``grads``, where given, reads the gradients of manifest entries instead of ``.grad``
        (a flat buffer's part of each, as the entry reads it: no view applied; None where it
        has none)."""
        # Gradient rows come first (kinds are read in sorted order: see __init__): one C-level
        # map per step over the parameters, none of Python per tensor.
        count = self._grads
        read = list(map(params.__getitem__, self._indices))
        found = grads_of(read[:count]) if grads is None else grads(self._indices[:count])
        if local is not None:
            read, found = cast("list[torch.Tensor]", local(read)), local(found)
        absent = [k for k, g in enumerate(found) if g is None] if type(None) in set(map(type, found)) else []
        tensors = _stand_in(found, absent, read) + read[count:]
        if views and any(views):
            skip = frozenset(absent) if grads is None else frozenset(range(count))
            tensors = [t if (view := views[i]) is None or k in skip else view(t)
                       for k, (t, i) in enumerate(zip(tensors, self._indices))]
        rows = moments_rows(tensors, self._columns[0])
        return self.pre.states(rows, tensors.__getitem__, frozenset(absent), topology), absent

    def entries(self, rows: Sequence[int]) -> list[int]:
        """The manifest entries that ``read_pre``'s rows ``rows`` read."""
        return [self._indices[k] for k in rows]

    def read_post(self, params: Sequence[torch.Tensor], then: Sequence[torch.Tensor],
                  views: Sequence[Callable[[torch.Tensor], torch.Tensor] | None] = (), local: Local | None = None,
                  state: Callable[[Sequence[tuple[str, int]]], list[torch.Tensor | None]] | None = None,
                  topology: Topology | None = None) -> tuple[list[tuple[StatMetric, BlockState]], list[int]]:
        """States of the ``post`` metrics from the parameters of :attr:`stepped` now (of
        ``params`` and ``views``, as in :meth:`read_pre`) and their snapshots (``then``, in the
        same order): the copies themselves, whose updates are one
        ``_foreach_sub`` and whose rows come from one moments pass over updates, parameters and
        snapshots. The Adam state of :attr:`state_reads` comes from ``state`` (the local tensor
        of each, None where the optimizer has none yet: a placeholder, as for a missing
        gradient in :meth:`read_pre`); also returned, the rows without one.

        Raises:
            ValueError: a parameter whose dtype or size no longer matches its snapshot (the
                optimizer replaced or resized it).
        """
        now = list(map(params.__getitem__, self.stepped))
        if local is not None:
            now = cast("list[torch.Tensor]", local(now))
        if views and any(views):
            now = [t if (view := views[i]) is None else view(t) for t, i in zip(now, self.stepped)]
        blocks = []
        if not now:
            pass
        else:
            copies = cast("list[torch.Tensor]", list(then))
            if (list(map(_SHAPE, now)) != list(map(_SHAPE, copies))
                    or list(map(_DTYPE, now)) != list(map(_DTYPE, copies))):
                raise ValueError("a parameter's shape or dtype changed in the optimizer step")
            # Low-precision parameters widened first (float32 minus their own dtype promotes):
            # the update itself, not its rounding to the parameter's dtype.
            updates = torch_private.foreach_sub([t.float() if t.dtype in _LOW else t for t in now]
                                                if _LOW.intersection(map(_DTYPE, now)) else now, copies)
            n = len(now)
            # Rows in the parts layout: update, after, before of each tensor in turn.
            blocks.append(moments_rows([*updates, *now, *copies], self._columns[1]).view(
                3, n, len(FIELDS)).transpose(0, 1).reshape(3 * n, -1))
        held: list[torch.Tensor] = []
        absent: list[int] = []
        if self.state_reads:
            assert state is not None  # a program with Adam state rows is read with the state
            found = state(self.state_reads)
            absent = [k for k, t in enumerate(found) if t is None]
            held = _stand_in(found, absent, [params[e] if local is None else cast("torch.Tensor", local([params[e]])[0])
                                             for _, e in self.state_reads])
            rows = moments_rows(held, self._columns[1])
            blocks.append(rows if not blocks else rows.to(blocks[0].device))
        base = 3 * len(now)
        # A statistic that reads shapes gets the parameter for every parts row (the update and
        # the snapshot have its shape: the parts pass checked their sizes), the state tensor
        # for a state row.
        block = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        gone = [base + k for k in absent]
        return (self.post.states(block, lambda r: now[r // 3] if r < base else held[r - base], frozenset(gone),
                                 topology), gone)


def _stand_in(found: list[torch.Tensor | None], absent: list[int], like: Sequence[torch.Tensor]
              ) -> list[torch.Tensor]:
    """``found`` with a tensor of no elements (one per dtype and device, like ``like[k]``) at
    each index of ``absent``: its row is replaced by a placeholder."""
    empty: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for k in absent:
        key = (like[k].device, like[k].dtype)
        if key not in empty:
            empty[key] = like[k].new_empty(0)
        found[k] = empty[key]
    return cast("list[torch.Tensor]", found)


def _kept(metric: StatMetric, picked: list[int], sites: Sequence[Site]) -> list[int]:
    """The picked sites that ``metric`` prepares (see :meth:`StatMetric.kept`)."""
    kept = metric.kept([sites[i] for i in picked])
    return picked if kept is None else [picked[k] for k in kept]
