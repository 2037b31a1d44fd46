"""The executor: one pass over every due metric, collectives packed per (axis, op, dtype).

Every metric collective goes through here (and, below it, the three calls of
``tmetrics_core.distributed.collectives``); counts, symmetry checks and failure agreement live here (one
choke point, as pluggy's ``_hookexec``).

Per step the executor:

1. agrees across all ranks which metrics failed locally (one ``all_reduce(MAX)`` of a small
   int64 vector over the default group), so every rank skips the same metrics and no rank waits
   in a collective the others never issue;
2. optionally checks the plan (on a metric's first run, whenever the plan changes, or on
   demand): every rank contributes fingerprints of its per-axis layouts to one ``all_gather``;
   a difference raises :class:`PlanMismatchError` on every rank, naming the metric, the axis and
   the ranks that differ, before any mismatched collective can hang;
3. runs rounds: the requests of all due metrics are deduplicated by key and bucketed by (axes,
   op, dtype); a small round goes out as ONE ``all_gather`` over the joint group of all its axes
   and is reduced locally when every value has one length on all ranks, else the buckets of
   each axis set share one ``all_gather`` (NOTE [gathered rounds]); large buckets are reduced
   with one ``all_reduce`` each. Collective calls per round are therefore one (or about
   ``#axis sets``), whatever the number of tensors, shapes or metrics;
4. copies every metric's final vectors to the host in one transfer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import Collectives, TorchCollectives
from tmetrics_core.errors import PlanMismatchError
from tmetrics_core.metrics.base import CollectiveRequest, MetricResult, Round, TensorMetric
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey

__all__ = ["CollectiveStats", "Executor", "MetricFailure"]

log = logging.getLogger(__name__)

_GATHER_LIMIT = 1 << 19
"""Most elements an all_gather of buckets may collect on one rank (members x values; 4 MiB in
float64); larger buckets are all-reduced."""

_REDUCE_OF: dict[str, ReduceOpName] = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}
"""The reduction that materializes a ``Partial`` op (``avg``: a sum, divided after)."""

_Buckets = dict[tuple[tuple[str, ...], ReduceOpName, torch.dtype], list[CollectiveRequest]]
"""Requests by (axes, op, dtype); ``min`` rides in ``max`` negated, so op is ``sum`` or ``max``."""

@dataclass(slots=True)
class CollectiveStats:
    """Counters for benchmarks and tests: collective calls and elements moved, per axis."""

    calls: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    seconds: float = 0.0
    """Wall time spent inside data collectives (the communication itself), seconds."""

    def add(self, axis: str, numel: int) -> None:
        self.calls[axis] = self.calls.get(axis, 0) + 1
        self.elements[axis] = self.elements.get(axis, 0) + numel

    @property
    def total_calls(self) -> int:
        """All collective calls counted, control collectives included."""
        return sum(self.calls.values())


@dataclass(frozen=True, slots=True)
class MetricFailure:
    """A metric skipped on every rank at one step because it raised on ``ranks``."""

    metric: str
    ranks: tuple[int, ...]
    error: str


@dataclass(slots=True)
class _Due:
    metric: TensorMetric
    state: Mapping[SiteKey, Any]
    error: str | None = None
    round: Round = field(default_factory=lambda: Round(done=True))
    """The metric's current round: done (nothing to run) until ``start`` returns its first."""


class Executor:
    """Runs the collective rounds of all due metrics of a step over a :class:`Topology`.

    Args:
        topology: the named axes.
        collectives: how to talk to other ranks; default ``TorchCollectives(timeout_s)``, which
            bounds every collective so a hung peer raises instead of hanging.
        timeout_s: the bound in seconds for the default collectives.
        device: where packed buffers and control tensors live: ``cpu`` for gloo, the rank's
            CUDA device for NCCL (which moves device tensors only).
    """

    def __init__(self, topology: Topology, *, collectives: Collectives | None = None,
                 timeout_s: float = 60.0, device: str | torch.device = "cpu") -> None:
        self.topology = topology
        self.comm: Collectives = collectives or TorchCollectives(timeout_s)
        self.device = torch.device(device)
        self.stats = CollectiveStats()
        self.unfed: tuple[str, ...] = ()
        """The due metrics of the last :meth:`run` that read no tensor on any rank."""
        self.flagged = False
        """Whether any rank passed ``flag=True`` to the last :meth:`run`."""
        self._distributed = topology.world_size > 1

    # -- public -------------------------------------------------------------------------------
    def run(self, due: Sequence[tuple[TensorMetric, Mapping[SiteKey, Any], str | None]],
            sites: Mapping[SiteKey, Site], *, check: bool = False, unfed: Collection[str] = (),
            flag: bool | None = None) -> tuple[dict[str, list[MetricResult]], list[MetricFailure]]:
        """Run every due metric to its results.

        Args:
            due: ``(metric, prepared state, local error or None)`` in the same order on every
                rank (config order). A metric with a local error on any rank is skipped on all;
                so is one whose ``start`` raises, or whose ``resume`` raises before a round that
                is not ``Round.agreed`` (one small agreement collective after such a round).
            sites: every site of the plan by key (rank-symmetric).
            check: compare plan fingerprints across ranks before the first data collective.
            unfed: names of due metrics that read no tensor on this rank (placeholders only).
                A metric unfed on every rank (agreed in the failure agreement's collective, no
                extra call) gives no results, and its name is put in :attr:`unfed`.
            flag: a caller's yes/no (None: none), told to every rank in that same collective
                (one more element): :attr:`flagged` is True on every rank when it was on any.

        Returns:
            ``(results by metric name, failures)``; failures name the metric, the ranks where
            it raised and the error text (of this rank, or of the lowest failing rank).

        Raises:
            PlanMismatchError: on every rank, when ``check`` finds ranks with different plans.
        """
        items = [_Due(m, s, e) for m, s, e in due]
        self.unfed, self.flagged = (), bool(flag)
        for item in items:
            if item.error is None:
                try:
                    item.round = item.metric.start(item.state, sites, self.topology)
                except Exception as exc:  # noqa: BLE001 - a metric bug must not stop training
                    item.error = f"{type(exc).__name__}: {exc}"
        failures = self._agree_failures(items, unfed, flag)
        failed = {f.metric for f in failures} | set(self.unfed)
        live = [i for i in items if i.metric.name not in failed]
        first = True
        while True:
            pending = [i for i in live if not i.round.done]
            if not pending:
                break
            requests = self._dedup(pending)
            if check and first:
                self._check_plan(requests, pending)
            first = False
            results = self._reduce(requests)
            # Decided before resume, from rank-symmetric rounds: could a failure desync ranks?
            more = not all(item.round.agreed for item in pending)
            for item in pending:
                try:
                    item.round = item.metric.resume(item.round.continuation, results)
                except Exception as exc:  # noqa: BLE001 - a metric bug must not stop training
                    item.error, item.round = f"{type(exc).__name__}: {exc}", Round(done=True)
            if more:
                # A metric that raised here on one rank would skip requests the others issue:
                # agree now, and drop it everywhere before the next round.
                dropped = self._agree_failures(pending)
            else:
                dropped = [MetricFailure(i.metric.name, (self.topology.global_rank,), i.error or "")
                           for i in pending if i.error]
            failures.extend(dropped)
            gone = {f.metric for f in dropped}
            live = [i for i in live if i.metric.name not in gone]
        host = self._to_host(live)
        out: dict[str, list[MetricResult]] = {}
        for item in live:
            try:
                out[item.metric.name] = item.metric.finish(item.round.continuation, host)
            except Exception as exc:  # noqa: BLE001 - local only: no collective follows
                failures.append(MetricFailure(item.metric.name, (self.topology.global_rank,),
                                              f"{type(exc).__name__}: {exc}"))
        return out, failures

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (one tiny world collective)."""
        if not self._distributed:
            return flag
        self.stats.add("world", 1)
        gathered = self.comm.all_gather(torch.tensor([int(flag)], dtype=torch.int64, device=self.device), None)
        return any(v for g in gathered for v in g.tolist())

    def gather(self, tensor: torch.Tensor, axis: str) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere) over the group of ``axis``, in axis-rank
        order; ``[tensor]`` when the axis has one rank. One collective, counted on ``axis``."""
        group = self.topology.axes[axis].group
        if not self._distributed or group is None:
            return [tensor]
        self.stats.add(axis, tensor.numel())
        start = time.perf_counter()
        out = self.comm.all_gather(tensor.to(self.device), group)
        self.stats.seconds += time.perf_counter() - start
        return out

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` (slow path: plan changes only)."""
        if not self._distributed:
            return [obj]
        self.stats.add("world", 1)
        return self.comm.all_gather_object(obj, None)

    def materialize(self, tensors: Sequence[torch.Tensor], axes: Sequence[tuple[str, ...]],
                    ops: Sequence[str]) -> list[torch.Tensor]:
        """Reduce whole local tensors of ``Partial`` placements (``ops[i]`` over ``axes[i]``),
        packed like any round; returns the full tensors in the input shapes."""
        requests = [CollectiveRequest(("materialize", i), a, _REDUCE_OF[op],
                                      t.detach().reshape(-1).to(torch.float64))
                    for i, (t, a, op) in enumerate(zip(tensors, axes, ops))]
        results = self._reduce(requests)
        out = []
        for i, (t, a, op) in enumerate(zip(tensors, axes, ops)):
            full = results[("materialize", i)]
            if op == "avg":
                full = full / math.prod(self.topology.axes[x].size for x in a)
            out.append(full.to(t.dtype).reshape(t.shape))
        return out

    # -- rounds -------------------------------------------------------------------------------
    def _dedup(self, pending: Sequence[_Due]) -> list[CollectiveRequest]:
        seen: dict[Hashable, CollectiveRequest] = {}
        for item in pending:
            for req in item.round.requests:
                if req.key not in seen:
                    seen[req.key] = req
        return list(seen.values())

    def _reduce(self, requests: Sequence[CollectiveRequest]) -> dict[Hashable, torch.Tensor]:
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
                self._all_reduce(packed, op, group, "+".join(axes))
            else:
                for axis in axes:
                    self._all_reduce(packed, op, self.topology.axes[axis].group, axis)
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
        the joint group cannot be built or the gathered table would exceed ``_GATHER_LIMIT``
        elements (then one ``all_reduce`` per bucket moves less data).

        NOTE [gathered rounds]: metric rounds are latency-bound (a few thousand values), so one
        all_gather beats an all_reduce per (axes, op). Buckets over fewer axes than the union
        may only join when every request is ``uniform``: otherwise a value may have another
        length on a member outside the bucket's own group, and the gathered rows would not line
        up."""
        sizes = [self.topology.axes[a].size for a in union]
        members = math.prod(sizes)
        values = [[(-current[r.key] if r.op == "min" else current[r.key]).to(torch.float64) for r in bucket]
                  for bucket in buckets.values()]
        total = sum(v.numel() for vs in values for v in vs)
        group = self.topology.joint_group(union) if total * members <= _GATHER_LIMIT else None
        if group is None:
            return False
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

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any, axis: str) -> None:
        self.stats.add(axis, tensor.numel())
        if self._distributed and group is not None:
            start = time.perf_counter()
            self.comm.all_reduce(tensor, op, group)
            self.stats.seconds += time.perf_counter() - start

    def _to_host(self, live: Sequence[_Due]) -> dict[Hashable, list[float]]:
        outputs: dict[Hashable, torch.Tensor] = {}
        for item in live:
            outputs.update(item.round.outputs)
        if not outputs:
            return {}
        vectors = [v if v.dtype == torch.float64 and v.dim() == 1 else v.reshape(-1).to(torch.float64)
                   for v in outputs.values()]
        flat = (torch.cat(vectors) if len(vectors) > 1 else vectors[0]).cpu().tolist()
        out: dict[Hashable, list[float]] = {}
        start = 0
        for key, vec in zip(outputs, vectors):
            out[key] = flat[start:start + vec.numel()]
            start += vec.numel()
        return out

    # -- agreement and checks -------------------------------------------------------------------
    def _agree_failures(self, items: Sequence[_Due], unfed: Collection[str] = (),
                        flag: bool | None = None) -> list[MetricFailure]:
        """Metrics that raised on any rank (flag 1); with ``unfed``, also sets :attr:`unfed` to
        the metrics unfed on every rank (flag 2, same collective); with ``flag`` (not None, the
        first agreement of a run), a last element (4) sets :attr:`flagged`."""
        mine = [(1 if i.error else 0) | (2 if i.metric.name in unfed else 0) for i in items]
        mine = mine + [4 if flag else 0] if flag is not None else mine or [0]
        if self._distributed:
            flags = torch.tensor(mine, dtype=torch.int64, device=self.device)
            self.stats.add("world", flags.numel())
            table = [g.tolist() for g in self.comm.all_gather(flags, None)]
        else:
            table = [mine]
        if flag is not None:
            self.flagged = any(row[-1] & 4 for row in table)
        # Slow path, only when something failed: every rank learns the lowest failing rank's
        # error text, so the one warning (logged where the sinks are) says what went wrong.
        texts = self.gather_objects([i.error for i in items]) if any(v & 1 for row in table for v in row) else None
        if unfed:
            self.unfed = tuple(item.metric.name for index, item in enumerate(items)
                               if all(row[index] & 2 for row in table) and not any(row[index] & 1 for row in table))
        failures = []
        for index, item in enumerate(items):
            ranks = tuple(r for r, row in enumerate(table) if row[index] & 1)
            if ranks:
                error = texts[ranks[0]][index] if texts is not None else item.error
                failures.append(MetricFailure(item.metric.name, ranks, error or f"raised on rank(s) {list(ranks)}"))
        return failures

    def _check_plan(self, requests: Sequence[CollectiveRequest], pending: Sequence[_Due]) -> None:
        if not self._distributed:
            return
        names = self.topology.names
        owner: dict[Hashable, str] = {}
        for item in pending:
            for req in item.round.requests:
                owner.setdefault(req.key, item.metric.name)
        layouts = {a: _layout(requests, a, owner) for a in names}
        coords = [self.topology.axes[a].rank for a in names]
        fps = [_fingerprint(layouts[a]) for a in names]
        mine = torch.tensor(coords + fps, dtype=torch.int64, device=self.device)
        self.stats.add("world", mine.numel())
        gathered = self.comm.all_gather(mine, None)
        table = [g.tolist() for g in gathered]
        n = len(names)
        for ai, axis in enumerate(names):
            groups: dict[tuple, list[int]] = {}
            for rank, row in enumerate(table):
                other = tuple(c for j, c in enumerate(row[:n]) if j != ai)
                groups.setdefault(other, []).append(rank)
            for ranks in groups.values():
                ref = table[ranks[0]][n + ai]
                bad = tuple(r for r in ranks if table[r][n + ai] != ref)
                if bad:
                    self._raise_mismatch(axis, ranks[0], bad, layouts[axis], pending)

    def _raise_mismatch(self, axis: str, ref_rank: int, bad: tuple[int, ...],
                        layout: list[tuple[str, str, str, int, str]], pending: Sequence[_Due]) -> None:
        everything = self.comm.all_gather_object(layout, None)
        ref = everything[ref_rank]
        other = everything[bad[0]]
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


def _layout(requests: Sequence[CollectiveRequest], axis: str,
            owner: Mapping[Hashable, str]) -> list[tuple[str, str, str, int, str]]:
    """What this rank will send over ``axis``: (key, op, dtype, elements, metric) per request."""
    rows: list[tuple[str, str, str, int, str]] = []
    for r in requests:
        if axis not in r.axes:
            continue
        parts = r.parts or (r.key,)
        size = r.value.numel() // len(parts)
        rows.extend((repr(part), r.op, str(r.value.dtype), size, owner.get(r.key, "?")) for part in parts)
    return rows


def _fingerprint(layout: list[tuple[str, str, str, int, str]]) -> int:
    """56-bit hash of the layout without metric names (two metrics may own one shared request)."""
    digest = hashlib.blake2b(repr([row[:4] for row in layout]).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def _first_diff(a: list, b: list, which: int) -> str:
    for x, y in zip(a + [None], b + [None]):
        if x != y:
            row = (x, y)[which]
            return "nothing" if row is None else f"{row[0]} ({row[1]}, {row[2]}, {row[3]} elements)"
    return "nothing"
