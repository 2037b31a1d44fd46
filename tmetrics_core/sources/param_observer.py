"""The parameter side of a step: parameters, gradients, Adam state and updates to metric states.

:class:`ParamObserver` is the parameter-side twin of
:class:`~tmetrics_core.sources.tokens.TokenObserver`. ``TensorMetrics`` owns the step scope and
the optimizer hooks and calls, per due step, :meth:`ParamObserver.begin`, then
:meth:`ParamObserver.prepare` with ``"pre"`` (gradients and parameters, in the optimizer's step
pre-hook or from ``observe_gradients()``) and ``"post"`` (Adam state and updates, in its
post-hook), :meth:`ParamObserver.take_snapshot` between them (the parameters before the
update, for update metrics), and at the step's end :meth:`ParamObserver.finish`, which hands
back each due metric's prepared state.

This module holds the step's life cycle and runs the due set's program
(:mod:`~tmetrics_core.sources.param_program`, the one path of every parameter-side metric). What
it reads from (:mod:`~tmetrics_core.sources.param_reads`), what a due set fixes
(:mod:`~tmetrics_core.sources.param_plan`) and the Replica checks
(:mod:`~tmetrics_core.sources.param_replicas`) live in their own modules.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.preparation import SiteChoices
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.sources.param_plan import DueSetPlan, due_set_plan
from tmetrics_core.sources.param_program import PhaseResult, Prepared
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.sources.param_replicas import ParamReplicas
from tmetrics_core.sources.snapshot import Snapshot, snapshot
from tmetrics_core.topology import Topology

__all__ = ["ParamObserver"]


class ParamObserver:
    """Prepares the due parameter-side metrics of each step (see the module docstring).

    Args:
        manifest: every tensor of the model, with its local tensor here.
        topology: named axes.
        executor: the collectives of Partial materialization and replica verification.
        optimizer: the unwrapped torch optimizer (Adam state), or None.
        flat: ZeRO-style flat buffers by source kind (they hold the kind instead of the
            parameters).
        metrics: every configured metric (replica verification reads the tensors some reads).
        verify_replicas: ``"startup"``, ``"first"``, ``"always"`` or ``"never"`` (see
            ``TensorMetrics``).
        on_verified: called after a verification past start-up marked claims in the manifest
            (``TensorMetrics`` rewrites the run's ``manifest.json``).

    Raises:
        ConfigError: a flat buffer of another kind than ``FLAT_KINDS``, or one that does not fit
            the model or the topology (:class:`~tmetrics_core.sources.flat.FlatSource`).
        PlacementError: from :meth:`verify_startup` and :meth:`prepare`, on every rank, when a
            tensor claimed Replica differs across its axis.
    """

    def __init__(self, manifest: Manifest, topology: Topology, executor: Executor, *, optimizer: Any,
                 flat: Mapping[str, Sequence[FlatBuffer]], metrics: Sequence[TensorMetric],
                 verify_replicas: str = "first", on_verified: Callable[[], None] | None = None) -> None:
        self.manifest = manifest
        self.topology = topology
        self.executor = executor
        self.optimizer = optimizer
        self.flat = flat
        self.metrics = tuple(metrics)
        self.reads = ParamReads(manifest, topology, optimizer=optimizer, flat=flat, metrics=self.metrics)
        self.replicas = ParamReplicas(self.reads, executor, self.metrics, verify_replicas, on_verified)
        self._choices = SiteChoices()
        self._plans: dict[tuple[str, ...], DueSetPlan] = {}
        self._plan: DueSetPlan | None = None
        """The current step's plan, once looked up (:meth:`plan` runs several times a step)."""
        self.step: int | None = None
        self.due: tuple[TensorMetric, ...] = ()
        self.states = PhaseResult()
        """This step's prepared states, their sites, the unfed metrics and the parameters
        without a gradient, filled as the phases run."""
        self._done: set[str] = set()
        self._failed: set[str] = set()
        """Post metrics failed by :meth:`fail_post` this step: the program leaves them failed."""
        self._before: Snapshot | None = None

    @property
    def prepared(self) -> dict[str, Prepared]:
        """Due metric name -> its state and error, filled as the phases run."""
        return self.states.prepared

    @property
    def sites(self) -> dict[SiteKey, Site]:
        """The sites the prepared states name (resolved Partial sites included)."""
        return self.states.sites

    @property
    def unfed(self) -> set[str]:
        """Due metrics that read no tensor here this step."""
        return self.states.unfed

    @property
    def no_grad(self) -> set[str]:
        """Parameters held here without a gradient this step."""
        return self.states.no_grad

    # -- the step ----------------------------------------------------------------------------
    def begin(self, step: int, due: Sequence[TensorMetric]) -> None:
        """Start due step ``step`` with the due metrics ``due`` (config order)."""
        self.step = step
        self.due = tuple(due)
        self.states = PhaseResult()
        self._done, self._failed = set(), set()
        self._before = None
        self._plan = None
        self.replicas.begin()

    def end(self) -> None:
        """Release what the step held (the snapshot is a copy of the parameters)."""
        self.step, self.due, self._before = None, (), None
        self.states = PhaseResult(unfed=self.unfed, no_grad=self.no_grad)
        self._plan = None

    def read_again(self) -> None:
        """Forget this step's ``pre`` phase when it ran and the optimizer step has not, so that
        the next :meth:`prepare` reads parameters and gradients again: a later
        ``observe_gradients()`` (after the next micro-batch's backward) supersedes an earlier one.
        Its Replica verification is superseded too: gradients read before the last micro-batch
        under DDP's ``no_sync()`` differ across ranks, and only the last read's claims count."""
        if "pre" in self._done and "post" not in self._done:
            for metric in self.plan().pre:
                self.prepared.pop(metric.name, None)
            self.unfed.clear()  # found by reads of this step, all in the pre phase so far
            self.no_grad.clear()
            self._done.discard("pre")
            self.replicas.supersede()

    def settle(self) -> None:
        """The ``pre`` read is final (the optimizer steps, or the step ends): raise a Replica
        claim its verification found false.

        Raises:
            PlacementError: on every rank, as the verification found it.
        """
        self.replicas.settle()

    def verify_startup(self) -> None:
        """Check the Replica claims of the parameters some configured metric reads
        (:meth:`ParamReplicas.startup`).

        Raises:
            PlacementError: a parameter claimed Replica differs across its axis (every rank).
        """
        self.replicas.startup()

    def fail_post(self, reason: str) -> None:
        """Fail this step's ``post`` metrics (updates, Adam state) with ``reason``: a second
        optimizer step in one scope changed what they read after they read it."""
        for metric in self.plan().post:
            self.prepared[metric.name] = ({}, reason)
            self._failed.add(metric.name)

    def done(self, phase: str) -> bool:
        """Whether ``phase`` was prepared this step."""
        return phase in self._done

    def prepare(self, phase: str) -> None:
        """Prepare the metrics of ``phase`` (``"pre"`` or ``"post"``, see :meth:`_run_phase`)
        once per step; later calls return at once. Checks the Replica claims of the phase's
        sources first (``verify_replicas`` ``"first"`` or ``"always"``).

        Raises:
            PlacementError: a tensor claimed Replica differs across its axis (every rank); for
                the ``pre`` phase, from :meth:`settle` (a later read may supersede this one).
        """
        if phase not in self._done:
            plan = self.plan()
            self.replicas.phase(phase, plan.pre if phase == "pre" else plan.post + plan.from_snapshot, self.step)
            self._run_phase(phase)
            self._done.add(phase)

    def take_snapshot(self) -> None:
        """Copy the parameters the due update metrics read (in the optimizer's pre-hook)."""
        names = self.plan().snapshot_names
        if names:
            self._before = snapshot(self.manifest, names)

    @torch.no_grad()
    def finish(self) -> dict[str, Prepared]:
        """Run the phases not run yet and return every prepared due metric's state and error.

        Raises:
            PlacementError: a Replica claim of the final ``pre`` read does not hold (every rank).
        """
        self.prepare("pre")
        self.settle()
        self.prepare("post")
        return self.prepared

    def plan(self) -> DueSetPlan:
        """The :class:`DueSetPlan` of the current due set, made on its first due step."""
        if self._plan is not None:
            return self._plan
        key = tuple(m.name for m in self.due)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = due_set_plan(self.due, self.reads, self._choices.of)
        self._plan = plan
        return plan

    # -- the phases --------------------------------------------------------------------------
    @torch.no_grad()  # metric arithmetic builds no graph (and skips autograd's dispatch work)
    def _run_phase(self, phase: str) -> None:
        """``pre``: metrics of parameters and gradients only; ``post``: metrics that read Adam
        state or updates (their parameters are the values after the step; updates are
        ``p - snapshot``) and those of ``DueSetPlan.from_snapshot`` (on the snapshot). Without an
        optimizer step in the scope, the update metrics are failed (there is no update)."""
        program = self.plan().program
        phase_program = program.pre_phase(self.reads) if phase == "pre" else program.post
        if not phase_program.metrics:
            return
        result = phase_program.run(self.reads, self._before, self.executor, self.topology, self._choices)
        for name, prepared in result.prepared.items():
            if name not in self._failed:
                self.prepared[name] = prepared
        if phase == "post" and self._before is None:
            for m in self.plan().post:
                if "update" in m.source_kinds and m.name not in self._failed:
                    self.prepared[m.name] = ({}, "optimizer.step() did not run inside this step scope; no update")
        self.sites.update(result.sites)
        self.unfed.update(n for n in result.unfed if n not in self.prepared or self.prepared[n][1] is None)
        self.no_grad.update(result.no_grad)
