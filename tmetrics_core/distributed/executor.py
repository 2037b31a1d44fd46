"""The executor: one pass over every due metric, collectives packed per (axis, op, dtype).

Every metric collective goes through here (and, below it, the three calls of
``tmetrics_core.distributed.collectives``); counts live here (one choke point, as pluggy's
``_hookexec``). The failure agreement (:mod:`tmetrics_core.distributed.agreement`) and the plan
check (:mod:`tmetrics_core.distributed.plan_check`) decide; their collectives are this one's.

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

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.agreement import Agreement, DeviceCheck, MetricFailure
from tmetrics_core.distributed.collectives import Collectives, TorchCollectives
from tmetrics_core.distributed.host_copy import HostCopy
from tmetrics_core.distributed.plan_check import check_plan
from tmetrics_core.distributed.rounds import CollectiveStats, Rounds
from tmetrics_core.metrics.base import CollectiveRequest, MetricResult, Round, TensorMetric
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey

__all__ = ["Executor", "Pending"]

log = logging.getLogger(__name__)

_REDUCE_OF: dict[str, ReduceOpName] = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}
"""The reduction that materializes a ``Partial`` op (``avg``: a sum, divided after)."""

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
        self.rounds = Rounds(topology, self.comm, self.device, self.stats)
        self.unfed: tuple[str, ...] = ()
        """The due metrics of the step last collected (:meth:`collect`, :meth:`run`) that read no
        tensor on any rank."""
        self.flagged = False
        """Whether any rank passed ``flag=True`` to the last :meth:`launch` (or :meth:`run`)."""
        self.changed = False
        """Whether any rank passed ``changed=True`` to the last :meth:`launch`."""
        self._distributed = topology.world_size > 1
        self.agreement = Agreement(topology, world_max=self._world_max, gather_objects=self.gather_objects,
                                   reduce_device=self._reduce_device)

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
        failures, checked = self._agree(items, unfed=unfed, flag=flag, checks=bool(checks), step=step,
                                        changed=changed)
        failed = {f.metric for f in failures} | set(self.unfed)
        live = [i for i in items if i.metric.name not in failed]
        first = True
        while True:
            pending = [i for i in live if not i.round.done]
            if not pending:
                break
            requests = self._dedup(pending)
            if check and first:
                owner: dict[Hashable, str] = {}
                for item in pending:
                    for req in item.round.requests:
                        owner.setdefault(req.key, item.metric.name)
                check_plan(self.topology, requests, owner, device=self.device,
                           all_reduce=lambda t, axis: self.all_reduce(t, "max", axis),
                           world_max=self._world_max, gather_objects=self.gather_objects)
            first = False
            results = self.rounds.reduce(requests)
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
                dropped, _ = self._agree(pending)
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
            extra = self.agreement.device_flags([i.metric.name for i in items], checks, self.device)
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
            failures = self.agreement.fail_checked([i.metric.name for i in pending.items], failures, pending.checks,
                                                   flat[start:], gather)
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
        self.rounds.all_reduce(tensor, op, self.topology.axes[axis].group, axis)

    def materialize(self, tensors: Sequence[torch.Tensor], axes: Sequence[tuple[str, ...]],
                    ops: Sequence[str]) -> list[torch.Tensor]:
        """Reduce whole local tensors of ``Partial`` placements (``ops[i]`` over ``axes[i]``),
        packed like any round; returns the full tensors in the input shapes."""
        requests = [CollectiveRequest(("materialize", i), a, _REDUCE_OF[op],
                                      t.detach().reshape(-1).to(torch.float64))
                    for i, (t, a, op) in enumerate(zip(tensors, axes, ops))]
        results = self.rounds.reduce(requests)
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

    def _world_max(self, flags: Sequence[int]) -> list[int]:
        """``flags`` (host ints, the same length on every rank) reduced with MAX over every rank:
        one small all_reduce of a CPU tensor over the control group."""
        tensor = torch.tensor(flags, dtype=torch.int64)
        self.stats.add("world", tensor.numel())
        self.comm.all_reduce(tensor, "max", self.control)
        return tensor.tolist()

    # -- the agreement's collectives ------------------------------------------------------------
    def _agree(self, items: Sequence[_Due], **agreement: Any) -> tuple[list[MetricFailure], bool]:
        """The failure agreement over ``items`` (:meth:`Agreement.agree`, keyword arguments as
        there): sets :attr:`changed`, :attr:`unfed` and :attr:`flagged` where they were asked (an
        agreement after a round asks none, so it keeps the step's); returns the failures and
        whether any rank has device checks."""
        agreed = self.agreement.agree([i.metric.name for i in items], [i.error for i in items], **agreement)
        if agreed.changed is not None:
            self.changed = agreed.changed
        if agreed.unfed is not None:
            self.unfed = agreed.unfed
        if agreed.flagged is not None:
            self.flagged = agreed.flagged
        return agreed.failures, agreed.checks

    def _reduce_device(self, tensor: torch.Tensor) -> None:
        """MAX-reduce ``tensor`` in place over the world: over the control group where it is on
        the CPU (a default group may carry no CPU tensor), over the default group on an
        accelerator."""
        self.stats.add("world", tensor.numel())
        self.comm.all_reduce(tensor, "max", self.control if tensor.device.type == "cpu" else None)

