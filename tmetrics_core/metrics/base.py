"""The metric protocol and the declarative base most metrics are written on.

A :class:`TensorMetric` never calls a collective. It prepares local state from the tensors it
accepts, then hands the executor :class:`CollectiveRequest` values (data: a vector, the axes to
reduce it over and the op) round after round, and finally turns the reduced values, copied to
the host once for all metrics, into :class:`MetricResult` values.

:class:`StatMetric` covers the common shape "local statistics -> reduce over shard and owner
axes -> merge over the tensors of a scope -> finalize": a metric names its statistics and writes
``finalize``; see ``tmetrics_core.metrics.norms`` for metrics of a few lines each.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import abc
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Hashable, Literal, Mapping, Protocol, Sequence, cast, runtime_checkable

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.metrics.batches import Batch, BatchPlan, advance, canonical, merged_outputs, next_stage
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.metrics.statistics import Statistic
from tmetrics_core.metrics.vectors import statistic_vectors
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.records import Labels, Value
from tmetrics_core.kinds import OPTIMIZER_KINDS
from tmetrics_core.site import Site, SiteKey

__all__ = [
    "CollectiveRequest",
    "MetricResult",
    "Round",
    "Scope",
    "StatMetric",
    "TensorMetric",
]

_KEY = operator.attrgetter("key")

Scope = Literal["global", "layer", "expert", "tensor", "family"]
"""How a metric groups tensors: all of them, per layer, per (layer, expert), per tensor, or per
family (the same tensor across layers, e.g. every layer's ``attn.q.weight``)."""


@dataclass(frozen=True, slots=True)
class CollectiveRequest:
    """Reduce ``value`` (1-D, usually float64) with ``op`` over each axis of ``axes`` in
    topology order. Requests with equal ``key`` are sent once; their values must be equal."""

    key: Hashable
    axes: tuple[str, ...]
    op: ReduceOpName
    value: torch.Tensor
    parts: tuple[Hashable, ...] = ()
    """Keys of the equal-sized pieces ``value`` concatenates (one per site of a batch), for plan
    checks and their messages; empty when ``value`` is one piece."""
    uniform: bool = False
    """``value`` has this length on every rank of the topology, not only on the ranks of
    ``axes`` (see :meth:`Statistic.uniform`); lets requests over other axes share a collective."""


@dataclass(slots=True)
class Round:
    """What a metric asks for next: ``requests`` for this round, or ``done`` with the reduced
    vectors it needs on the host (``outputs``: key -> 1-D tensor; copied in one transfer).

    ``agreed`` promises that ``resume`` after this round needs no agreement across ranks: it
    returns a done round (no further request), or it cannot raise on some ranks only. It must
    be the same on every rank. False is always safe: the executor then agrees on ``resume``
    failures with one small collective after the round, so a metric that raised on one rank
    is dropped on all before the next round instead of leaving the others waiting."""

    requests: list[CollectiveRequest] = field(default_factory=list)
    continuation: Any = None
    done: bool = False
    outputs: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    agreed: bool = False


@dataclass(frozen=True, slots=True)
class MetricResult:
    """One finished value: labels say which slice of the model it describes.

    ``scope`` is the metric's grouping; ``layer``/``expert`` are global indices; ``tensor`` a
    canonical or family name; ``stat`` a sub-statistic of a multi-valued metric.
    """

    value: Value
    scope: Scope = "global"
    layer: int | None = None
    expert: int | None = None
    tensor: str | None = None
    stat: str | None = None

    @property
    def labels(self) -> Labels:
        """The labels the record of this value carries to the sinks (one shared, immutable
        ``Labels`` per distinct slice: a due step makes no new one for a slice seen before)."""
        key = (self.layer, self.expert, self.tensor, self.stat)
        labels = _LABELS.get(key)
        if labels is None:
            if len(_LABELS) >= _LABELS_KEPT:
                _LABELS.clear()
            labels = _LABELS[key] = Labels(*key)
        return labels


@runtime_checkable
class TensorMetric(Protocol):
    """A metric: local preparation plus declared collectives, never a collective call."""

    name: str
    source_kinds: frozenset[str]

    def accepts(self, site: Site) -> bool:
        """Whether this metric wants ``site`` (kind, scope and selection)."""
        ...

    def check(self, site: Site, topology: Topology) -> None:
        """Raise ``PlacementError`` at configuration time for a site it cannot handle."""
        ...

    def prepare(self, sites: Sequence[Site], tensors: Sequence[torch.Tensor | None],
                topology: Topology, memo: dict[Hashable, torch.Tensor]) -> dict[SiteKey, Any]:
        """Local state per site (``None`` tensors are placeholders for sites held elsewhere)."""
        ...

    def merge(self, a: dict[SiteKey, Any], b: dict[SiteKey, Any]) -> dict[SiteKey, Any]:
        """Combine the states of two observations of the same step (micro-batches) into a new
        state. Never change ``a`` or ``b`` in place: their tensors may be views of memory that
        other metrics' states share (a step's rows)."""
        ...

    def start(self, state: Mapping[SiteKey, Any], sites: Mapping[SiteKey, Site], topology: Topology) -> Round:
        """The first round of requests."""
        ...

    def resume(self, continuation: Any, results: Mapping[Hashable, torch.Tensor]) -> Round:
        """The next round, given the reduced values of the previous one."""
        ...

    def finish(self, continuation: Any, host: Mapping[Hashable, list[float]]) -> list[MetricResult]:
        """Results from the reduced output vectors, as Python floats."""
        ...


class StatMetric:
    """Declarative metric: statistics per site, reduced across ranks, merged per scope group.

    Subclasses set ``name``, ``source_kinds``, ``scope``, ``statistics`` and the catalogue text
    (``formula``, ``unit``, ``baseline``), and implement :meth:`finalize`. ``select`` (glob or
    globs on canonical names) narrows the sites; layer and expert scopes need those labels.
    """

    name: str = ""
    source_kinds: frozenset[str] = frozenset()
    scope: Scope = "global"
    statistics: tuple[Statistic, ...] = ()
    formula: str = ""
    unit: str = ""
    baseline: str = ""
    planned: bool = True
    """Declares that :meth:`prepare` gives, per accepted site (less those :meth:`kept` drops),
    the vectors of :attr:`statistics` in order, and nothing else: then a planned path (the
    parameter side's :class:`~tmetrics_core.sources.param_program.ParamProgram`) may compute the
    state from rows instead of calling :meth:`prepare`. A subclass whose ``prepare``
    (or ``_block``) computes something else sets False; one that only computes the same vectors
    faster (as ``NonFinite``) keeps True."""
    resume_agreed: bool = True
    """Declares that :meth:`resume` raises on every rank alike or never, given vectors of the
    lengths its statistics' stages declare (tmetrics' :meth:`resume` runs only stage arithmetic
    on rank-symmetric shapes): together with every statistic's ``Statistic.between_agreed``,
    the executor then needs no failure agreement after a round (``Round.agreed``). A subclass
    overriding :meth:`resume` with code that may raise on some ranks only sets False."""

    def __init__(self, *, name: str | None = None, source_kinds: Sequence[str] | None = None,
                 scope: Scope | None = None, select: str | Sequence[str] | None = None) -> None:
        if name is not None:
            self.name = name
        if source_kinds is not None:
            self.source_kinds = frozenset(source_kinds)
        if scope is not None:
            self.scope = scope
        self.select: tuple[str, ...] = (select,) if isinstance(select, str) else tuple(select or ())

    def accepts(self, site: Site) -> bool:
        if site.kind not in self.source_kinds:
            return False
        if self.scope in ("layer", "expert") and site.layer is None:
            return False
        if self.scope == "expert" and site.expert is None:
            return False
        return not self.select or any(fnmatchcase(site.name, pattern) for pattern in self.select)

    def check(self, site: Site, topology: Topology) -> None:
        for stat in self.statistics:
            stat.check(site, topology)

    def kept(self, sites: Sequence[Site]) -> list[int] | None:
        """Indices of the accepted ``sites`` this metric prepares, in order, when it drops some
        (a site it reads only together with another one); None: all of them. Depends on the
        sites alone, which every rank knows alike, so every rank keeps the same ones."""
        return None

    def prepare(self, sites, tensors, topology, memo):
        """The vectors of :attr:`statistics` per accepted site (less those :meth:`kept` drops),
        from :func:`~tmetrics_core.metrics.vectors.statistic_vectors` (the statistics' one
        entry path: one rows pass per call, shared through ``memo``); placeholders for sites
        held elsewhere. One matrix per statistic (:class:`BlockState`) where every site is held
        here and every statistic gives a matrix."""
        kept = self.kept(sites)
        if kept is not None:
            sites, tensors = [sites[i] for i in kept], [tensors[i] for i in kept]
        stats = self.statistics
        if not any(map(operator.is_, tensors, itertools.repeat(None))):
            computed = statistic_vectors(stats, tensors, sites, topology, memo) if sites else []
            if sites and all(isinstance(v, torch.Tensor) for v in computed):
                return BlockState(tuple(map(_KEY, sites)), cast("list[torch.Tensor]", computed))
            return {s.key: [v[i] for v in computed] for i, s in enumerate(sites)}
        held = [i for i, t in enumerate(tensors) if t is not None]
        computed = statistic_vectors(stats, [tensors[i] for i in held], [sites[i] for i in held], topology,
                                     memo) if held else []
        state: dict[SiteKey, list[torch.Tensor]] = {}
        at = {i: k for k, i in enumerate(held)}
        for i, site in enumerate(sites):
            k = at.get(i)
            state[site.key] = ([v[k] for v in computed] if k is not None
                               else [stat.placeholder(site, topology) for stat in stats])
        return state

    def merge(self, a, b):
        """Each statistic's :meth:`~tmetrics_core.metrics.statistics.Statistic.merge` of the
        vectors of a site both observations read; a site only one read keeps its vectors."""
        out = dict(a)
        for key, vectors in b.items():
            held = out.get(key)
            out[key] = vectors if held is None else [
                stat.merge(key, x, y) for stat, x, y in zip(self.statistics, held, vectors)]
        return out

    def start(self, state, sites, topology):
        plan = getattr(self, "_plan", None)
        if plan is None:
            plan = self._plan = BatchPlan(self.statistics, self._group)
        return self._round(plan.batches(state, sites, topology), topology)

    def resume(self, continuation, results):
        batches, topology = continuation
        following = []
        for b in batches:
            if b.index == len(b.stages):
                following.append(b)
                continue
            regrouped = next_stage(b, results[self._key(b)].reshape(b.rows.shape), topology)
            for batch in regrouped if regrouped is not None else [b]:
                following.extend(advance(batch, topology))
        return self._round(following, topology)

    def _round(self, batches: list[Batch], topology: Topology) -> Round:
        batches = canonical(batches)
        requests = [CollectiveRequest(self._key(b), b.stages[b.index].axes, b.stages[b.index].op, b.rows.reshape(-1),
                                      b.parts, b.stat.uniform(b.sites[0], topology, b.index))
                    for b in batches if b.index < len(b.stages)]
        if requests:
            # The next resume finishes every batch (each requesting one is at its last stage),
            # or only tmetrics' own stage arithmetic runs, on shapes every rank shares.
            last = all(b.index == len(b.stages) - 1 for b in batches if b.index < len(b.stages))
            own = self.resume_agreed and all(b.stat.between_agreed for b in batches
                                             if b.index < len(b.stages) - 1)
            return Round(requests=requests, continuation=(batches, topology), agreed=last or own)
        outputs = merged_outputs(batches, self._group, id(self))
        return Round(continuation=(batches, topology), done=True, outputs=outputs)

    def _key(self, batch: Batch) -> Hashable:
        """The request key of ``batch``'s current stage. Requests with equal keys are sent once
        (:class:`CollectiveRequest`), so equal keys must mean equal values. A metric that reads
        the optimizer's output (updates, Adam state) is prepared after the optimizer step, and so
        are the parameters it reads; the same parameter sites read before the step by another
        metric have other values. Its keys are therefore marked as after the step."""
        return ("after the step", batch.key) if self.source_kinds & OPTIMIZER_KINDS else batch.key

    def grouped(self, continuation: Any, host: Mapping[Hashable, list[float]]
                ) -> tuple[dict[tuple, dict[str, list[float]]], dict[tuple, Site]]:
        """The finished statistics merged per scope group, as :meth:`finalize` reads them
        (``stats[name]`` and ``stats["kind:name"]``), and the first site of each group (its
        labels). Groups are merged on the device before the host copy; here only kinds of one
        group and batches of one statistic combine."""
        batches, _ = continuation
        groups: dict[tuple, dict[str, list[float]]] = {}
        labels: dict[tuple, Site] = {}
        for b in batches:
            values = host[b.out_key]
            width = len(values) // len(b.slots)
            op, stat = b.stat.op, b.stat.name
            named: dict[str, str] = {}
            for i, (gkey, kind, site) in enumerate(b.slots):
                row = values[i * width:(i + 1) * width]
                bucket = groups.get(gkey)
                if bucket is None:
                    bucket = groups[gkey] = {}
                    labels[gkey] = site
                by_kind = named.get(kind)
                if by_kind is None:
                    by_kind = named[kind] = f"{kind}:{stat}"
                # Rows are never changed in place (_combine_list makes new lists): shared as they are.
                for name in (stat, by_kind):
                    held = bucket.get(name)
                    bucket[name] = row if held is None else _combine_list(op, held, row)
        return groups, labels

    def finish(self, continuation, host):
        groups, labels = self.grouped(continuation, host)
        results: list[MetricResult] = []
        for gkey in sorted(groups, key=_sort_key):
            value = self.finalize(groups[gkey])
            if value is None:
                continue  # the group read nothing on any rank (no gradient anywhere): no record
            base = self._labels(labels[gkey])
            # A float first: typing's and abc's instance checks cost microseconds per value.
            if type(value) is not float and isinstance(value, abc.Mapping):
                results.extend(MetricResult(v, *base, stat) for stat, v in value.items())
            else:
                results.append(MetricResult(value, *base))
        return results

    def _group(self, site: Site) -> tuple:
        if self.scope == "layer":
            return (site.layer,)
        if self.scope == "expert":
            return (site.layer, site.expert)
        if self.scope == "tensor":
            return (site.name,)
        if self.scope == "family":
            return (site.family or site.name,)
        return ()

    def _labels(self, site: Site) -> tuple[Scope, int | None, int | None, str | None]:
        """``(scope, layer, expert, tensor)`` of a group's results (``MetricResult``'s order)."""
        if self.scope == "layer":
            return ("layer", site.layer, None, None)
        if self.scope == "expert":
            return ("expert", site.layer, site.expert, None)
        if self.scope == "tensor":
            return ("tensor", site.layer, site.expert, site.name)
        if self.scope == "family":
            return ("family", None, None, site.family or site.name)
        return ("global", None, None, None)

    def finalize(self, stats: Mapping[str, list[float]]) -> Value | Mapping[str, Value] | None:
        """Turn the merged statistics of one group into a value (or a mapping stat -> value
        for multi-valued metrics), or None when the group read nothing on any rank (every
        tensor a placeholder: no gradient anywhere), which writes no record. ``stats[name]``
        merges a statistic over every site of the group; ``stats["kind:name"]`` over the sites
        of one source kind only (e.g. ``"update:sumsq"`` and ``"param:sumsq"`` for an update
        ratio)."""
        raise NotImplementedError(f"{type(self).__name__}.finalize")

    def __repr__(self) -> str:
        sel = f", select={list(self.select)}" if self.select else ""
        return f"{type(self).__name__}({self.name!r}{sel})"


def _combine_list(op: ReduceOpName, acc: list[float] | None, values: list[float]) -> list[float]:
    if acc is None:
        return list(values)
    if op == "sum":
        return [a + b for a, b in zip(acc, values)]
    pick = max if op == "max" else min
    return [_nan_pick(pick, a, b) for a, b in zip(acc, values)]


def _nan_pick(pick, a: float, b: float) -> float:
    if a != a or b != b:
        return float("nan")
    return pick(a, b)


@functools.lru_cache(maxsize=1 << 16)
def _sort_key(gkey: tuple) -> tuple:
    """The order of a group's results: by each label, None last, numbers before names (cached:
    a model's groups recur every due step)."""
    return tuple((v is None, v if not isinstance(v, str) else 0, str(v)) for v in gkey)


_LABELS: dict[tuple, Labels] = {}
"""Shared ``Labels`` by ``(layer, expert, tensor, stat)`` (:attr:`MetricResult.labels`): the same
slices recur every due step (one ``Labels`` each instead of one per record)."""

_LABELS_KEPT = 1 << 16
"""Slices kept at most; the table is cleared when full."""

