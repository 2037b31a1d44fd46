"""The executor: one pass over every due metric, collectives packed per (axis, op, dtype).

Every metric collective goes through here (and, below it, the three calls of
``tmetrics_core.distributed.collectives``); counts, symmetry checks and failure agreement live here (one
choke point, as pluggy's ``_hookexec``).

Per step the executor:

1. agrees across all ranks which metrics failed locally (one ``all_reduce(MAX)`` of a small
   int64 vector on the host, over the control group: no wait for the accelerator), so every rank
   skips the same metrics and no rank waits in a collective the others never issue;
2. optionally checks the plan (on a metric's first run, whenever the plan changes, or on
   demand): one ``all_reduce(MAX)`` per axis of a fingerprint of this rank's layout on that axis
   and its negation (the group's max and min), and one over the world of the mismatch flags;
   a difference raises :class:`PlanMismatchError` on every rank, naming the metric, the axis and
   the ranks that differ (gathered then, on that failure path only), before any mismatched
   collective can hang. Per-rank bytes of both do not grow with the world size;
3. runs rounds: the requests of all due metrics are deduplicated by key and bucketed by (axes,
   op, dtype); a small round goes out as ONE ``all_gather`` over the joint group of all its axes
   and is reduced locally when every value has one length on all ranks, else the buckets of
   each axis set share one ``all_gather`` (NOTE [gathered rounds]); large buckets are reduced
   with one ``all_reduce`` each. Collective calls per round are therefore one (or about
   ``#axis sets``), whatever the number of tensors, shapes or metrics;
4. reduces the step's device checks (``DeviceCheck``) with MAX over the world on the device,
   when any rank has one (known from step 1);
5. copies every metric's final vectors and the checks to the host in one transfer, started
   without waiting (:meth:`Executor.launch`) and read by :meth:`Executor.collect`, at once or a
   step later: the due step's only wait for the accelerator (besides a plan check, step 2),
   and none when read a step later.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Mapping, NamedTuple, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import Collectives, TorchCollectives
from tmetrics_core.distributed.host_copy import HostCopy
from tmetrics_core.errors import PlanMismatchError, TMetricsError
from tmetrics_core.metrics.base import CollectiveRequest, MetricResult, Round, TensorMetric
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey

__all__ = ["CollectiveStats", "DeviceCheck", "Executor", "MetricFailure", "Pending"]

log = logging.getLogger(__name__)

_GATHER_LIMIT = 1 << 19
"""Most elements an all_gather of buckets may collect on one rank (members x values; 4 MiB in
float64); larger buckets are all-reduced."""

_GATHER_MEMBERS = 16
"""Most members of a gathered round: what a rank receives grows with the members, what an
all_reduce moves does not, so past this many ranks the buckets are all-reduced (per-rank bytes
of a due step then stay flat as the axes grow)."""

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


class DeviceCheck(NamedTuple):
    """A condition on the step's inputs known only on the device (e.g. no token dropped over an
    expert's capacity): unless ``ok`` (a 0-d bool tensor) holds, the due metrics ``metrics``
    fail with ``reason``. Read with the step's other host reads, never alone (no
    synchronisation of its own on an accelerator)."""

    ok: torch.Tensor
    reason: str
    metrics: frozenset[str]


@dataclass(slots=True)
class _Due:
    metric: TensorMetric
    state: Mapping[SiteKey, Any]
    error: str | None = None
    round: Round = field(default_factory=lambda: Round(done=True))
    """The metric's current round: done (nothing to run) until ``start`` returns its first."""


@dataclass(slots=True)
class Pending:
    """A due step past its collectives, its values on their way to the host
    (:meth:`Executor.launch`); :meth:`Executor.collect` reads them and finishes the metrics."""

    items: list[_Due]
    live: list[_Due]
    failures: list[MetricFailure]
    checks: Sequence[DeviceCheck] | None
    """The step's device checks when some rank had one (their flags ride in the copy), else None."""
    keys: list[tuple[Hashable, int]]
    """The live metrics' outputs in the copy: (key, length), in order."""
    copy: HostCopy | None
    unfed: tuple[str, ...] = ()
    """The due metrics that read no tensor on any rank (no results, no failure)."""


class Executor:
    """Runs the collective rounds of all due metrics of a step over a :class:`Topology`.

    Args:
        topology: the named axes.
        collectives: how to talk to other ranks; default ``TorchCollectives(timeout_s)``, which
            bounds every collective so a hung peer raises instead of hanging.
        timeout_s: the bound in seconds for the default collectives.
        device: where packed buffers live: ``cpu`` for gloo, the rank's CUDA device for NCCL
            (which moves device tensors only); see ``backends.collective_device``.
        control: the world group for host-side agreements (CPU int64 tensors; a gloo group,
            ``backends.control_group``); None: the default group, which must carry CPU tensors.
    """

    def __init__(self, topology: Topology, *, collectives: Collectives | None = None,
                 timeout_s: float = 60.0, device: str | torch.device = "cpu", control: Any = None) -> None:
        self.topology = topology
        self.comm: Collectives = collectives or TorchCollectives(timeout_s)
        self.device = torch.device(device)
        self.control = control
        self.stats = CollectiveStats()
        self.unfed: tuple[str, ...] = ()
        """The due metrics of the step last collected (:meth:`collect`, :meth:`run`) that read no
        tensor on any rank."""
        self.flagged = False
        """Whether any rank passed ``flag=True`` to the last :meth:`launch` (or :meth:`run`)."""
        self.changed = False
        """Whether any rank passed ``changed=True`` to the last :meth:`launch`."""
        self._distributed = topology.world_size > 1

    # -- public -------------------------------------------------------------------------------
    def run(self, due: Sequence[tuple[TensorMetric, Mapping[SiteKey, Any], str | None]],
            sites: Mapping[SiteKey, Site], *, check: bool = False, unfed: Collection[str] = (),
            flag: bool | None = None, checks: Sequence[DeviceCheck] = ()
            ) -> tuple[dict[str, list[MetricResult]], list[MetricFailure]]:
        """Every due metric run to its results: :meth:`launch`, then :meth:`collect` at once
        (arguments, results and errors as there)."""
        return self.collect(self.launch(due, sites, check=check, unfed=unfed, flag=flag, checks=checks))

    def launch(self, due: Sequence[tuple[TensorMetric, Mapping[SiteKey, Any], str | None]],
               sites: Mapping[SiteKey, Site], *, check: bool = False, unfed: Collection[str] = (),
               flag: bool | None = None, checks: Sequence[DeviceCheck] = (), step: int | None = None,
               changed: bool = False) -> Pending:
        """Run every due metric through its collectives and start the copy of all their final
        vectors to the host (not waited for on an accelerator: see :class:`HostCopy`).

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
            checks: device conditions of this rank's inputs (:class:`DeviceCheck`; ranks may
                have different ones). A metric whose check failed on any rank fails on every
                rank with the first failed check's reason, which replaces any other error it
                had. Reduced over the world on the device after the rounds (only when some rank
                has checks, as the agreement tells) and read with the results' copy: no host
                read of their own. Such a metric still runs its rounds, and gives no results.
            step: the caller's step number, compared across ranks in the same collective (two
                more elements): ranks at different steps would combine different steps' values.
            changed: this rank's model changed its parameters since they were planned, OR-ed
                over every rank in that same collective (one more element) into :attr:`changed`.

        Returns:
            The :class:`Pending` step, for :meth:`collect` (every rank collects its launches in
            launch order; collecting may gather the reasons of failed checks across ranks).

        Raises:
            PlanMismatchError: on every rank, when ``check`` finds ranks with different plans.
            TMetricsError: on every rank, when ranks passed different ``step`` numbers.
        """
        items = [_Due(m, s, e) for m, s, e in due]
        self.unfed, self.flagged = (), bool(flag)
        for item in items:
            if item.error is None:
                try:
                    item.round = item.metric.start(item.state, sites, self.topology)
                except Exception as exc:  # noqa: BLE001 - a metric bug must not stop training
                    item.error = f"{type(exc).__name__}: {exc}"
        failures, checked = self._agree_failures(items, unfed, flag, bool(checks), step, changed)
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
                dropped, _ = self._agree_failures(pending)
            else:
                dropped = [MetricFailure(i.metric.name, (self.topology.global_rank,), i.error or "")
                           for i in pending if i.error]
            failures.extend(dropped)
            gone = {f.metric for f in dropped}
            live = [i for i in live if i.metric.name not in gone]
        outputs: dict[Hashable, torch.Tensor] = {}
        for item in live:
            outputs.update(item.round.outputs)
        vectors = [v if v.dtype == torch.float64 and v.dim() == 1 else v.reshape(-1).to(torch.float64)
                   for v in outputs.values()]
        if checked:
            extra = self._checked(items, checks)
            device = vectors[0].device if vectors else extra[0].device
            vectors += [v.to(device) for v in extra]
        return Pending(items, live, failures, checks if checked else None,
                       [(k, v.numel()) for k, v in zip(outputs, vectors)], HostCopy(vectors) if vectors else None,
                       self.unfed)

    def collect(self, pending: Pending, *, gather: bool = True
                ) -> tuple[dict[str, list[MetricResult]], list[MetricFailure]]:
        """The results of a :meth:`launch`: waits for its host copy (where the device has not
        passed it yet) and finishes every live metric. ``gather``: whether the reasons of failed
        device checks may be gathered across ranks (a collective: only where every rank collects
        at the same point, as at a due step's end); without, nothing is exchanged.

        Returns:
            ``(results by metric name, failures)``; failures name the metric, the ranks where
            it raised and the error text (of this rank, or of the lowest failing rank).
        """
        flat = pending.copy.read() if pending.copy is not None else []
        host: dict[Hashable, list[float]] = {}
        start = 0
        for key, length in pending.keys:
            host[key] = flat[start:start + length]
            start += length
        failures, live = pending.failures, pending.live
        if pending.checks is not None:
            failures = self._fail_checked(pending.items, failures, pending.checks, flat[start:], gather)
            gone = {f.metric for f in failures}
            live = [i for i in live if i.metric.name not in gone]
            # A metric no rank fed whose check failed is a failure only (as one that raised).
            pending.unfed = tuple(name for name in pending.unfed if name not in gone)
        self.unfed = pending.unfed
        out: dict[str, list[MetricResult]] = {}
        for item in live:
            try:
                out[item.metric.name] = item.metric.finish(item.round.continuation, host)
            except Exception as exc:  # noqa: BLE001 - local only: no collective follows
                failures.append(MetricFailure(item.metric.name, (self.topology.global_rank,),
                                              f"{type(exc).__name__}: {exc}"))
        return out, failures

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (one ``all_reduce(MAX)`` of one
        element over the world)."""
        return self.any_ranks([flag])[0]

    def any_ranks(self, flags: Sequence[bool]) -> list[bool]:
        """``flags`` OR-ed over every rank, element by element (one ``all_reduce(MAX)`` on the
        host over the control group; the same length on every rank)."""
        if not self._distributed:
            return list(flags)
        return [bool(v) for v in self._world_max([int(f) for f in flags])]

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

    def gather_objects(self, obj: Any, group: Any = None, label: str = "world") -> list[Any]:
        """Every rank's picklable ``obj`` over ``group`` (None: the world, over the control
        group), in group-rank order, counted as one call on ``label``. Slow paths (errors, plan
        changes) and start-up only."""
        if not self._distributed:
            return [obj]
        self.stats.add(label, 1)
        return self.comm.all_gather_object(obj, self.control if group is None else group)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName, axis: str) -> None:
        """Reduce ``tensor`` in place with ``op`` over the group of ``axis`` (nothing to do when
        the axis has one rank); one collective, counted on ``axis``."""
        self._all_reduce(tensor, op, self.topology.axes[axis].group, axis)

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
        the joint group cannot be built, the gathered table would exceed ``_GATHER_LIMIT``
        elements or the group ``_GATHER_MEMBERS`` ranks (then one ``all_reduce`` per bucket
        moves less data).

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
        small = total * members <= _GATHER_LIMIT and members <= _GATHER_MEMBERS
        group = self.topology.joint_group(union) if small else None
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

    def _world_max(self, flags: Sequence[int]) -> list[int]:
        """``flags`` (host ints, the same length on every rank) reduced with MAX over every rank:
        one small all_reduce of a CPU tensor over the control group."""
        tensor = torch.tensor(flags, dtype=torch.int64)
        self.stats.add("world", tensor.numel())
        self.comm.all_reduce(tensor, "max", self.control)
        return tensor.tolist()

    def _checked(self, items: Sequence[_Due], checks: Sequence[DeviceCheck]) -> list[torch.Tensor]:
        """``[failed per item, this rank's check flags]`` on the device, for the results' copy:
        an item fails where a check that names it is false (a flag is read as a bool: nonzero
        holds), MAX-reduced over the world (every rank issues it when any rank has checks; a
        rank without checks sends zeros), over the default group on the accelerator, over the
        control group where the collectives run on the CPU (a default group may carry no CPU
        tensor)."""
        names = [i.metric.name for i in items]
        # One process: where the checks are (no copy before the results'); else the collectives'.
        device = self.device if self._distributed or not checks else checks[0].ok.device
        oks = (torch.stack([c.ok.to(device=device, dtype=torch.bool).reshape(()) for c in checks]) if checks
               else torch.ones(0, dtype=torch.bool, device=device))
        reads = torch.tensor([[n in c.metrics for n in names] for c in checks],
                             dtype=torch.bool).reshape(len(checks), len(names))
        # Per item: world - rank where a check of this rank failed, else 0; under MAX, the lowest
        # failing rank (world - value), known without gathering anything.
        failed = (~oks[:, None] & reads.to(device, non_blocking=True)).any(0).to(torch.float64)
        failed *= self.topology.world_size - self.topology.global_rank
        if self._distributed:
            self.stats.add("world", failed.numel())
            self.comm.all_reduce(failed, "max", self.control if device.type == "cpu" else None)
        return [failed, oks.to(torch.float64)]

    def _fail_checked(self, items: Sequence[_Due], failures: list[MetricFailure],
                      checks: Sequence[DeviceCheck], read: Sequence[float], gather: bool) -> list[MetricFailure]:
        """``failures`` with the metrics whose check failed on some rank (``read``: the host copy
        of :meth:`_checked`). Each fails with the reason of the lowest rank whose check failed,
        which replaces an error it already failed with. With ``gather``, the reasons are
        gathered (every rank alike: they all read the same reduced values), naming every failing
        rank; without, nothing is exchanged (a step read where ranks need not be in step): the
        lowest failing rank is named, with this rank's reason where it is that rank, else
        a reference to it."""
        n = len(items)
        lowest = {i.metric.name: self.topology.world_size - int(v) for i, v in zip(items, read[:n]) if v}
        failed = list(lowest)
        if not failed:
            return failures
        mine = _failed_checks(checks, [bool(v) for v in read[n:]])
        if gather and self._distributed:
            everyone = self.gather_objects(mine)
        else:
            me = self.topology.global_rank
            everyone = [{} for _ in range(self.topology.world_size)]
            for name, rank in lowest.items():
                everyone[rank][name] = (mine[name] if rank == me and name in mine else
                                        f"a device check failed on rank {rank} (its reason is in that rank's "
                                        "failures)")
        ranks = {name: tuple(r for r, reasons in enumerate(everyone) if name in reasons) for name in failed}
        out = [MetricFailure(f.metric, tuple(sorted({*f.ranks, *ranks[f.metric]})),
                             everyone[ranks[f.metric][0]][f.metric]) if f.metric in ranks else f
               for f in failures]
        said = {f.metric for f in failures}
        out.extend(MetricFailure(name, ranks[name], everyone[ranks[name][0]][name]) for name in failed
                   if name not in said)
        return out

    # -- agreement and checks -------------------------------------------------------------------
    def _agree_failures(self, items: Sequence[_Due], unfed: Collection[str] = (), flag: bool | None = None,
                        checks: bool = False, step: int | None = None, changed: bool = False
                        ) -> tuple[list[MetricFailure], bool]:
        """Metrics that raised on any rank, in one ``all_reduce(MAX)`` on the host over the world
        of ``[raised per metric, fed per metric, step, -step, changed, flag, checks]``; with ``unfed``,
        also sets :attr:`unfed` to the metrics fed on no rank; with ``flag`` (not None, the
        first agreement of a run), sets :attr:`flagged`; sets :attr:`changed`. Returns the failures and whether any
        rank has ``checks`` (device checks, decided after the rounds). Only when some metric
        raised does a second collective gather the error texts, to name the failing ranks and
        the lowest one's error.

        Raises:
            TMetricsError: on every rank, when ranks passed different ``step`` numbers.
        """
        n = len(items)
        mine = [1 if i.error else 0 for i in items] + [0 if i.metric.name in unfed else 1 for i in items]
        mine += [step or 0, -(step or 0), 1 if changed else 0, 1 if flag else 0, 1 if checks else 0]
        agreed = self._world_max(mine) if self._distributed else mine
        self.changed = bool(agreed[-3])
        if agreed[-5] != -agreed[-4]:
            raise TMetricsError(
                f"ranks measured different step numbers in one due step (from {-agreed[-4]} to {agreed[-5]}): "
                "every rank must enter metrics.step(n) with the same n, the optimizer step's number; their values "
                "would be combined across steps. Count steps the same way on every rank (e.g. from the "
                "optimizer's or the trainer's global step)")
        if flag is not None:
            self.flagged = bool(agreed[-2])
        raised = agreed[:n]
        texts = self.gather_objects([i.error for i in items]) if any(raised) else None
        if unfed:
            self.unfed = tuple(item.metric.name for index, item in enumerate(items)
                               if not agreed[n + index] and not raised[index])
        failures = []
        for index, item in enumerate(items):
            if texts is None or not raised[index]:
                continue
            ranks = tuple(r for r, errors in enumerate(texts) if errors[index] is not None)
            error = texts[ranks[0]][index]
            failures.append(MetricFailure(item.metric.name, ranks, error or f"raised on rank(s) {list(ranks)}"))
        return failures, bool(agreed[-1])

    def _check_plan(self, requests: Sequence[CollectiveRequest], pending: Sequence[_Due]) -> None:
        """Compare this step's per-axis layouts with the other ranks of each axis: one
        ``all_reduce(MAX)`` of ``[fingerprint, -fingerprint]`` per axis (the max and the min
        fingerprint of the group), then one ``all_reduce(MAX)`` over the world of the mismatch
        flags so every rank raises together. Only on a mismatch are the layouts gathered, to name
        the metric, the axis and the ranks that differ."""
        if not self._distributed:
            return
        names = [a for a in self.topology.names if self.topology.axes[a].size > 1]
        owner: dict[Hashable, str] = {}
        for item in pending:
            for req in item.round.requests:
                owner.setdefault(req.key, item.metric.name)
        layouts = {a: _layout(requests, a, owner) for a in names}
        fps = {a: _fingerprint(layouts[a]) for a in names}
        mismatched = []
        for axis in names:
            spread = torch.tensor([fps[axis], -fps[axis]], dtype=torch.int64, device=self.device)
            self.all_reduce(spread, "max", axis)
            mismatched.append(int(spread[0].item() != -spread[1].item()))
        if not any(self._world_max(mismatched or [0])):
            return
        coords = {a: self.topology.axes[a].rank for a in names}
        table = self.gather_objects((coords, fps, layouts))
        for axis in names:
            groups: dict[tuple, list[int]] = {}
            for rank, (theirs, _, _) in enumerate(table):
                groups.setdefault(tuple(c for a, c in theirs.items() if a != axis), []).append(rank)
            for ranks in groups.values():
                ref = table[ranks[0]][1][axis]
                bad = tuple(r for r in ranks if table[r][1][axis] != ref)
                if bad:
                    self._raise_mismatch(axis, ranks[0], bad, table[ranks[0]][2][axis], table[bad[0]][2][axis])

    @staticmethod
    def _raise_mismatch(axis: str, ref_rank: int, bad: tuple[int, ...],
                        ref: list[Any], other: list[Any]) -> None:
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


def _failed_checks(checks: Sequence[DeviceCheck], passed: Sequence[bool]) -> dict[str, str]:
    """Metric name -> the reason of the first of ``checks`` that failed for it (``passed``: each
    check's flag, read on the host)."""
    reasons: dict[str, str] = {}
    for check, ok in zip(checks, passed):
        if not ok:
            for name in check.metrics:
                reasons.setdefault(name, check.reason)
    return reasons
