"""``TensorMetrics``: sources, executor and sinks tied together behind ``with metrics.step(n)``.

Usage (DESIGN.md section 6)::

    metrics = tm.TensorMetrics.from_config("tmetrics.yaml", model=model, optimizer=optimizer,
                                          mesh=device_mesh)
    for step, batch in enumerate(loader, start=1):
        with metrics.step(step):
            loss = model(batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    metrics.close()

A metric is due at step ``n`` when ``n % interval == 0``, and at the first step of the run (so
every metric and its plan are checked at once). On steps where nothing is due, ``step()``
installs nothing and the optimizer hooks return at once. Parameters and gradients are read in
the optimizer's step pre-hook (before the update, gradients before ``zero_grad``; call
:meth:`observe_gradients` to read them earlier, e.g. before clipping), or, for
``optimizer.step(closure)``, when the closure has run; Adam state and updates
in its post-hook; activations while the forward runs. At the step's end the executor reduces
every due metric in one pass and the records go to the sinks (logging rank only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from fnmatch import fnmatchcase
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.distributed.manifest_exchange import share_holdings
from tmetrics_core.errors import ConfigError, PlacementError, TMetricsError
from tmetrics_core.metrics.preparation import SiteChoices, prepare_states
from tmetrics_core.distributed.partials import resolve_partials
from tmetrics_core.distributed.executor import Executor, MetricFailure
from tmetrics_core.distributed.replicas import replica_claims, verify_replicas
from tmetrics_core.hub.sink_hub import NullHub
from tmetrics_core.sinks.keys import KeyRules, check_collisions, index_widths
from tmetrics_core.naming.manifest import Manifest, dtensor_placements
from tmetrics_core.naming.nearest import nearest
from tmetrics_core.kernels import moments
from tmetrics_core.metrics.base import TensorMetric, reads_only_moments
from tmetrics_core.metrics.catalogue import catalogue_entries
from tmetrics_core.observe import _ACTIVE, fail, new_owner, record, record_residual
from tmetrics_core.placements import Placement
from tmetrics_core.sources.param_program import ParamProgram
from tmetrics_core.records import Labels, MetricRecord, RunInfo, RunStatus, status_on_exit
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.feeds import what_feeds
from tmetrics_core.sources.flat import FlatBuffer, read_buffers
from tmetrics_core.sources.optimizers import unwrap_optimizer
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.params import OPTIMIZER_KINDS, PARAM_KINDS, grad_of, read_kind, update_pairs
from tmetrics_core.sources.routers import ROUTER_OUTPUT_KINDS, find_routers, install as install_routers
from tmetrics_core.sources.snapshot import Snapshot, snapshot
from tmetrics_core.sources.tokens import TOKEN_KINDS, TokenObserver, TokenSites
from tmetrics_core.sources.token_plan import TokenPlan

__all__ = ["TensorMetrics"]

log = logging.getLogger("tmetrics")


class TensorMetrics:
    """Training-time tensor metrics of one model on one topology.

    Args:
        model: the (possibly wrapped, sharded) model.
        metrics: ``(metric, interval in steps)`` pairs in config order.
        optimizer: its step hooks read gradients, parameters, Adam state and updates. A
            framework's wrapper (accelerate, Lightning, Hugging Face Trainer, Megatron-Core,
            whose ChainedOptimizer steps several) is unwrapped to the torch optimizer(s) inside
            (:func:`~tmetrics_core.sources.optimizers.unwrap_optimizer`).
        topology: named axes; single process when omitted.
        hub: where records go (a ``SinkHub`` on the logging rank, a ``NullHub`` elsewhere);
            None keeps records only in :attr:`last_records`.
        run: what sinks are told at open (built by :meth:`from_config`).
        collectives: override the executor's collectives (tests use an in-process simulation).
        check_plan: ``"first"`` (when a metric first runs or the plan changes), ``"always"`` or
            ``"never"``.
        verify_replicas: when tensors placed ``Replica`` are compared across their axes
            (:mod:`tmetrics_core.distributed.replicas`): ``"startup"`` (parameters, here),
            ``"first"`` (start-up and the first due step of each gradient and Adam-state source),
            ``"always"`` (start-up and every due step) or ``"never"``. Only tensors some metric
            reads are checked.
        placements: config overrides, glob on canonical names -> ``{axis: placement}``.
        framework_placements: placements a framework integration knows, keyed by the original
            parameter name (as ``model.named_parameters()`` gives it) -> ``{axis: Placement}``;
            they rank below ``placements`` and above DTensor and inference (see
            :class:`~tmetrics_core.naming.manifest.Manifest`).
        layer_offset, expert_offset: first global layer / expert index held by this rank when
            the model's own names are local (pipeline stage, expert-parallel rank).
        timeout_s: bound on every collective, seconds.
        modules: metric name -> globs of module paths whose outputs an ``activation`` metric reads.
        flat_buffers: ZeRO-style flat shards that hold a source kind (grads, master weights, Adam
            state) instead of the parameters (see :class:`~tmetrics_core.sources.flat.FlatBuffer`);
            several of one kind (dense and expert buffers) are all read, each parameter from
            the one that lists it; parameters in none are read as usual.
        key_rules: sink name -> that sink's key rules, for every configured sink (on every rank,
            logging or not), so tensor names that render to one key are refused before the first step.
        log_rank: the global rank that prints tmetrics' warnings (config ``distributed.log_rank``).

    Raises:
        ConfigError: a ``select`` or ``modules`` pattern that matches nothing, a metric whose
            source kind the model or optimizer never produces, a placement a metric cannot
            handle (with the metric and tensor named; path ``metrics[i]``), two tensors whose
            labels render to one key of a sink (path ``sinks.<backend>``).
        PlacementError: on every rank, when a tensor placed Replica differs across its axis
            (here for parameters; from ``step()`` or the optimizer step for other sources).
    """

    def __init__(self, model: torch.nn.Module, *, metrics: Sequence[tuple[TensorMetric, int]],
                 optimizer: torch.optim.Optimizer | None = None, topology: Topology | None = None,
                 hub: Any = None, run: RunInfo | None = None, collectives: Collectives | None = None,
                 check_plan: str = "first", verify_replicas: str = "first",
                 placements: Mapping[str, Mapping[str, str]] | None = None,
                 framework_placements: Mapping[str, Mapping[str, Placement]] | None = None,
                 layer_offset: int = 0, expert_offset: int = 0, timeout_s: float = 60.0,
                 modules: Mapping[str, Sequence[str]] | None = None,
                 flat_buffers: Sequence[FlatBuffer] = (), key_rules: Mapping[str, KeyRules] | None = None,
                 log_rank: int = 0) -> None:
        self.model = model
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.topology = topology or Topology.single_process()
        self.logs = self.topology.logs(log_rank)
        self.metrics = list(metrics)
        self.hub = hub
        self.check_plan = check_plan
        self.executor = Executor(self.topology, collectives=collectives, timeout_s=timeout_s,
                                 device=_collective_device())
        self.manifest = Manifest.build(model, self.topology, overrides=placements,
                                       framework_placements=framework_placements,
                                       layer_offset=layer_offset, expert_offset=expert_offset,
                                       qkv_select=[g for m, _ in self.metrics for g in getattr(m, "select", ())],
                                       share=lambda mine: share_holdings(mine, self.executor))
        self.index = ModuleIndex(model, layer_offset=layer_offset)
        self.modules = {name: tuple(p) for name, p in (modules or {}).items()}
        self.flat: dict[str, list[FlatBuffer]] = {}
        for fb in flat_buffers:  # several of a kind: dense and expert buffers, per dtype or bucket
            self.flat.setdefault(fb.kind, []).append(fb)
        self.tokens = TokenPlan(self.topology)
        self.last_records: list[MetricRecord] = []
        self.failures: list[MetricFailure] = []
        self._checked: set[str] = set()
        self._warned: set[str] = set()
        self._unfed: set[str] = set()  # due metrics that read no tensor here this step
        self._no_grad: set[str] = set()  # parameters held here without a gradient this step
        self._no_grad_said = False
        self._step: int | None = None
        self._first_step: int | None = None
        self._last_due: int | None = None
        self._due: list[tuple[TensorMetric, int]] = []
        self._due_names: tuple[str, ...] = ()
        self._prepared: dict[str, tuple[dict[SiteKey, Any], str | None]] = {}
        self._phases_done: set[str] = set()
        self._before: MutableMapping[str, torch.Tensor] | None = None
        self._sites: dict[SiteKey, Site] = {}
        self._kind_sites: dict[str, list[Site]] = {}
        self._choices = SiteChoices()
        self._static: dict[Hashable, Any] = {}
        self._token_sites = TokenSites()  # token sites and their placement checks, kept across steps
        self.routers = find_routers(model, self.index)  # routers of the frameworks sources/routers.py knows
        self._num_experts = self.manifest.num_experts or max((r.num_experts for r in self.routers), default=0)
        self._closed = False
        self._closed_by_signal = False
        self._check_config(key_rules or {})
        self._verify_replicas = verify_replicas
        self._verified_kinds: set[str] = set()
        if verify_replicas != "never" and "param" not in self.flat:  # flat buffers hold no Replica
            self._verify(["param"], [s for s in self._sites_of("param") if s.name in self._read_by_metrics()],
                         "at start-up")
        self._owner = new_owner()  # this object's observer takes its own hooks' calls, another's does not
        self._hooks = self._observation_hooks()
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._hooks.append(self.optimizer.register_step_post_hook(self._post_step))
        if hub is not None and run is not None:
            run = dataclasses.replace(
                run, manifest=tuple(self.manifest.rows()),
                num_layers=self.manifest.num_layers, num_experts=self.manifest.num_experts)
            if not isinstance(hub, NullHub):
                _write_manifest(run)
            hub.open(run)
            hub.log_config(run.config)
        self.run = run
        self._install_signal_handler()

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, source: Any, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    mesh: Any = None, axes: Mapping[str, Any] | None = None, sinks: str | Sequence[str] | None = None,
                    run_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> "TensorMetrics":
        """Build from a config file path, a dict, or a loaded ``Config`` (see DESIGN.md §6).

        ``mesh`` (a DeviceMesh with dim names) or ``axes`` (``{name: process_group}``) give
        the topology; ``sinks`` (``"tensorboard,mlflow"`` or a list) overrides the config's sinks;
        ``run_dir`` overrides ``run.dir``. Raises ``ConfigError`` for every invalid input,
        before any step runs.
        """
        from tmetrics_core.build import build_from_config

        return build_from_config(cls, source, model=model, optimizer=optimizer, mesh=mesh, axes=axes,
                                 sinks=sinks, run_dir=run_dir, **kwargs)

    def _check_config(self, key_rules: Mapping[str, KeyRules]) -> None:
        components = {e.component for e in self.manifest.entries}
        adam = self.optimizer is not None and "betas" in getattr(self.optimizer, "defaults", {})
        seen: dict[str, int] = {}
        for index, (metric, _) in enumerate(self.metrics):
            if metric.name in seen:
                raise ConfigError(f"metric {metric.name!r} is listed twice (metrics[{seen[metric.name]}] and "
                                  f"metrics[{index}]); list it once with every pattern in one select or modules "
                                  "list, e.g. select: ['layers.0.*', 'layers.1.*']", path=f"metrics[{index}]")
            seen[metric.name] = index
        # A pipeline stage may lack the head, the blocks or the modules another stage has: what
        # the model has is agreed across ranks (one small gather), so every rank decides alike.
        present = self._present_anywhere()
        for index, (metric, _) in enumerate(self.metrics):
            path = f"metrics[{index}]"
            kinds = set(metric.source_kinds)
            param_sites = [s for kind in kinds & (PARAM_KINDS | OPTIMIZER_KINDS) for s in self.manifest.sites(kind)]
            if kinds & {"exp_avg", "exp_avg_sq"} - set(self.flat) and not adam:
                raise ConfigError(f"metric {metric.name!r} reads Adam state (exp_avg, exp_avg_sq) but the optimizer "
                                  f"is {type(self.optimizer).__name__}; pass an Adam/AdamW optimizer or drop it",
                                  path=path)
            if kinds & {"update"} and self.optimizer is None:
                raise ConfigError(f"metric {metric.name!r} measures optimizer updates; pass optimizer=",
                                  path=path)
            if kinds & {"router_logits", "router_topk", "router_scores"} and "moe.router" not in components:
                raise ConfigError(f"metric {metric.name!r} needs MoE router outputs, but the model has no router "
                                  "parameter (canonical component moe.router); drop it for a dense model",
                                  path=path)
            counts = {r.num_experts for r in self.routers}
            if kinds & ROUTER_OUTPUT_KINDS and counts and counts != {self._num_experts}:
                raise ConfigError(f"metric {metric.name!r}: the model's routers score {sorted(counts)} experts "
                                  f"each but its expert parameters number {self.manifest.num_experts} (global "
                                  "ids); pass expert_offset= on each expert-parallel rank, or shard the stacked "
                                  "expert tensors as DTensors", path=path)
            if kinds & {"residual_accumulator", "residual_contribution"} and not present["blocks"]:
                raise ConfigError(f"metric {metric.name!r} needs transformer blocks under one of layers, h, blocks, "
                                  "decoder.layers; none found in the model", path=path)
            if "logits" in kinds and not present["head"]:
                raise ConfigError(f"metric {metric.name!r} needs the output head (head, lm_head, output or "
                                  "output_layer as an nn.Linear); none found", path=path)
            patterns = self.modules.get(metric.name, ())
            if "activation" in kinds and patterns and not present["modules"].get(metric.name):
                near = nearest(patterns, [*self.index.canonical.values(), *(p for p, _ in self.index.named if p)])
                raise ConfigError(f"metric {metric.name!r}: modules {list(patterns)} match no module. modules: globs "
                                  "take canonical module names, the naming of select: less the leaf (layers.3.attn, "
                                  "layers.3.mlp, layers.3.moe; see `tmetrics names`), or the model's module paths; "
                                  f"nearest: {near!r}", path=path)
            chosen = [s for s in param_sites if metric.accepts(s)]
            if param_sites and not chosen:
                raise ConfigError(_nothing_chosen(metric, param_sites, self.manifest), path=path)
            for site in chosen:
                try:
                    metric.check(site, self.topology)
                except PlacementError as exc:
                    raise ConfigError(f"metric {metric.name!r} cannot handle {site.describe()}: {exc}",
                                      path=path) from exc
        self._check_keys(key_rules)

    def _present_anywhere(self) -> dict[str, Any]:
        """Whether any rank has blocks, a head, and modules matching each metric's globs."""
        blocks, head, *modules = self.executor.any_ranks(
            [bool(self.index.blocks), self.index.head is not None,
             *(bool(self.index.matching(p)) for p in self.modules.values())])
        return {"blocks": blocks, "head": head, "modules": dict(zip(self.modules, modules))}

    def _check_keys(self, key_rules: Mapping[str, KeyRules]) -> None:
        """Tensor and family labels come from the model's own names, which a backend may
        rewrite (``w+1`` and ``w_1`` are one TensorBoard tag): refuse such a pair now rather
        than fail every write of the run. Other labels are catalogue words and indices."""
        labels = set()
        for metric, _ in self.metrics:
            scope = getattr(metric, "scope", None)
            if scope not in ("tensor", "family"):
                continue
            for kind in set(metric.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS):
                for site in self.manifest.sites(kind):
                    if metric.accepts(site):
                        labels.add((metric.name, Labels(site.layer, site.expert, site.name) if scope == "tensor"
                                    else Labels(tensor=site.family or site.name)))
        layer_width, expert_width = index_widths(self.manifest.num_layers, self.manifest.num_experts)
        for sink, rules in key_rules.items():
            try:
                check_collisions(sorted(labels, key=repr), rules, layer_width=layer_width, expert_width=expert_width)
            except ConfigError as exc:
                raise ConfigError(str(exc).removeprefix(f"{exc.path}: "), path=f"sinks.{sink}") from None

    # -- the step scope -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["TensorMetrics"]:
        """Scope of training step ``step`` (an int, increasing). Metric errors are reported and
        skipped; the training loop's exceptions pass through.

        Raises:
            TMetricsError: on entering a step not larger than the last due one (one scope per
                optimizer step: micro-batches go in one scope), or the scope after :meth:`close`. After SIGTERM closed
                this object, steps still run (their records go nowhere), so a job that shuts
                down gracefully keeps the same collectives on every rank.
        """
        self._check_open(f"step({step})")
        if self._last_due is not None and step <= self._last_due:
            raise TMetricsError(
                f"metrics.step({step}) entered after step {self._last_due} was measured: step numbers must "
                "increase, and one optimizer step is one scope. Wrap all micro-batches of an optimizer step "
                "(every forward and backward, then optimizer.step()) in one `with metrics.step(n)`; "
                "gradients accumulate and are read once, before the update")
        if self._first_step is None:
            self._first_step = step
        self._step = step
        self._due = [(m, i) for m, i in self.metrics if step % i == 0 or step == self._first_step]
        self._due_names = tuple(m.name for m, _ in self._due)  # keys the facts found once per due set
        if self._due:
            self._last_due = step
        self._prepared = {}
        self._unfed, self._no_grad = set(), set()
        self._phases_done = set()
        self._sites = {}
        self._before = None
        token_metrics = [m for m, _ in self._due if set(m.source_kinds) & TOKEN_KINDS]
        observer = reset = None
        if token_metrics:
            observer = TokenObserver(token_metrics, self.topology, self.index, num_experts=self._num_experts,
                                     modules=self.modules, known=self._token_sites, owner=self._owner)
            reset = _ACTIVE.set(observer)
        failed = False
        try:
            yield self
        except BaseException:
            failed = True
            raise
        finally:
            if reset is not None:
                _ACTIVE.reset(reset)
            try:
                if not failed and self._due:
                    self._finish_step(step, observer)
            finally:
                # Nothing outlives the step: the update snapshot is a copy of the parameters.
                self._step, self._due, self._before, self._prepared, self._sites = None, [], None, {}, {}

    def _observation_hooks(self) -> list[Any]:
        """The forward hooks of every token source a configured metric reads, installed once and
        kept until :meth:`close`: on steps with no due metric of their kind they pass their
        tensors to ``tmetrics_core.observe``, which drops them; and a compiled model sees the
        same hooks on every step (a hook added or removed is a recompile)."""
        token_metrics = [m for m, _ in self.metrics if set(m.source_kinds) & TOKEN_KINDS]
        kinds = frozenset(k for m in token_metrics for k in m.source_kinds)
        patterns = tuple(p for m in token_metrics for p in self.modules.get(m.name, ()))
        mine = self._owner
        handles = self.index.install(functools.partial(record, owner=mine),
                                     functools.partial(record_residual, owner=mine),
                                     residual="residual_accumulator" in kinds,
                                     contribution="residual_contribution" in kinds, logits="logits" in kinds,
                                     patterns=patterns)
        if self.routers and kinds & ROUTER_OUTPUT_KINDS:
            handles += install_routers(self.routers, functools.partial(record, owner=mine),
                                       functools.partial(fail, owner=mine), kinds)
        return handles

    def observe_gradients(self) -> None:
        """Read gradients (and parameters) now, e.g. before clipping, instead of in the optimizer's
        pre-hook. Call between ``backward()`` and ``optimizer.step()`` inside ``step()``, or inside
        the closure of ``optimizer.step(closure)`` after its ``backward()``. Metrics
        of parameters alone still see them as the optimizer step does when an update metric is
        due: they are read from its snapshot (see :meth:`_from_snapshot`).

        Raises:
            TMetricsError: after :meth:`close`.
        """
        self._check_open("observe_gradients()")
        self._prepare_phase("pre")

    def _check_open(self, call: str) -> None:
        """Raise after :meth:`close`, unless SIGTERM closed this object: a job shutting down
        gracefully may finish its step, and its ranks must keep running the same collectives
        (the records then go nowhere; the hub warns once)."""
        if self._closed and not self._closed_by_signal:
            raise TMetricsError(
                f"TensorMetrics.{call} called after close(): its optimizer hooks are removed and its "
                "sinks have ended their runs. Call close() once, after the last step; to measure "
                "another run, create a new TensorMetrics (e.g. TensorMetrics.from_config(...))"
            )

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Read gradients and parameters, and snapshot what update metrics read. With a closure
        (``optimizer.step(closure)``: Lightning always passes one, LBFGS needs one), forward and
        backward run inside the step, after this hook: the closure is wrapped so gradients are
        read when it first returns (or where it calls :meth:`observe_gradients`)."""
        if self._step is None or not self._due:
            return None
        # torch passes the optimizer itself as args[0]: step(closure) has the closure at args[1].
        closure = kwargs.get("closure") if "closure" in kwargs else args[1] if len(args) > 1 else None
        changed = None
        if callable(closure) and "pre" not in self._phases_done:
            wrapped = self._after(closure)
            changed = ((args[0], wrapped, *args[2:]), kwargs) if "closure" not in kwargs else (
                args, {**kwargs, "closure": wrapped})
        else:
            self._prepare_phase("pre")
        names = self._snapshot_names()
        if names:  # only the tensors some update metric reads: the snapshot is their copy
            self._before = snapshot(self.manifest, names)
        return changed

    def _after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, then the pre phase (once per step: LBFGS calls the closure again at
        other points; its gradients are read at the parameters the step started from)."""
        def closure_then_read() -> Any:
            out = closure()
            if self._step is not None and self._due:
                self._prepare_phase("pre")
            return out
        return closure_then_read

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step is None or not self._due:
            return
        self._prepare_phase("post")

    def _prepare_phase(self, phase: str) -> None:
        """Prepare the metrics of ``phase`` (see :meth:`_run_phase`) once per step: the later
        calls (the optimizer hooks after ``observe_gradients()``, the step's end) return at once."""
        if phase not in self._phases_done:
            self._verify_phase(phase)
            self._run_phase(phase)
            self._phases_done.add(phase)

    # -- replica verification ---------------------------------------------------------------------
    def _read_by_metrics(self) -> frozenset[str]:
        """Canonical names some configured metric reads from a parameter-side source."""
        return frozenset(s.name for m, _ in self.metrics for kind in set(m.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS)
                         for s in self._sites_of(kind) if m.accepts(s))

    def _verify_phase(self, phase: str) -> None:
        """Check the Replica claims of the sources the phase's due metrics read: at the first due
        step of each (``first``) or at every due step (``always``), all sources of the phase in
        one verification; flat buffers hold no Replica."""
        if self._verify_replicas not in ("first", "always"):
            return
        in_phase, later = self._phase_metrics(phase)
        metrics = in_phase + later
        kinds = {k for m in metrics for k in m.source_kinds} & {"param", "grad", "exp_avg", "exp_avg_sq"}
        due = sorted(k for k in kinds - set(self.flat) if self._verify_replicas == "always" or k not in self._verified_kinds)
        sites, absent = [], set()
        for kind in due:
            sites += [s for s in self._sites_of(kind) if any(m.accepts(s) for m in metrics if kind in m.source_kinds)]
            if kind == "grad":
                # A gradient placed otherwise than its parameter here (a DTensor Partial gradient)
                # is no replica; it is left out locally, so the claims are the same on every rank.
                absent = {g.key for g, s in zip(self._grad_sites(), self._sites_of(kind)) if g != s}
        self._verify(due, sites, f"at step {self._step}", absent)

    def _verify(self, kinds: Sequence[str], sites: list[Site], when: str, absent: Any = ()) -> None:
        """Compare the local tensors of ``sites`` (of the source ``kinds``) claimed Replica across
        their axes (one packed collective per axis for all of them; see
        :mod:`tmetrics_core.distributed.replicas`), not reading the site keys in ``absent``, and
        record the claims that held in the manifest. Raises ``PlacementError`` on every rank."""
        self._verified_kinds.update(kinds)
        origins = {e.name: dict(e.origins) for e in self.manifest.entries}
        claims = replica_claims(sites, self.topology, origins)
        if not claims:
            return
        wanted = {c.site.key for c in claims} - set(absent)
        tensors: dict[tuple[str, str], torch.Tensor | None] = {}
        for kind in kinds:
            tensors.update(((e.name, kind), t) for e, t in zip(self.manifest.entries,
                                                               read_kind(kind, self.manifest, self.optimizer))
                           if (e.name, kind) in wanted)
        checked = verify_replicas(claims, tensors, topology=self.topology, executor=self.executor, when=when)
        for kind in kinds:
            self.manifest.mark_verified(kind, [(name, axis) for name, k, axis in checked if k == kind])
        if kinds != ["param"] and self.run is not None and self.hub is not None and not isinstance(self.hub, NullHub):
            _write_manifest(dataclasses.replace(self.run, manifest=tuple(self.manifest.rows())))

    @torch.no_grad()  # metric arithmetic builds no graph (and skips autograd's dispatch work)
    def _run_phase(self, phase: str) -> None:
        """``pre``: metrics of parameters and gradients only; ``post``: metrics that read Adam
        state or updates (their parameters are the values after the step; updates are read as
        ``p - snapshot`` by the fused kernel, or computed in place in the snapshot, which they
        consume), and first the metrics of :meth:`_from_snapshot`. A failure to read the
        tensors becomes every phase metric's error."""
        if self._programmed(phase):
            return
        in_phase, later = self._phase_metrics(phase)
        metrics = [m for m in in_phase if m.name not in self._prepared]
        before = [m for m in later if m.name not in self._prepared]
        if phase == "post" and self._before is None:
            for m in [m for m in metrics if "update" in m.source_kinds]:
                self._prepared[m.name] = ({}, "optimizer.step() did not run inside this step scope; no update")
                metrics.remove(m)
        if not metrics and not before:
            return
        memo: dict = {}
        before_memo: dict = {}
        # The snapshot as taken: the fused pass only reads it; read_kind("update") (in
        # _read_phase) overwrites it with the updates, after the metrics of `before` read it.
        snapshots = dict(self._before or {})
        pairs, failed = None, None
        if phase == "post":
            try:
                pairs = self._fused_updates(metrics, memo, before_memo)
            except Exception as exc:  # noqa: BLE001 - the kernel failed (the snapshot is intact)
                failed = f"reading the {phase}-step tensors failed: {type(exc).__name__}: {exc}"
        if before:
            self._prepare_before(before, snapshots, before_memo)
        if not metrics:
            return
        if failed is None:
            try:
                sites, tensors = self._read_phase(metrics, phase, pairs)
            except Exception as exc:  # noqa: BLE001 - e.g. a parameter resized by the optimizer
                failed = f"reading the {phase}-step tensors failed: {type(exc).__name__}: {exc}"
        if failed is not None:
            # Reported and skipped on every rank by the executor's failure agreement; the
            # placeholders keep this rank's collectives (Partial gradients) the same as the others'.
            sites = [s for kind in sorted({k for m in metrics for k in m.source_kinds})
                     for s in (self._grad_sites() if kind == "grad" else self._sites_of(kind))]
            tensors, memo = [None] * len(sites), {}
        self._prepare_from(metrics, sites, tensors, memo, failed)

    def _programmed(self, phase: str) -> bool:
        """Prepare the phase's metrics with the due set's :class:`ParamProgram` (the states the
        general path prepares, without its per-tensor work); False, with nothing prepared or
        consumed, where the general path must run: no program for the due set, the kernel
        switched off, no optimizer step in the scope, a tensor the kernel does not take, or any
        error (which the general path then reports)."""
        on = moments.available()
        key = ("program", self._due_names, on)
        if key not in self._static:
            try:
                self._static[key] = self._plan_program() if on else None
            except Exception:  # noqa: BLE001 - a metric's own code raised (e.g. kept): the
                self._static[key] = None  # general path reports it per metric, on every rank
        program = self._static[key]
        if program is None:
            return False
        plan = program.pre if phase == "pre" else program.post
        if not plan.recipes:
            return True  # no metric of this phase is due (the program plans every one that is)
        if phase == "post" and self._before is None:
            return False
        params = self._local_params()
        if phase == "pre":
            try:
                states = program.read_pre(params, self._local_views())
            except Exception:  # noqa: BLE001 - the general path reads again and reports it
                states = None
        else:
            # The snapshot's flat buffer, read by address: no copy is handed out or consumed, so
            # the general path finds the snapshot intact when the program does not apply.
            held = self._before.held(program.names) if isinstance(self._before, Snapshot) else None
            if held is None:
                return False
            try:
                states = program.read_post(params, held, self._local_views())
            except Exception:  # noqa: BLE001 - as above
                states = None
        if states is None:
            return False
        for metric, state in states:
            self._prepared[metric.name] = (state, None)
        self._sites.update(plan.sites)
        return True

    def _local_params(self) -> list[torch.Tensor]:
        """The local parameter of every manifest entry, in manifest order (a program's due set
        holds every one here, as plain tensors); found once (the manifest does not change)."""
        if "local params" not in self._static:
            self._static["local params"] = [self.manifest.local.get(e.name) for e in self.manifest.entries]
        return self._static["local params"]

    def _local_views(self) -> list[Any]:
        """Per manifest entry, how its tensor is read from its parameter's (an expert slice of a
        stacked tensor: ``Manifest.views``) or None (the whole tensor); found once."""
        if "local views" not in self._static:
            self._static["local views"] = [self.manifest.views.get(e.name) for e in self.manifest.entries]
        return self._static["local views"]

    def _plan_program(self) -> ParamProgram | None:
        """The due set's :class:`ParamProgram`: only over plain parameters held here (no flat
        buffer, Partial placement or DTensor, whose sites and tensors the general path changes
        per step), with every parameter-side metric one the program prepares."""
        if (set(self.flat) & (PARAM_KINDS | OPTIMIZER_KINDS) or self._known("partial params", self._partial_params)
                or self._dtensor_params() or any(s.partial for s in self._sites_of("grad"))
                or any(self.manifest.local.get(e.name) is None for e in self.manifest.entries)):
            return None
        pre, _ = self._phase_metrics("pre")
        post, before = self._phase_metrics("post")
        return ParamProgram.plan(pre, post, before, self._sites_of, self._choices.of, self._snapshot_names(),
                                 len(self.manifest.entries))

    def _phase_metrics(self, phase: str) -> tuple[tuple[TensorMetric, ...], tuple[TensorMetric, ...]]:
        """The due metrics of ``phase`` (see :meth:`_prepare_phase`) and, in the post phase,
        those of :meth:`_from_snapshot`; found once per due set."""
        key = ("phase", phase, self._due_names)
        if key not in self._static:
            later = self._from_snapshot()

            def in_phase(m: TensorMetric) -> bool:
                kinds = set(m.source_kinds)
                if phase == "pre":
                    return bool(kinds) and kinds <= PARAM_KINDS and m.name not in later
                return bool(kinds & OPTIMIZER_KINDS) and not kinds & TOKEN_KINDS

            self._static[key] = (tuple(m for m, _ in self._due if in_phase(m)),
                                 tuple(m for m, _ in self._due if m.name in later) if phase == "post" else ())
        return self._static[key]

    def _prepare_from(self, metrics: list[TensorMetric], sites: list[Site], tensors: list[torch.Tensor | None],
                      memo: dict, failed: str | None) -> None:
        """Prepare ``metrics`` on the local tensors of ``sites`` (Partial ones reduced first) and
        keep their states, with ``failed`` (a reading error) as every metric's error."""
        sites, tensors = resolve_partials(metrics, sites, tensors, self.topology, self.executor)
        for metric, picked in zip(metrics, self._choices.of(metrics, sites) if failed is None else ()):
            if all(tensors[i] is None for i in picked):
                self._unfed.add(metric.name)
        for metric, state, error in prepare_states(metrics, sites, tensors, self.topology, memo, self._choices):
            self._prepared[metric.name] = (state, failed or error)
        self._sites.update((s.key, s) for s in sites)

    def _prepare_before(self, metrics: list[TensorMetric], snapshots: dict[str, torch.Tensor], memo: dict) -> None:
        """Prepare the metrics of :meth:`_from_snapshot` on the parameters as they were before
        the optimizer step: the snapshot's copies (exact), whose moments rows ``memo`` holds when
        the fused update pass read them; the parameters themselves when no step ran in the scope
        (then nothing changed them)."""
        try:
            params = read_kind("param", self.manifest, self.optimizer)
            tensors = [snapshots.get(e.name, p) if p is not None else None
                       for e, p in zip(self.manifest.entries, params)]
            failed = None
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            tensors, memo = [None] * len(self.manifest.entries), {}
            failed = f"reading the parameters failed: {type(exc).__name__}: {exc}"
        self._prepare_from(metrics, list(self._sites_of("param")), tensors, memo, failed)

    def _snapshot_names(self) -> frozenset[str]:
        """Names of the parameters this due step's update metrics read (their snapshot), found
        once per due set."""
        key = ("snapshot", self._due_names)
        if key not in self._static:
            updates = [m for m, _ in self._due if "update" in m.source_kinds]
            self._static[key] = frozenset(s.name for s in self._sites_of("update")
                                          if any(m.accepts(s) for m in updates))
        return self._static[key]

    def _from_snapshot(self) -> frozenset[str]:
        """Names of the due metrics that read parameters only, every one of them in the update
        snapshot. They are prepared after the optimizer step on the snapshot (the parameters
        before the update, exactly): the fused update pass yields the snapshot's moments rows
        with no read of its own, so no pass over the parameters runs before the step. Not with
        flat-buffer or Partial parameters (read and reduced as they are). Found once per due set.
        """
        key = ("from snapshot", self._due_names)
        if key not in self._static:
            names = self._snapshot_names()
            plain = "param" not in self.flat and "update" not in self.flat and not self._known(
                "partial params", self._partial_params)
            found = set()
            for m, _ in self._due if names and plain else ():
                read = {s.name for s in self._sites_of("param") if m.accepts(s)}
                if set(m.source_kinds) == {"param"} and read and read <= names:
                    found.add(m.name)
            self._static[key] = frozenset(found)
        return self._static[key]

    def _partial_params(self) -> bool:
        return any(s.partial for kind in ("update", "param") for s in self._sites_of(kind))

    def _read_phase(self, metrics: list[TensorMetric], phase: str,
                    pairs: list[tuple[torch.Tensor, torch.Tensor] | None] | None
                    ) -> tuple[list[Site], list[torch.Tensor | None]]:
        """Sites and local tensors of every kind the phase's metrics read (rank-symmetric sites);
        ``pairs``: the fused updates of :meth:`_fused_updates` (their moments in the memo)."""
        sites: list[Site] = []
        tensors: list[torch.Tensor | None] = []
        for kind in sorted({k for m in metrics for k in m.source_kinds}):
            if kind == "update" and pairs is not None:
                # The snapshots stand in for the updates: every statistic of them comes from
                # the moments rows in the memo (kernel of p - prev, nothing written).
                sites.extend(self._sites_of(kind))
                tensors.extend(pair[1] if pair is not None else None for pair in pairs)
                continue
            if kind in self.flat:
                flat_sites, flat_tensors, covers = read_buffers(self.flat[kind], self.manifest, self.topology.names)
                plain = read_kind(kind, self.manifest, self.optimizer, self._before)
                read = [t if covered else p for t, p, covered in zip(flat_tensors, plain, covers)]
                sites.extend(flat_sites)
            else:
                read = read_kind(kind, self.manifest, self.optimizer, self._before)
                sites.extend(self._sites_of(kind) if kind != "grad" else self._grad_sites())
            if kind == "grad":
                self._no_grad.update(e.name for e, t in zip(self.manifest.entries, read)
                                     if t is None and e.name in self.manifest.local)
            tensors.extend(read)
        return sites, tensors

    def _fused_updates(self, metrics: list[TensorMetric], memo: dict, before: dict
                       ) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """``(parameter now, snapshot)`` per manifest entry, their moments put in ``memo`` (and
        the snapshots' in ``before``), when every metric reading updates derives all its
        statistics from fused moments and the kernel takes every pair, so the update need not
        be written (``p - prev`` is read by the kernel); else None (and ``read_kind`` computes
        the updates in place)."""
        readers = [m for m in metrics if "update" in m.source_kinds]
        if not readers or "update" in self.flat or self._before is None:
            return None
        # Partial parameters are materialized after reading (resolve_partials): their local
        # moments would be of one part.
        if self._known("partial params", self._partial_params):
            return None
        if not all(reads_only_moments(m) for m in readers):
            return None
        pairs = update_pairs(self.manifest, self._before)
        try:
            self._remember_updates(pairs, memo, before)
        except ValueError:  # a tensor the kernel does not take (checked before it reads anything)
            # Put the snapshots back for read_kind; nothing was consumed.
            self._before = {e.name: pair[1] for e, pair in zip(self.manifest.entries, pairs) if pair is not None}
            return None
        return pairs

    def _remember_updates(self, pairs: list[tuple[torch.Tensor, torch.Tensor] | None], memo: dict,
                          before: dict) -> None:
        """Moments of every update, of its parameter after the step (into ``memo``) and before
        it (the snapshot, into ``before``), from one kernel pass over each pair.

        Raises:
            ValueError: a tensor the kernel does not take, or a snapshot whose dtype or size
                differs from its parameter's (before anything is read).
        """
        keys, tensors, minus = [], [], []
        params = {s.name: s.key for s in self._sites_of("param")} if "param" not in self.flat else {}
        for site, pair in zip(self._sites_of("update"), pairs):
            if pair is None:
                continue
            keys.append((site.key, params.get(site.name)))
            tensors.append(pair[0])
            minus.append(pair[1])
        block = moments.parts(tensors, minus).flatten(0, 1)
        after_rows, before_rows = moments.rows_of(memo), moments.rows_of(before)
        for i, (update, param) in enumerate(keys):
            after_rows[update] = (block, 3 * i)
            if param is not None:
                after_rows[param] = (block, 3 * i + 1)
                before_rows[param] = (block, 3 * i + 2)

    def _grad_sites(self) -> list[Site]:
        """Gradient sites with the gradient's own DTensor placements where they differ from the
        parameter's: a replicated weight fed by sequence-parallel activations has a
        ``Partial(sum)`` gradient, which is reduced before any norm is taken. Only the axes of
        the gradient's mesh whose placement came from DTensor change: a DTensor on a sub-mesh
        keeps its inferred or declared placements on the other axes (an expert ``Owned`` on
        ``ep``, a stage on ``pp``). Without DTensor parameters these are the manifest's sites."""
        if not self._dtensor_params():
            return self._sites_of("grad")
        sites = []
        for site, entry in zip(self._sites_of("grad"), self.manifest.entries):
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

    def _dtensor_params(self) -> bool:
        """Whether some local parameter is a DTensor (its gradient may be placed otherwise)."""
        return self._known("dtensor params", lambda: any(dtensor_placements(p) is not None
                                                         for p in self.manifest.local.values()))

    def _known(self, fact: str, find: Callable[[], bool]) -> bool:
        """A fact about the manifest's tensors and sites, found once (neither changes)."""
        if fact not in self._static:
            self._static[fact] = find()
        return self._static[fact]

    def _sites_of(self, kind: str) -> list[Site]:
        """The manifest's sites of ``kind``, built once (the manifest does not change)."""
        if kind not in self._kind_sites:
            self._kind_sites[kind] = self.manifest.sites(kind)
        return self._kind_sites[kind]

    # -- the step's end -----------------------------------------------------------------------
    @torch.no_grad()
    def _finish_step(self, step: int, observer: TokenObserver | None) -> None:
        self._prepare_phase("pre")
        self._prepare_phase("post")
        sites: dict[SiteKey, Site] = dict(self._sites)
        changed = False
        if observer is not None:
            observer.finish()
            changed = self.tokens.sync(observer, self.executor)
            sites.update(self.tokens.sites)
        due = []
        for metric, _ in self._due:
            if observer is not None and set(metric.source_kinds) & TOKEN_KINDS:
                state, error = self.tokens.state_for(metric, observer)
                if not len(observer.states.get(metric.name, {})):
                    self._unfed.add(metric.name)
            else:
                state, error = self._prepared.get(metric.name, ({}, None))
            due.append((metric, state, error))
        check = self.check_plan == "always" or (
            self.check_plan == "first" and (changed or any(m.name not in self._checked for m, _, _ in due)))
        say = not self._no_grad_said and any("grad" in m.source_kinds for m, _ in self._due)
        results, failures = self.executor.run(due, sites, check=check, unfed=self._unfed,
                                              flag=bool(self._no_grad) if say else None)
        if say:
            self._say_missing_gradients(step)
        self._checked.update(m.name for m, _, _ in due)
        records = [
            MetricRecord(metric=name, step=step, value=r.value, labels=r.labels)
            for name, rs in results.items() for r in rs
        ]
        self.last_records = records
        self.failures.extend(failures)
        for failure in failures:
            if failure.metric not in self._warned and self.logs:
                self._warned.add(failure.metric)
                log.warning("tmetrics: metric %r skipped at step %d on every rank (raised on ranks %s): %s. "
                            "Further failures of this metric are counted silently.", failure.metric, step,
                            list(failure.ranks), failure.error)
        for name in self.executor.unfed:
            if ("unfed", name) not in self._static and self.topology.global_rank == 0:
                self._static[("unfed", name)] = True
                metric = next(m for m, _ in self._due if m.name == name)
                log.warning("tmetrics: metric %r found nothing to measure on any rank at step %d and wrote no record: "
                            "%s. Said once; later steps without anything to measure write no record either.", name,
                            step, what_feeds(metric.source_kinds, self.modules.get(name, ())))
        if self.hub is not None and records:
            self.hub.submit(records, step)

    def _say_missing_gradients(self, step: int) -> None:
        """At the first due step that reads gradients, warn once (logging rank) which parameters
        had none on some rank: they are left out of gradient statistics, not counted as zeros.
        Whether any rank lacked one rode on the executor's agreement (``flagged``); only then
        one gather of the names, on every rank alike."""
        self._no_grad_said = True
        if not self.executor.flagged:
            return
        everyone = self.executor.gather_objects(sorted(self._no_grad))
        if self.topology.global_rank != 0 or not any(everyone):
            return
        missing = sorted({name for names in everyone for name in names})
        ranks = [r for r, names in enumerate(everyone) if names]
        log.warning("tmetrics: at step %d, %d parameter(s) had no gradient (.grad and .main_grad None) on rank(s) %s "
                    "and are left out of gradient statistics (not counted as zeros): %s%s", step, len(missing), ranks,
                    missing[:20], " ..." if len(missing) > 20 else "")

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, status: RunStatus = "finished") -> Any:
        """Remove hooks, flush every sink and end the tracker runs with ``status``; returns the
        hub's report (counts written, retried, spooled, dropped per sink). Idempotent."""
        if self._closed:
            return None
        self._closed = True
        for h in self._hooks:
            h.remove()
        return self.hub.close(status) if self.hub is not None else None

    def __enter__(self) -> "TensorMetrics":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status_on_exit(exc_type))

    def _install_signal_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            self._closed_by_signal = not self._closed
            self.close("killed")
            signal.signal(signal.SIGTERM, previous if previous not in (None, signal.SIG_IGN) else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)


def _nothing_chosen(metric: TensorMetric, sites: Sequence[Site], manifest: Manifest) -> str:
    """Why ``metric`` has no tensor: its select matches none, or it can use none of those it
    matches (their placements or shapes), with what the catalogue says it supports."""
    select = tuple(getattr(metric, "select", ()))
    matched = [s for s in sites if not select or any(fnmatchcase(s.name, p) for p in select)]
    if not matched:
        framework = next(((p, e) for p in select for e in manifest.entries if fnmatchcase(e.original, p)), None)
        hint = (f"; {framework[0]!r} matches the framework's name {framework[1].original!r}, whose canonical name "
                f"is {framework[1].name!r}" if framework is not None else "")
        return (f"metric {metric.name!r}: select {list(select)} matches no tensor. select: globs take canonical "
                f"tensor names (see `tmetrics names`), e.g. {[e.name for e in manifest.entries[:3]]}; nearest: "
                f"{nearest(select, (s.name for s in sites), prefixes=True)!r}" + hint)
    scope = getattr(metric, "scope", None)
    if scope in ("layer", "expert") and not any(s.layer is not None for s in matched):
        return (f"metric {metric.name!r} is per {scope}, but no tensor got a layer index: tmetrics finds "
                "layers in block paths such as layers.3. or model.layers.3. (see `tmetrics names --factory "
                f"module:function` for how yours are named, e.g. {[e.name for e in manifest.entries[:3]]}); "
                "use a global- or tensor- metric, or keep the blocks in a ModuleList named layers")
    supported = {e.name: e.placements for e in catalogue_entries()}.get(metric.name)
    where = f"its select {list(select)} matches" if select else "the model has"
    return (f"metric {metric.name!r} can use none of the {len(matched)} tensors {where}, e.g. "
            f"{matched[0].describe()}" + (f"; it supports: {supported}" if supported else "") +
            "; change the placements or select, or drop the metric")


def _collective_device() -> torch.device:
    """Where metric collectives run: the current CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _write_manifest(run: RunInfo) -> None:
    """``<run dir>/manifest.json``: the manifest rows, for people and for ``tmetrics names``."""
    path = Path(run.dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps(list(run.manifest), indent=1))
