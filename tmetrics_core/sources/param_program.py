"""The parameter side of a due step, planned once per due set: one path on every device.

On a due step the metrics of parameters, gradients, Adam state and updates are prepared in two
phases: before the optimizer step (parameters and gradients) and after it (Adam state, updates,
the parameters after the step, and the parameters as they were before it, read from the
update snapshot). What each phase reads depends only on the due set (the manifest and its
sites do not change), so a :class:`PhaseProgram` finds it once:

- the **slots**: ``(source, manifest entry)`` of every tensor some metric of the phase accepts,
  grouped by source (one :meth:`~tmetrics_core.sources.param_reads.ParamReads.read` per source
  and step: flat buffers, DTensor shards, expert views and tensors held elsewhere included);
- the ``Partial`` slots some statistic cannot reduce as they are, materialized in one executor
  round per axis (:mod:`~tmetrics_core.distributed.partials`);
- for every :class:`~tmetrics_core.metrics.base.StatMetric` that declares
  ``StatMetric.planned``: the rows of its sites in one rows pass over the phase
  (:func:`tmetrics_core.kernels.rows.rows`, batched torch ops on any device) and its
  :class:`~tmetrics_core.sources.param_phase.Recipe`: one row gather and its statistics'
  arithmetic. A tensor this rank does not read this step (held elsewhere, no gradient, no
  state yet) gives each statistic's neutral element, so every rank issues the same collectives;
- every other metric (histograms, custom metrics) prepares itself on the same slots' sites and
  tensors (:func:`~tmetrics_core.metrics.preparation.prepare_states`).

A DTensor gradient placed otherwise than its parameter (a ``Partial`` gradient under sequence
parallelism) changes the gradient sites: :meth:`ParamProgram.pre_phase` plans the first phase
again for those sites, once per placement pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.partials import PartialPlan, materialize_partials, plan_partials
from tmetrics_core.kernels.rows import rows as moments_rows
from tmetrics_core.metrics.base import StatMetric, TensorMetric
from tmetrics_core.metrics.preparation import SiteChoices, prepare_states
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.param_phase import PhasePlan, phase_plan
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.sources.params import has_none
from tmetrics_core.sources.snapshot import Snapshot
from tmetrics_core.topology import Topology

__all__ = ["ParamProgram", "PhaseProgram", "PhaseResult", "Prepared"]

Prepared = tuple[Any, str | None]
"""A due metric's local state and its error text (None when it prepared without one)."""

Picks = Callable[[Sequence[TensorMetric], list[Site]], list[list[int]]]
"""Per metric, the indices of the sites it accepts (``SiteChoices.of``)."""


@dataclass(frozen=True, slots=True)
class Part:
    """Metrics of a phase that pick from one list of sites: those of ``kinds`` (sorted), read
    from ``before`` (the snapshot) instead of the kind where set."""

    metrics: tuple[TensorMetric, ...]
    kinds: tuple[str, ...]
    before: bool = False


@dataclass(slots=True)
class PhaseResult:
    """What one phase prepared: each metric's state and error, the sites the states name,
    the metrics that read no tensor here, and the parameters held here without a gradient."""

    prepared: dict[str, Prepared] = field(default_factory=dict)
    sites: dict[SiteKey, Site] = field(default_factory=dict)
    unfed: set[str] = field(default_factory=set)
    no_grad: set[str] = field(default_factory=set)


def _planned(metric: TensorMetric) -> bool:
    """Whether ``metric`` is prepared from the phase's rows: a :class:`StatMetric` that declares
    its state the vectors of its statistics (``StatMetric.planned``), some of which read rows."""
    return (isinstance(metric, StatMetric) and metric.planned and bool(metric.source_kinds)
            and any(stat.reads for stat in metric.statistics))


class PhaseProgram:
    """One phase of a due set, planned (see the module docstring).

    Args:
        name: ``"pre"`` or ``"post"`` (said in a reading error).
        parts: the metrics of the phase and the sites each picks from.
        sites_of: the sites of a kind, one per manifest entry.
        picks: per metric, the indices of the sites it accepts.
        topology: the axes (which ``Partial`` slots are materialized).

    A metric whose ``StatMetric.kept`` raises is prepared by its own ``prepare``, which reports
    the error on every rank.
    """

    def __init__(self, name: str, parts: Sequence[Part], sites_of: Callable[[str], list[Site]], picks: Picks,
                 topology: Topology) -> None:
        self.name = name
        candidates: list[tuple[str, int]] = []
        listed: list[Site] = []
        chosen: list[tuple[TensorMetric, list[int], bool]] = []  # metric, candidate indices, planned
        ranges: list[tuple[int, int, tuple[TensorMetric, ...]]] = []
        for part in parts:
            start = len(listed)
            for kind in part.kinds:
                sites = sites_of(kind)
                candidates.extend(("before" if part.before else kind, e) for e in range(len(sites)))
                listed.extend(sites)
            own = listed[start:]
            others = []
            for metric in part.metrics:
                accepted = picks([metric], own)[0]
                kept = _kept(metric, accepted, own) if _planned(metric) and accepted else None
                if kept:
                    chosen.append((metric, [start + i for i in kept], True))
                else:
                    chosen.append((metric, [start + i for i in accepted], False))
                    others.append(metric)
            ranges.append((start, len(listed), tuple(others)))
        used = sorted({i for _, at, _ in chosen for i in at})
        slot = {i: n for n, i in enumerate(used)}
        self.slots = tuple(candidates[i] for i in used)
        self.read_sites = tuple(listed[i] for i in used)
        """The sites of the slots as the manifest (or the gradients' DTensor placements) gives them."""
        metrics = [m for m, _, _ in chosen]
        self.partials: PartialPlan | None = plan_partials(metrics, self.read_sites, topology)
        self.sites = self.partials.sites if self.partials is not None else self.read_sites
        """The sites of the slots as the metrics read them (``Partial`` ones materialized)."""
        self.groups = _groups(self.slots)
        self.site_keys = {s.key: s for s in self.sites}
        """The sites by key (read only: handed on with every phase's states)."""
        self.picked = tuple((m.name, tuple(slot[i] for i in at)) for m, at, _ in chosen)
        self.others = tuple((_slot_range(slot, start, stop), ms) for start, stop, ms in ranges if ms)
        planned = [(cast(StatMetric, m), [slot[i] for i in at]) for m, at, is_planned in chosen if is_planned]
        self.rows_at = tuple(sorted({i for _, at in planned for i in at}))
        position = {i: n for n, i in enumerate(self.rows_at)}
        self.plan: PhasePlan = phase_plan([m for m, _ in planned], [at for _, at in planned], self.sites,
                                          [[position[i] for i in at] for _, at in planned])
        self.columns = frozenset(c for m, _ in planned for stat in m.statistics for c in stat.reads)
        self.metrics = tuple(metrics)
        self._all_rows = self.rows_at == tuple(range(len(self.slots)))

    def run(self, reads: ParamReads, snapshot: Snapshot | None, executor: Executor, topology: Topology,
            choices: SiteChoices) -> PhaseResult:
        """Read the slots, materialize the ``Partial`` ones, and prepare every metric of the phase.
        A source that fails to read fails the metrics reading it (their error, on every rank
        by the executor's agreement), its slots read as held elsewhere."""
        tensors: list[torch.Tensor | None] = []
        failed: dict[int, str] = {}
        for source, start, entries in self.groups:
            try:
                tensors.extend(reads.read(source, entries, snapshot))
            except Exception as exc:  # noqa: BLE001 - e.g. a parameter resized by the optimizer
                text = f"reading the {self.name}-step tensors failed: {type(exc).__name__}: {exc}"
                failed.update((i, text) for i in range(start, start + len(entries)))
                tensors.extend([None] * len(entries))
        if self.partials is not None:
            tensors = materialize_partials(self.partials, self.read_sites, tensors, topology, executor)
        out = PhaseResult(sites=self.site_keys)
        if self.plan.recipes:
            read = tensors if self._all_rows else [tensors[i] for i in self.rows_at]
            absent = [k for k, t in enumerate(read) if t is None] if has_none(read) else []
            filled = _stand_in(read, absent, reads.device)
            try:
                states = self.plan.states(moments_rows(filled, self.columns), filled.__getitem__, frozenset(absent),
                                          topology)
                out.prepared.update((m.name, (state, None)) for m, state in states)
            except Exception as exc:  # noqa: BLE001 - reported, and skipped on every rank
                out.prepared.update((r.metric.name, ({}, f"{type(exc).__name__}: {exc}")) for r in self.plan.recipes)
        for (start, stop), metrics in self.others:
            for metric, state, error in prepare_states(metrics, self.sites[start:stop], tensors[start:stop], topology,
                                                       {}, choices):
                out.prepared[metric.name] = (state, error)
        for name, at in self.picked if failed else ():
            error = next((failed[i] for i in at if i in failed), None)
            if error is not None:
                out.prepared[name] = (out.prepared.get(name, ({}, None))[0], error)
        if has_none(tensors):  # a failed slot is None too: its metrics failed, its gradient was not read
            out.unfed.update(name for name, at in self.picked if all(tensors[i] is None for i in at)
                             and not any(i in failed for i in at))
            out.no_grad.update(reads.manifest.entries[e].name
                               for i, ((source, e), t) in enumerate(zip(self.slots, tensors))
                               if source == "grad" and t is None and i not in failed
                               and reads.facts.local[e] is not None)
        return out


class ParamProgram:
    """The parameter-side metrics of one due set, planned (see the module docstring).

    Args:
        pre: the due metrics prepared before the optimizer step (parameters and gradients).
        post: those prepared after it (Adam state, updates, parameters after the step).
        before: those of parameters alone prepared after the step on the snapshot (the
            parameters as they were before it).
        sites_of: the sites of a kind, one per manifest entry (a flat buffer's where one holds it).
        picks: per metric, the indices of the sites it accepts (``SiteChoices.of``).
        topology: the axes.
    """

    def __init__(self, pre: Sequence[TensorMetric], post: Sequence[TensorMetric], before: Sequence[TensorMetric],
                 sites_of: Callable[[str], list[Site]], picks: Picks, topology: Topology) -> None:
        self._pre_metrics = tuple(pre)
        self._picks = picks
        self._topology = topology
        self.pre = self._phase_pre(sites_of)
        self.post = PhaseProgram("post", [Part(tuple(post), _kinds(post)), Part(tuple(before), ("param",), True)],
                                 sites_of, picks, topology)
        self._by_grads: dict[tuple, PhaseProgram] = {}

    def _phase_pre(self, sites_of: Callable[[str], list[Site]]) -> PhaseProgram:
        return PhaseProgram("pre", [Part(self._pre_metrics, _kinds(self._pre_metrics))], sites_of, self._picks,
                            self._topology)

    def pre_phase(self, reads: ParamReads) -> PhaseProgram:
        """The first phase for this step's gradients: :attr:`pre`, or, where a DTensor gradient
        is placed otherwise than its parameter (:meth:`ParamReads.grad_sites`), the phase planned
        for those gradient sites (once per placement pattern, at most 8 kept)."""
        if not reads.facts.dtensor_params or "grad" in reads.flat or not reads.grads_differ():
            return self.pre
        grads = reads.grad_sites()
        key = tuple((s.name, s.placements) for s in grads)
        phase = self._by_grads.get(key)
        if phase is None:
            if len(self._by_grads) >= 8:
                self._by_grads.clear()
            phase = self._by_grads[key] = self._phase_pre(lambda kind: grads if kind == "grad" else reads.sites_of(kind))
        return phase

    def snapshot_entries(self) -> list[int]:
        """Manifest entries the post phase reads from the snapshot (updates and ``before``), in
        slot order, each once."""
        seen: dict[int, None] = {}
        for source, entry in self.post.slots:
            if source in ("update", "before"):
                seen.setdefault(entry)
        return list(seen)


def _kinds(metrics: Sequence[TensorMetric]) -> tuple[str, ...]:
    return tuple(sorted({k for m in metrics for k in m.source_kinds}))


def _groups(slots: Sequence[tuple[str, int]]) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """``(source, first slot, entries)`` per run of slots of one source (slots are grouped by
    source: candidates are listed kind by kind)."""
    out: list[tuple[str, int, list[int]]] = []
    for n, (source, entry) in enumerate(slots):
        if not out or out[-1][0] != source:
            out.append((source, n, []))
        out[-1][2].append(entry)
    return tuple((source, start, tuple(entries)) for source, start, entries in out)


def _slot_range(slot: dict[int, int], start: int, stop: int) -> tuple[int, int]:
    """The slots of the candidates ``start:stop`` (a part's), as a range of slot indices."""
    inside = [n for i, n in slot.items() if start <= i < stop]
    return (min(inside), max(inside) + 1) if inside else (0, 0)


def _stand_in(read: list[torch.Tensor | None], absent: list[int], device: torch.device) -> list[torch.Tensor]:
    """``read`` with a tensor of no elements (like another tensor of the list, else float32 on
    ``device``) at each index of ``absent``: its rows are then replaced by placeholders."""
    if not absent:
        return cast("list[torch.Tensor]", read)
    like = next((t for t in read if t is not None), None)
    empty = like.new_empty(0) if like is not None else torch.empty(0, device=device)
    out = list(read)
    for k in absent:
        out[k] = empty
    return cast("list[torch.Tensor]", out)


def _kept(metric: TensorMetric, picked: list[int], sites: Sequence[Site]) -> list[int] | None:
    """The picked sites that ``metric`` prepares (see :meth:`StatMetric.kept`), or None where
    ``kept`` raises (the metric's own ``prepare`` then reports it)."""
    try:
        kept = cast(StatMetric, metric).kept([sites[i] for i in picked])
    except Exception:  # noqa: BLE001 - reported by prepare, on every rank
        return None
    return picked if kept is None else [picked[k] for k in kept]
