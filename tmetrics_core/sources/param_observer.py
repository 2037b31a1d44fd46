"""The parameter side of a step: parameters, gradients, Adam state and updates to metric states.

:class:`ParamObserver` is the parameter-side twin of
:class:`~tmetrics_core.sources.tokens.TokenObserver`. ``TensorMetrics`` owns the step scope and
the optimizer hooks and calls, per due step, :meth:`ParamObserver.begin`, then
:meth:`ParamObserver.prepare` with ``"pre"`` (gradients and parameters, in the optimizer's step
pre-hook or from ``observe_gradients()``) and ``"post"`` (Adam state and updates, in its
post-hook), :meth:`ParamObserver.take_snapshot` between them (the parameters before the
update, for update metrics), and at the step's end :meth:`ParamObserver.finish`, which hands
back each due metric's prepared state.

What depends only on the due set (which metrics run in which phase, the snapshot's names, the
:class:`~tmetrics_core.sources.param_program.ParamProgram`) is a :class:`DueSetPlan`, found once
per due set; what depends only on the manifest (its local tensors, their views, whether some
site is ``Partial`` or some parameter a DTensor) is a :class:`ManifestFacts`, found once at
construction. A due step looks both up and reads the tensors.

This module reaches below ``sources/`` into ``distributed/`` (Partial materialization, replica
verification, through the executor it is given) and ``metrics/`` (the metrics it prepares).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Sequence, cast

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.distributed.partials import resolve_partials
from tmetrics_core.distributed.replicas import replica_claims, verify_replicas
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.preparation import SiteChoices, prepare_states
from tmetrics_core.naming.manifest import Manifest, dtensor_placements
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.flat import FLAT_KINDS, FlatBuffer, FlatSource
from tmetrics_core.sources.optimizer_state import state_keys, state_value
from tmetrics_core.sources.param_program import ParamProgram
from tmetrics_core.sources.params import OPTIMIZER_KINDS, PARAM_KINDS, STATE_KINDS, grad_of, local_view, read_kind
from tmetrics_core.sources.snapshot import Snapshot, snapshot
from tmetrics_core.sources.tokens import TOKEN_KINDS
from tmetrics_core.topology import Topology

__all__ = ["DueSetPlan", "ManifestFacts", "ParamObserver", "Prepared"]

Prepared = tuple[Mapping[SiteKey, Any], str | None]
"""A due metric's local state and its error text (None when it prepared without one)."""


@dataclass(frozen=True, slots=True)
class ManifestFacts:
    """What the parameter side reads off the manifest once (neither its entries nor its local
    tensors change after construction).

    Attributes:
        local: the local parameter of every manifest entry, in manifest order (None where held
            elsewhere).
        views: per entry, how its tensor is read from its parameter (an expert slice of a
            stacked tensor: ``Manifest.views``) or None (the whole tensor).
        partial_params: some ``param`` or ``update`` site is ``Partial`` on an axis (such
            parameters are materialized after reading, so their local moments are of one part).
        dtensor_params: some local parameter is a DTensor (its gradient may be placed otherwise).
    """

    local: tuple[torch.Tensor | None, ...]
    views: tuple[Any, ...]
    partial_params: bool
    dtensor_params: bool


@dataclass(frozen=True, slots=True)
class DueSetPlan:
    """What one due set (the names of the due metrics) fixes for the parameter side.

    Attributes:
        pre: the due metrics of parameters and gradients only, prepared before the update
            (less those of ``from_snapshot``).
        post: the due metrics reading Adam state or updates, prepared after the update.
        from_snapshot: the due metrics of parameters alone whose every tensor is in the
            update snapshot: prepared after the step on the snapshot (the parameters as they
            were before it), so no pass over the parameters runs before the step.
        snapshot_names: canonical names of the parameters the due update metrics read, in the
            order the snapshot copies them: the program's parameters first, in the order it
            reads them (so it reads the snapshot as one block), then the others in manifest
            order.
        program: the due set's :class:`ParamProgram` (it prepares the metrics it plans, the
            general path the others), or None where the general path prepares every metric.
    """

    pre: tuple[TensorMetric, ...]
    post: tuple[TensorMetric, ...]
    from_snapshot: tuple[TensorMetric, ...]
    snapshot_names: tuple[str, ...]
    program: ParamProgram | None


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
        self.verify_replicas = verify_replicas
        self._on_verified = on_verified
        self._kind_sites = {kind: manifest.sites(kind) for kind in sorted(PARAM_KINDS | OPTIMIZER_KINDS)}
        read = {k for m in self.metrics for k in m.source_kinds} & STATE_KINDS - set(flat)
        self.state_keys = state_keys(optimizer, read, "optimizer state") if optimizer is not None and read else {}
        """State kind -> the keys of the step's optimizers that hold it (checked at start-up)."""
        self.facts = ManifestFacts(
            local=tuple(manifest.local.get(e.name) for e in manifest.entries),
            views=tuple(manifest.views.get(e.name) for e in manifest.entries),
            partial_params=any(s.partial for kind in ("update", "param") for s in self._kind_sites[kind]),
            dtensor_params=any(dtensor_placements(p) is not None for p in manifest.local.values()))
        self._choices = SiteChoices()
        self._plans: dict[tuple[str, ...], DueSetPlan] = {}
        self._plan: DueSetPlan | None = None
        """The current step's plan, once looked up (:meth:`plan` runs several times a step)."""
        self._verified_kinds: set[str] = set()
        self._verified_now: set[str] = set()
        """Kinds first verified by this step's ``pre`` read (verified again if the read is superseded)."""
        self._deferred: PlacementError | None = None
        """A Replica claim that failed on this step's latest ``pre`` read, raised by :meth:`settle`."""
        self.step: int | None = None
        self.due: tuple[TensorMetric, ...] = ()
        self.prepared: dict[str, Prepared] = {}
        """Due metric name -> its state and error, filled as the phases run."""
        self.sites: dict[SiteKey, Site] = {}
        """The sites the prepared states name (resolved Partial sites included)."""
        self.unfed: set[str] = set()
        """Due metrics that read no tensor here this step."""
        self.no_grad: set[str] = set()
        """Parameters held here without a gradient this step."""
        self._done: set[str] = set()
        self._failed: set[str] = set()
        """Post metrics failed by :meth:`fail_post` this step: the program leaves them failed."""
        self._before: MutableMapping[str, torch.Tensor] | None = None
        unknown = sorted(set(flat) - FLAT_KINDS)
        if unknown:
            raise ConfigError(f"flat buffers of kind {unknown}: a flat buffer holds one of {sorted(FLAT_KINDS)}")
        # Laid out here, so a buffer that does not fit the model fails at configuration time.
        self._flat_sources = {kind: FlatSource(buffers, manifest, topology.names) for kind, buffers in flat.items()}

    # -- the step ----------------------------------------------------------------------------
    def begin(self, step: int, due: Sequence[TensorMetric]) -> None:
        """Start due step ``step`` with the due metrics ``due`` (config order)."""
        self.step = step
        self.due = tuple(due)
        self.prepared, self.sites = {}, {}
        self.unfed, self.no_grad = set(), set()
        self._done, self._failed = set(), set()
        self._before = None
        self._plan = None
        self._verified_now, self._deferred = set(), None

    def end(self) -> None:
        """Release what the step held (the snapshot is a copy of the parameters)."""
        self.step, self.due, self._before, self.prepared, self.sites = None, (), None, {}, {}
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
            self._verified_kinds -= self._verified_now
            self._verified_now, self._deferred = set(), None

    def settle(self) -> None:
        """The ``pre`` read is final (the optimizer steps, or the step ends): raise a Replica
        claim its verification found false.

        Raises:
            PlacementError: on every rank, as :meth:`verify` found it.
        """
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred

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
            self._verify_phase(phase)
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
            plan = self._plans[key] = self._make_plan()
        self._plan = plan
        return plan

    def _make_plan(self) -> DueSetPlan:
        updates = [m for m in self.due if "update" in m.source_kinds]
        names = frozenset(s.name for s in self._kind_sites["update"] if any(m.accepts(s) for m in updates))
        later: set[str] = set()
        plain = "param" not in self.flat and "update" not in self.flat and not self.facts.partial_params
        for m in self.due if names and plain else ():
            read = {s.name for s in self._kind_sites["param"] if m.accepts(s)}
            if set(m.source_kinds) == {"param"} and read and read <= names:
                later.add(m.name)

        def in_phase(m: TensorMetric, phase: str) -> bool:
            kinds = set(m.source_kinds)
            if phase == "pre":
                return bool(kinds) and kinds <= PARAM_KINDS and m.name not in later
            return bool(kinds & OPTIMIZER_KINDS) and not kinds & TOKEN_KINDS

        pre = tuple(m for m in self.due if in_phase(m, "pre"))
        post = tuple(m for m in self.due if in_phase(m, "post"))
        before = tuple(m for m in self.due if m.name in later)
        try:
            program = self._plan_program(pre, post, before, names)
        except Exception:  # noqa: BLE001 - a metric's own code raised (e.g. kept): the
            program = None  # general path reports it per metric, on every rank
        first = program.names if program is not None else ()
        rest = frozenset(first)
        order = (*first, *(n for n in self.manifest.local if n in names and n not in rest))
        return DueSetPlan(pre, post, before, order, program)

    def _plan_program(self, pre: Sequence[TensorMetric], post: Sequence[TensorMetric],
                      before: Sequence[TensorMetric], names: frozenset[str]) -> ParamProgram | None:
        """The due set's :class:`ParamProgram`: only over parameters held here, plain or DTensor
        (no flat parameter buffer or Partial placement, whose sites and tensors the general path
        changes per step), with every parameter-side metric one the program prepares. A DTensor
        parameter is read as its local tensor; a step where some DTensor gradient is placed
        otherwise than its parameter takes the general path (see :meth:`_programmed`).
        Gradients and Adam state in flat buffers (ZeRO, Megatron's distributed optimizer) are
        read from them, with their FlatShard sites (not with DTensor parameters)."""
        if (set(self.flat) & {"param", "update"} or self.facts.partial_params
                or any(s.partial for s in self._kind_sites["grad"])
                or any(p is None for p in self.facts.local)
                or (self.flat and self.facts.dtensor_params)):
            return None
        return ParamProgram.plan(pre, post, before, self._sites_of, self._choices.of, names,
                                 len(self.manifest.entries))

    def _sites_of(self, kind: str) -> list[Site]:
        """The sites of ``kind``, one per manifest entry: a flat buffer's where one holds it."""
        return self._flat_sources[kind].sites if kind in self.flat else self._kind_sites[kind]

    def _flat_tensors(self, kind: str, entries: Sequence[int]) -> list[torch.Tensor | None]:
        """The local tensors of ``kind`` of manifest ``entries`` from its flat buffers, those no
        buffer holds read as ``read_kind`` reads them (a gradient or Adam state viewed as its
        entry reads it)."""
        source = self._flat_sources[kind]
        held = source.tensors()
        covered = source.covered
        if source.complete or all(covered[i] for i in entries):
            return [held[i] for i in entries]
        plain = read_kind(kind, self.manifest, self.optimizer, keys=self.state_keys)
        return [held[i] if covered[i] else plain[i] for i in entries]

    # -- replica verification ----------------------------------------------------------------
    def verify_startup(self) -> None:
        """Check the Replica claims of the parameters some configured metric reads (not with a
        flat parameter buffer, which holds no Replica).

        Raises:
            PlacementError: a parameter claimed Replica differs across its axis (every rank).
        """
        if self.verify_replicas == "never" or "param" in self.flat:
            return
        read = frozenset(s.name for m in self.metrics for kind in set(m.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS)
                         for s in self._kind_sites[kind] if m.accepts(s))
        self.verify(["param"], [s for s in self._kind_sites["param"] if s.name in read], "at start-up")

    def _verify_phase(self, phase: str) -> None:
        """Check the Replica claims of the sources the phase's due metrics read: at the first due
        step of each (``first``) or at every due step (``always``), all sources of the phase in
        one verification; flat buffers hold no Replica."""
        if self.verify_replicas not in ("first", "always"):
            return
        plan = self.plan()
        metrics = plan.pre if phase == "pre" else plan.post + plan.from_snapshot
        kinds = {k for m in metrics for k in m.source_kinds} & {"param", "grad", "exp_avg", "exp_avg_sq"}
        due = sorted(k for k in kinds - set(self.flat) if self.verify_replicas == "always" or k not in self._verified_kinds)
        sites: list[Site] = []
        absent: set[SiteKey] = set()
        for kind in due:
            sites += [s for s in self._kind_sites[kind] if any(m.accepts(s) for m in metrics if kind in m.source_kinds)]
            if kind == "grad":
                # A gradient placed otherwise than its parameter here (a DTensor Partial gradient)
                # is no replica; it is left out locally, so the claims are the same on every rank.
                absent = {g.key for g, s in zip(self._grad_sites(), self._kind_sites[kind]) if g != s}
        if not due:
            return
        if phase != "pre":
            self.verify(due, sites, f"at step {self.step}", absent)
            return
        self._verified_now.update(due)
        try:  # a read that a later observe_gradients() may supersede: raised when it is final (settle)
            self.verify(due, sites, f"at step {self.step}", absent)
        except PlacementError as exc:
            self._deferred = exc

    def verify(self, kinds: Sequence[str], sites: list[Site], when: str, absent: Any = ()) -> None:
        """Compare the local tensors of ``sites`` (of the source ``kinds``) claimed Replica across
        their axes (one packed collective per axis for all of them; see
        :mod:`tmetrics_core.distributed.replicas`), not reading the site keys in ``absent``, and
        record the claims that held in the manifest.

        Raises:
            PlacementError: a claim that does not hold, on every rank.
        """
        self._verified_kinds.update(kinds)
        origins = {e.name: dict(e.origins) for e in self.manifest.entries}
        claims = replica_claims(sites, self.topology, origins)
        if not claims:
            return
        wanted = {c.site.key for c in claims} - set(absent)
        tensors: dict[tuple[str, str], torch.Tensor | None] = {}
        for kind in kinds:
            tensors.update(((e.name, kind), t) for e, t in zip(self.manifest.entries,
                                                               read_kind(kind, self.manifest, self.optimizer,
                                                                         keys=self.state_keys))
                           if (e.name, kind) in wanted)
        checked = verify_replicas(claims, tensors, topology=self.topology, executor=self.executor, when=when)
        for kind in kinds:
            self.manifest.mark_verified(kind, [(name, axis) for name, k, axis in checked if k == kind])
        if list(kinds) != ["param"] and self._on_verified is not None:
            self._on_verified()

    # -- the phases --------------------------------------------------------------------------
    @torch.no_grad()  # metric arithmetic builds no graph (and skips autograd's dispatch work)
    def _run_phase(self, phase: str) -> None:
        """``pre``: metrics of parameters and gradients only; ``post``: metrics that read Adam
        state or updates (their parameters are the values after the step; updates are read as
        ``p - snapshot``, computed in place in the snapshot, which they consume), and first the metrics of ``DueSetPlan.from_snapshot``. A failure to read the
        tensors becomes every phase metric's error. The due set's program prepares the metrics
        it plans first; the general path the rest (all of them where the program did not run)."""
        self._programmed(phase)
        plan = self.plan()
        metrics = [m for m in (plan.pre if phase == "pre" else plan.post) if m.name not in self.prepared]
        before = [m for m in (plan.from_snapshot if phase == "post" else ()) if m.name not in self.prepared]
        if phase == "post" and self._before is None:
            for m in [m for m in metrics if "update" in m.source_kinds]:
                self.prepared[m.name] = ({}, "optimizer.step() did not run inside this step scope; no update")
                metrics.remove(m)
        if not metrics and not before:
            return
        memo: dict = {}
        # The snapshot as taken: read_kind("update") (in _read_phase) overwrites it with the
        # updates, after the metrics of `before` read it.
        snapshots = dict(self._before or {})
        failed = None
        if before:
            self._prepare_before(before, snapshots, {})
        if not metrics:
            return
        sites: list[Site] = []
        tensors: list[torch.Tensor | None] = []
        if failed is None:
            try:
                sites, tensors = self._read_phase(metrics)
            except Exception as exc:  # noqa: BLE001 - e.g. a parameter resized by the optimizer
                failed = f"reading the {phase}-step tensors failed: {type(exc).__name__}: {exc}"
        if failed is not None:
            # Reported and skipped on every rank by the executor's failure agreement; the
            # placeholders keep this rank's collectives (Partial gradients) the same as the others'.
            sites = [s for kind in sorted({k for m in metrics for k in m.source_kinds})
                     for s in (self._grad_sites() if kind == "grad" else self._kind_sites[kind])]
            tensors, memo = [None] * len(sites), {}
        self._prepare_from(metrics, sites, tensors, memo, failed)

    def _programmed(self, phase: str) -> None:
        """Prepare the phase's metrics the due set's :class:`ParamProgram` plans (the states the
        general path prepares, without its per-tensor work), on every device and dtype; nothing
        prepared or consumed where the general path must run them: no program for the due set,
        no optimizer step in the scope, a DTensor gradient placed otherwise than its parameter,
        or an error (which the general path then reports). A parameter without a gradient is
        left out of gradient statistics with a placeholder, as the general path does."""
        program = self.plan().program
        if program is None:
            return
        plan = program.pre if phase == "pre" else program.post
        if not plan.recipes:
            return  # the program plans no metric of this phase
        if phase == "post" and program.stepped and not isinstance(self._before, Snapshot):
            return  # no optimizer step in the scope: the general path reports it
        # A program is planned only where every manifest entry is held here (no None).
        params = cast("list[torch.Tensor]", list(self.facts.local))
        local = _local_tensors if self.facts.dtensor_params else None
        if phase == "pre":
            if local is not None and not _grads_placed_as_params(params):
                return  # a Partial gradient (sequence parallel): resolved by the general path
            grads = (lambda entries: self._flat_tensors("grad", entries)) if "grad" in self.flat else None
            try:
                states, absent = program.read_pre(params, self.facts.views, self.topology, local, grads)
            except Exception:  # noqa: BLE001 - the general path reads again and reports it
                states, absent = None, []
            if states is not None and absent:
                self.no_grad.update(self.manifest.entries[i].name for i in program.entries(absent))
                self.unfed.update(program.pre.unfed(frozenset(absent)))
        else:
            # The snapshot's copies are read, not changed, so the general path finds the snapshot
            # intact if the program raises.
            then: Sequence[torch.Tensor] = ()
            if isinstance(self._before, Snapshot):
                then = self._before.copies(program.names)
            try:
                states, absent = program.read_post(params, then, self.facts.views, local, self._state_tensors,
                                                   self.topology)
            except Exception:  # noqa: BLE001 - as above
                states, absent = None, []
            if states is not None and absent:
                self.unfed.update(program.post.unfed(frozenset(absent)))
        if states is None:
            return
        for metric, state in states:
            if metric.name not in self._failed:
                self.prepared[metric.name] = (state, None)
        self.sites.update(plan.sites)

    def _state_tensors(self, reads: Sequence[tuple[str, int]]) -> list[torch.Tensor | None]:
        """The local Adam state of each ``(kind, manifest entry)`` of ``reads`` (viewed as the
        entry reads it), None where the optimizer has none yet, as ``read_kind`` reads it.

        Raises:
            ValueError: an expert slice whose state is not shaped as its stored parameter.
        """
        flat: dict[str, dict[int, torch.Tensor | None]] = {}
        for kind in {k for k, _ in reads} & set(self.flat):  # ZeRO: a FlatShard of the entry
            entries = [e for k, e in reads if k == kind]
            flat[kind] = dict(zip(entries, self._flat_tensors(kind, entries)))
        out: list[torch.Tensor | None] = []
        states = self.optimizer.state if self.optimizer is not None else {}
        for kind, entry in reads:
            if kind in flat:
                out.append(flat[kind][entry])
                continue
            param = cast("torch.Tensor", self.facts.local[entry])  # a program's entries are held here
            value = local_view(state_value(states.get(param, {}), self.state_keys.get(kind, (kind,))))
            view = self.facts.views[entry]
            if value is not None and view is not None:
                if value.shape != local_view(param).shape:
                    raise ValueError(f"optimizer state {kind!r} of {self.manifest.entries[entry].name} has shape "
                                     f"{list(value.shape)}, not its stored parameter's: no expert slice of it")
                value = view(value)
            out.append(value)
        return out

    def _prepare_from(self, metrics: list[TensorMetric], sites: list[Site], tensors: list[torch.Tensor | None],
                      memo: dict, failed: str | None) -> None:
        """Prepare ``metrics`` on the local tensors of ``sites`` (Partial ones reduced first) and
        keep their states, with ``failed`` (a reading error) as every metric's error."""
        sites, tensors = resolve_partials(metrics, sites, tensors, self.topology, self.executor)
        for metric, picked in zip(metrics, self._choices.of(metrics, sites) if failed is None else ()):
            if all(tensors[i] is None for i in picked):
                self.unfed.add(metric.name)
        for metric, state, error in prepare_states(metrics, sites, tensors, self.topology, memo, self._choices):
            self.prepared[metric.name] = (state, failed or error)
        self.sites.update((s.key, s) for s in sites)

    def _prepare_before(self, metrics: list[TensorMetric], snapshots: dict[str, torch.Tensor], memo: dict) -> None:
        """Prepare the metrics of ``DueSetPlan.from_snapshot`` on the parameters as they were
        before the optimizer step: the snapshot's copies (exact); the parameters themselves when no step ran
        in the scope (then nothing changed them)."""
        try:
            params = read_kind("param", self.manifest, self.optimizer)
            tensors = [snapshots.get(e.name, p) if p is not None else None
                       for e, p in zip(self.manifest.entries, params)]
            failed = None
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            tensors, memo = [None] * len(self.manifest.entries), {}
            failed = f"reading the parameters failed: {type(exc).__name__}: {exc}"
        self._prepare_from(metrics, list(self._kind_sites["param"]), tensors, memo, failed)

    def _read_phase(self, metrics: list[TensorMetric]) -> tuple[list[Site], list[torch.Tensor | None]]:
        """Sites and local tensors of every kind the phase's metrics read (rank-symmetric sites)."""
        sites: list[Site] = []
        tensors: list[torch.Tensor | None] = []
        for kind in sorted({k for m in metrics for k in m.source_kinds}):
            if kind in self.flat:
                read = self._flat_tensors(kind, range(len(self.manifest.entries)))
                sites.extend(self._flat_sources[kind].sites)
            else:
                read = read_kind(kind, self.manifest, self.optimizer, self._before, self.state_keys)
                sites.extend(self._kind_sites[kind] if kind != "grad" else self._grad_sites())
            if kind == "grad":
                self.no_grad.update(e.name for e, t in zip(self.manifest.entries, read)
                                    if t is None and e.name in self.manifest.local)
            tensors.extend(read)
        return sites, tensors

    def _grad_sites(self) -> list[Site]:
        """Gradient sites with the gradient's own DTensor placements where they differ from the
        parameter's: a replicated weight fed by sequence-parallel activations has a
        ``Partial(sum)`` gradient, which is reduced before any norm is taken. Only the axes of
        the gradient's mesh whose placement came from DTensor change: a DTensor on a sub-mesh
        keeps its inferred or declared placements on the other axes (an expert ``Owned`` on
        ``ep``, a stage on ``pp``). Without DTensor parameters these are the manifest's sites."""
        if not self.facts.dtensor_params:
            return self._kind_sites["grad"]
        sites = []
        for site, entry in zip(self._kind_sites["grad"], self.manifest.entries):
            param = self.manifest.local.get(entry.name)
            held = grad_of(param) if param is not None else None
            grad = dtensor_placements(held) if held is not None else None
            if grad is not None and held is not None and entry.name in self.manifest.slices:
                # An expert slice: the gradient's placements as the slice sees them (Owned on
                # the expert axes, Partial kept); a gradient sharded otherwise raises here.
                grad = self.manifest.slice_placements(entry.name, held, self.topology)
            if grad is not None:
                merged = dict(site.placements)
                merged.update((a, p) for a, p in grad if entry.origin(a) == "dtensor")
                placements = tuple((a, merged[a]) for a in self.topology.names
                                   if a in merged and not merged[a].is_replica())
                if placements != site.placements:
                    site = dataclasses.replace(site, placements=placements)
            sites.append(site)
        return sites


def _local_tensors(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The local tensor of each (:func:`~tmetrics_core.sources.params.local_view`)."""
    return list(map(local_view, tensors))


def _grads_placed_as_params(params: Sequence[torch.Tensor]) -> bool:
    """Whether every gradient is placed as its parameter: a DTensor on the same mesh with the
    same placements for a DTensor parameter, a plain tensor for a plain one (then the manifest's
    gradient sites hold, as :meth:`ParamObserver._grad_sites` would find)."""
    from torch.distributed.tensor import DTensor

    for param, grad in zip(params, map(grad_of, params)):
        if grad is None:
            continue
        if isinstance(param, DTensor) and isinstance(grad, DTensor):
            # The specs' mesh and placements, compared by identity first (FSDP2 gives a
            # gradient its parameter's): the properties and the placements' equality are
            # Python calls per tensor and step.
            mine, theirs = grad._spec, param._spec
            if ((mine.mesh is not theirs.mesh and mine.mesh != theirs.mesh)
                    or (mine.placements is not theirs.placements and mine.placements != theirs.placements)):
                return False
        elif isinstance(param, DTensor) or isinstance(grad, DTensor):
            return False
    return True
