"""Batches: the sites of one statistic that travel through the executor together.

A :class:`~tmetrics_core.metrics.base.StatMetric` prepares one small vector per (statistic,
site). To reduce them it stacks the vectors of the sites that go through the same stages and
have the same length into one matrix (a :class:`Batch`): one collective request per stage
carries the whole batch, and when the stages are done the rows are merged per scope group
(layer, expert...) on the device, so the host copy holds one row per group, not per tensor.
The per-step Python work is then a few operations per batch instead of per tensor.

Stages that move no data (no axis with more than one rank: one process, or a tensor that is
replicated everywhere) run locally without a request. Which sites form a batch depends only on
rank-symmetric facts (the site, its placements, the topology, and the vector length, which
every rank of a reduction agrees on), so the batches of a reduction are the same on its ranks.

:class:`BatchPlan` remembers how a state was cut, and rebuilds the cut only when the sites or
vector lengths change (normally once per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.metrics.statistics import Stage, Statistic
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey

__all__ = ["Batch", "BatchPlan", "Merge", "Slot", "advance", "canonical", "merged_outputs", "next_stage", "regroup"]

Slot = tuple[tuple, str, Site]
"""``(scope group key, site kind, first site of the group)``: what a merged output row holds."""


@dataclass(slots=True)
class Batch:
    """Sites whose vectors of ``stat`` go through the same ``stages`` with the same length.

    Row ``i`` of ``rows`` is the current vector of ``sites[i]``, the site at ``positions[i]``
    in the metric's state (the same order on every rank); ``index`` is the next stage.
    ``merge`` (how rows merge per scope group) is known in advance for batches cut by a plan; when
    every stage is done, ``out_key`` names the merged output and ``slots`` its rows.
    """

    stat: Statistic
    sites: tuple[Site, ...]
    stages: tuple[Stage, ...]
    index: int
    rows: torch.Tensor
    keys: tuple[SiteKey, ...]
    positions: tuple[int, ...]
    merge: Merge | None = None
    out_key: Hashable = None
    slots: tuple[Slot, ...] = ()

    @property
    def key(self) -> Hashable:
        """The request key of the current stage: statistic, stage and the sites, in order."""
        return (self.stat.name, self.index, self.keys)

    @property
    def parts(self) -> tuple[Hashable, ...]:
        """Per-site keys of the current stage's request (for plan checks and messages)."""
        return tuple((self.stat.name, self.index, k) for k in self.keys)


def _reduces(stage: Stage, topology: Topology) -> bool:
    """Whether ``stage`` moves data: some of its axes has more than one rank."""
    return any(topology.axes[a].size > 1 for a in stage.axes if a in topology.axes)


def _stack(vectors: list[torch.Tensor]) -> torch.Tensor:
    """``[len(vectors), length]`` from vectors of one length (1-D, as statistics return them)."""
    width = vectors[0].numel()
    return (vectors[0] if len(vectors) == 1 else torch.stack(vectors)).reshape(len(vectors), width)


def regroup(stat: Statistic, sites: Sequence[Site], stages: Sequence[tuple[Stage, ...]],
            vectors: Sequence[torch.Tensor], positions: Sequence[int], index: int,
            topology: Topology) -> list[Batch]:
    """Batches of ``(site, stages, vector)`` grouped by stages and vector length, in first-seen
    order, with their local stages run (see :func:`advance`)."""
    groups: dict[tuple, list[int]] = {}
    for i, (st, v) in enumerate(zip(stages, vectors)):
        groups.setdefault((st, v.numel()), []).append(i)
    out = []
    for (st, _), members in groups.items():
        chosen = tuple(sites[i] for i in members)
        batch = Batch(stat, chosen, st, index, _stack([vectors[i] for i in members]), tuple(s.key for s in chosen),
                      tuple(positions[i] for i in members))
        out.extend(advance(batch, topology))
    return out


def canonical(batches: Sequence[Batch]) -> list[Batch]:
    """The batches with the rows of every pending batch past its first stage regrouped across
    batches by (statistic, stage index, the stages' axes and ops, vector length), rows in state
    order, groups ordered by their first row.

    NOTE [symmetric batches]: a batch's members are chosen by its first stage's vector length,
    which agrees across the ranks of that stage's reduction but may differ across the ranks
    of a later stage's (a row split by one axis and reduced over another). Past the first
    stage the members are therefore chosen again from facts every rank of the current stage's
    reduction shares, so they pack their requests in the same order."""
    kept: list[Batch] = []
    rows: dict[tuple, list[tuple[int, Batch, int]]] = {}
    for b in batches:
        if b.index == 0 or b.index == len(b.stages):
            kept.append(b)
            continue
        # Stage sizes are left out: an earlier stage's size may be local (lines of a shard).
        key = (id(b.stat), b.index, tuple((st.axes, st.op) for st in b.stages), b.rows.shape[1])
        rows.setdefault(key, []).extend((p, b, i) for i, p in enumerate(b.positions))
    merged = []
    for members in rows.values():
        members.sort(key=lambda m: m[0])
        first = members[0][1]
        sites = tuple(b.sites[i] for _, b, i in members)
        stacked = torch.stack([b.rows[i] for _, b, i in members])
        merged.append(Batch(first.stat, sites, first.stages, first.index, stacked, tuple(s.key for s in sites),
                            tuple(p for p, _, _ in members)))
    merged.sort(key=lambda b: b.positions[0])
    return kept + merged


def advance(batch: Batch, topology: Topology) -> list[Batch]:
    """Run the stages of ``batch`` that move no data (a reduction over no rank is the
    identity); returns the batch, or the batches its ``between`` vectors regroup into."""
    while batch.index < len(batch.stages) and not _reduces(batch.stages[batch.index], topology):
        following = next_stage(batch, batch.rows, topology)
        if following is not None:
            return following
    return [batch]


def next_stage(batch: Batch, reduced: torch.Tensor, topology: Topology) -> list[Batch] | None:
    """Move ``batch`` past its current stage given its reduced rows (same shape as ``rows``).
    After the last stage the batch keeps the rows (returns None); an earlier stage maps each
    row through ``stat.between`` and returns the new batches (the next vectors may differ in
    length from site to site)."""
    if batch.index + 1 == len(batch.stages):
        batch.rows = reduced
        batch.index += 1
        return None
    stat, index = batch.stat, batch.index
    vectors = [stat.between(index, v, s, topology) for v, s in zip(reduced.unbind(0), batch.sites)]
    return regroup(stat, batch.sites, [batch.stages] * len(vectors), vectors, batch.positions, index + 1, topology)


def _merge_rows(op: ReduceOpName, rows: torch.Tensor, where: torch.Tensor, groups: int) -> torch.Tensor:
    """Rows merged into ``groups`` rows with ``op`` (row ``i`` into ``where[i]``), on the rows'
    device; NaN propagates through ``max`` and ``min`` as in the host merge."""
    if op == "sum":
        return torch.zeros((groups, rows.shape[1]), dtype=rows.dtype, device=rows.device).index_add_(0, where, rows)
    out = torch.full((groups, rows.shape[1]), float("-inf") if op == "max" else float("inf"), dtype=rows.dtype,
                     device=rows.device)
    return out.scatter_reduce_(0, where.unsqueeze(1).expand_as(rows), rows, "amax" if op == "max" else "amin")


@dataclass(slots=True)
class Merge:
    """How a batch's rows merge: row ``i`` into slot ``index[i]``; the slots (group, kind,
    first site) in first-seen order. The index tensor is made once per device and kept (a
    plan reuses its merges every step, so nothing is copied to the device per step)."""

    index: list[int]
    slots: tuple[Slot, ...]
    where: torch.Tensor | None = None

    def rows(self, op: ReduceOpName, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` merged per slot (as is when every row is its own slot)."""
        if len(self.slots) == rows.shape[0]:
            return rows
        if self.where is None or self.where.device != rows.device:
            self.where = torch.tensor(self.index, device=rows.device)
        return _merge_rows(op, rows, self.where, len(self.slots))


def _merge_of(sites: Sequence[Site], group_of: Callable[[Site], tuple]) -> Merge:
    slots: dict[tuple[tuple, str], tuple[int, Site]] = {}
    index = [slots.setdefault((group_of(s), s.kind), (len(slots), s))[0] for s in sites]
    return Merge(index, tuple((g, kind, site) for (g, kind), (_, site) in slots.items()))


def merged_outputs(batches: Sequence[Batch], group_of: Callable[[Site], tuple], owner: Hashable
                   ) -> dict[Hashable, torch.Tensor]:
    """The finished batches' rows merged per (group, kind) slot, as flat output vectors keyed
    ``(owner, batch number)``; sets ``out_key`` and ``slots`` on each batch."""
    outputs: dict[Hashable, torch.Tensor] = {}
    for n, b in enumerate(batches):
        merge = b.merge if b.merge is not None else _merge_of(b.sites, group_of)
        b.out_key, b.slots = (owner, n), merge.slots
        outputs[b.out_key] = merge.rows(b.stat.op, b.rows).reshape(-1)
    return outputs


@dataclass(slots=True)
class _Cut:
    """One batch of a plan: statistic ``stat_index`` over the state entries ``members``."""

    stat_index: int
    stages: tuple[Stage, ...]
    members: list[int]
    sites: tuple[Site, ...]
    keys: tuple[SiteKey, ...]
    merge: Merge | None
    index: torch.Tensor | None = None
    """``members`` as an index tensor, made on first use by a :class:`BlockState`."""

    def rows_of(self, matrix: torch.Tensor) -> torch.Tensor:
        """The members' rows of a block matrix (the matrix itself when they are all its rows)."""
        if len(self.members) == matrix.shape[0]:
            return matrix  # members are increasing and distinct: all rows, in order
        if self.index is None or self.index.device != matrix.device:
            self.index = torch.tensor(self.members, device=matrix.device)
        return matrix.index_select(0, self.index)


class BatchPlan:
    """How one metric's prepared state is cut into batches, kept while the sites stay the same.

    Args:
        statistics: the metric's statistics (state entries hold one vector per statistic).
        group_of: the metric's scope group key of a site (for the merge after the last stage).
    """

    def __init__(self, statistics: Sequence[Statistic], group_of: Callable[[Site], tuple]) -> None:
        self.statistics = tuple(statistics)
        self.group_of = group_of
        self._cached: tuple[tuple, tuple, list[_Cut]] | None = None  # (signature, objects held, cuts)

    def batches(self, state: Mapping[SiteKey, Sequence[torch.Tensor]], sites: Mapping[SiteKey, Site],
                topology: Topology) -> list[Batch]:
        """The state's vectors stacked into batches (a :class:`BlockState`'s matrices sliced),
        local stages run."""
        block = state if isinstance(state, BlockState) else None
        held = block.sites if block is not None else None
        chosen = held if held is not None else list(map(sites.__getitem__, state))
        vectors = list(state.values()) if block is None else []
        # Identity of the site objects (or of the block's tuple of them) and topology (held
        # below, so ids stay valid) and every vector length (one per statistic in a block):
        # when all are unchanged, so is the cut.
        lengths = (tuple(v.numel() for vs in vectors for v in vs) if block is None
                   else ("block", *(m.shape[1] for m in block.matrices)))
        signature = (id(topology), (id(held),) if held is not None else tuple(map(id, chosen)), lengths)
        cached = self._cached  # one read: a metric shared by threads never sees half an update
        if cached is None or cached[0] != signature:
            cuts = self._cut(chosen, vectors or list(state.values()), topology)
            cached = self._cached = (signature, (topology, chosen), cuts)
        out = []
        for cut in cached[2]:
            j = cut.stat_index
            rows = (_stack([vectors[i][j] for i in cut.members]) if block is None
                    else cut.rows_of(block.matrices[j]))
            batch = Batch(self.statistics[j], cut.sites, cut.stages, 0, rows, cut.keys, tuple(cut.members),
                          cut.merge)
            out.extend(advance(batch, topology))
        return out

    def _cut(self, sites: Sequence[Site], vectors: list[Sequence[torch.Tensor]], topology: Topology) -> list[_Cut]:
        cuts = []
        for j, stat in enumerate(self.statistics):
            groups: dict[tuple, tuple[tuple[Stage, ...], list[int]]] = {}
            for i, site in enumerate(sites):
                stages = stat.stages(site, topology)
                groups.setdefault((stages, vectors[i][j].numel()), (stages, []))[1].append(i)
            for stages, members in groups.values():
                chosen = tuple(sites[i] for i in members)
                # The merge is known now for batches that reach the end without regrouping.
                merge = _merge_of(chosen, self.group_of) if len(stages) == 1 else None
                cuts.append(_Cut(j, stages, members, chosen, tuple(s.key for s in chosen), merge))
        return cuts
