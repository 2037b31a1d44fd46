"""``TensorMetrics``: sources, executor and sinks tied together behind ``with metrics.step(n)``.

Usage (the README's "Use it in your training loop")::

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
import json
import logging
import numbers
import os
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch

from tmetrics_core.build import check_against_model
from tmetrics_core.config.schema import READ_RESULTS, ReadResults
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.backends import collective_device, control_group
from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.distributed.manifest_exchange import share_holdings
from tmetrics_core.errors import ConfigError, TMetricsError
from tmetrics_core.distributed.executor import Executor, MetricFailure, Pending
from tmetrics_core.hub.exits import on_sigterm
from tmetrics_core.hub.sink_hub import NullHub
from tmetrics_core.sinks.keys import KeyRules
from tmetrics_core.naming.manifest import Manifest
from tmetrics_core.naming.signature import parameter_signature
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.observe import _ACTIVE, fail, fail_unless, in_backward, new_owner, record, record_attention, record_residual, tap
from tmetrics_core.placements import Placement
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus, status_on_exit
from tmetrics_core.user_scalars import scalar_records
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.attention import install_inner_attention
from tmetrics_core.sources.feeds import what_feeds
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.sources.grad_scaler import ScalerWatch
from tmetrics_core.sources.optimizer_state import torch_optimizers
from tmetrics_core.sources.optimizers import unwrap_optimizer
from tmetrics_core.sources.adapters import AdapterWatch
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.padding import install_padding
from tmetrics_core.sources.pipelining import quiet_shape_inference
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.sources.params import OPTIMIZER_KINDS, PARAM_KINDS
from tmetrics_core.sources.routers import ROUTER_OUTPUT_KINDS, find_routers, install as install_routers
from tmetrics_core.sources.cotangents import GRAD_KINDS, CotangentScale, data_parallel_divisor, grad_scaler_scale
from tmetrics_core.sources.tokens import TOKEN_KINDS, TokenObserver, TokenSites
from tmetrics_core.sources.token_plan import TokenPlan

__all__ = ["TensorMetrics"]

log = logging.getLogger("tmetrics")

_PARAM_SIDE = PARAM_KINDS | OPTIMIZER_KINDS

_CHANGED = ("the model's parameters changed since tmetrics planned them (a parameter added, removed or replaced, "
            "e.g. a layer appended or an embedding resized; a requires_grad or dtype changed): this step was read "
            "with the old plan and is left out; every rank re-plans at the next due step, whose records cover the "
            "model as it is then")


class TensorMetrics:
    """Training-time tensor metrics of one model on one topology.

    Args:
        model: the (possibly wrapped, sharded) model.
        metrics: ``(metric, interval in steps)`` pairs in config order.
        optimizer: its step hooks read gradients, parameters, Adam state and updates. A
            framework's wrapper (accelerate, Lightning, Hugging Face Trainer, Megatron-Core,
            whose ChainedOptimizer steps several) is unwrapped to the torch optimizer(s) inside
            (:func:`~tmetrics_core.sources.optimizers.unwrap_optimizer`). Several optimizers of
            one model (Muon for matrices, AdamW for the rest) go in as a list, stepped in any
            order within the step scope: each parameter's update is its own optimizer's.
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
        read_results: when a due step's results are read from the device (config
            ``run.read_results``): ``"now"``, at the step's end (the step waits for its
            accelerator once, at the end); ``"next-step"``, at the end of the next step scope (or
            at :meth:`close`), when the copy has landed: no wait in any step. Records keep their
            own step; :attr:`last_records` then holds the previous due step's.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any
            (:class:`~tmetrics_core.sources.grad_scaler.ScalerWatch`): gradients are then read
            unscaled whether or not you call ``scaler.unscale_``, and a step the scaler skips
            (inf or NaN gradients) writes its gradient records (``layer-grad-nonfinite`` counts
            among them) and no update or optimizer-state record, with a warning that names the
            skip. Without it, such a step's gradients are read after ``zero_grad()``. Cotangent
            metrics (``*-grad-*``) divide by its scale (and by the data-parallel averaging), so
            they read the cotangents of the loss the optimizer applies
            (:mod:`~tmetrics_core.sources.cotangents`).
        grad_divisor: what the gradients are divided by after backward, besides the data-parallel
            averaging: a ``torch.distributed.pipelining`` schedule with ``scale_grads=True`` (its
            default) divides by its number of micro-batches; cotangent metrics divide by it too.
        optional_metrics: names of metrics skipped, with one INFO line, where the model has no
            source for them (config ``optional: true``); others are refused with a ConfigError.

    Raises:
        ConfigError: a ``select`` or ``modules`` pattern that matches nothing, a metric whose
            source kind the model or optimizer never produces, a placement a metric cannot
            handle (with the metric and tensor named; path ``metrics[i]``), two tensors whose
            labels render to one key of a sink (path ``sinks.<backend>``), a ``read_results``
            other than ``"now"`` and ``"next-step"`` (path ``run.read_results``), a
            ``grad_scaler`` without an optimizer or with a fused optimizer (path ``grad_scaler``).
        PlacementError: on every rank, when a tensor placed Replica differs across its axis
            (here for parameters; from ``step()`` or the optimizer step for other sources).
    """

    def __init__(self, model: torch.nn.Module, *, metrics: Sequence[tuple[TensorMetric, int]],
                 optimizer: torch.optim.Optimizer | Sequence[Any] | None = None, topology: Topology | None = None,
                 hub: Any = None, run: RunInfo | None = None, collectives: Collectives | None = None,
                 check_plan: str = "first", verify_replicas: str = "first",
                 placements: Mapping[str, Mapping[str, str]] | None = None,
                 framework_placements: Mapping[str, Mapping[str, Placement]] | None = None,
                 layer_offset: int = 0, expert_offset: int = 0, timeout_s: float = 60.0,
                 modules: Mapping[str, Sequence[str]] | None = None,
                 flat_buffers: Sequence[FlatBuffer] = (), key_rules: Mapping[str, KeyRules] | None = None,
                 log_rank: int = 0, read_results: ReadResults = "now", grad_scaler: Any = None,
                 grad_divisor: int = 1, optional_metrics: Collection[str] = ()) -> None:
        if read_results not in READ_RESULTS:
            raise ConfigError(f"read_results={read_results!r}; need one of {', '.join(READ_RESULTS)}",
                              path="run.read_results")
        self.model = model
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.topology = topology or Topology.single_process()
        self.logs = self.topology.logs(log_rank)
        self.metrics = list(metrics)
        self.optional = frozenset(optional_metrics)
        self.hub = hub
        self.check_plan = check_plan
        self.executor = Executor(self.topology, collectives=collectives, timeout_s=timeout_s,
                                 device=collective_device(),
                                 control=control_group() if self.topology.world_size > 1 else None)
        self._manifest_options: dict[str, Any] = dict(
            overrides=placements, framework_placements=framework_placements, layer_offset=layer_offset,
            expert_offset=expert_offset, qkv_select=[g for m, _ in self.metrics for g in getattr(m, "select", ())])
        self.manifest = Manifest.build(model, self.topology, **self._manifest_options,
                                       share=lambda mine: share_holdings(mine, self.executor))
        self._signature = parameter_signature(model)
        self._replan_due = False
        """Some rank's parameters changed at the last due step: re-plan at the next one."""
        self._stale = False
        """The parameters had changed since they were planned when this step read them."""
        self.index = ModuleIndex(model, layer_offset=layer_offset)
        self._adapters = AdapterWatch(model)
        quiet_shape_inference()
        self.modules = {name: tuple(p) for name, p in (modules or {}).items()}
        defaults = {m.name: tuple(getattr(m, "modules", ())) for m, _ in self.metrics if "activation_grad" in m.source_kinds}
        self._token_modules = {**self.modules, **{n: g for n, g in defaults.items() if g and n not in self.modules}}
        """``modules`` with the default globs of cotangent metrics that were given none (a metric
        without globs reads only ``tm.observe(..., grad=True)`` sites)."""
        self.flat: dict[str, list[FlatBuffer]] = {}
        for fb in flat_buffers:  # several of a kind: dense and expert buffers, per dtype or bucket
            self.flat.setdefault(fb.kind, []).append(fb)
        self.tokens = TokenPlan(self.topology)
        if isinstance(grad_divisor, bool) or not isinstance(grad_divisor, int) or grad_divisor < 1:
            raise ConfigError(f"grad_divisor={grad_divisor!r}; need an int >= 1 (a pipeline schedule's number of "
                              "micro-batches when it scales the gradients, else 1)", path="grad_divisor")
        self._cotangent_divisor = data_parallel_divisor(self.topology) * grad_divisor
        self._loss_scale = grad_scaler_scale(grad_scaler) if grad_scaler is not None else None
        self.last_records: list[MetricRecord] = []
        self.failures: list[MetricFailure] = []
        self._checked: set[str] = set()
        self._warned: set[str] = set()
        self._unfed: set[str] = set()  # due token metrics that read no tensor here this step
        self._said_unfed: set[str] = set()  # metrics warned about once for finding nothing
        self._no_grad_said = False
        self._skip_said = False
        self._step: int | None = None
        self._first_step: int | None = None
        self._last_entered: int | None = None  # the step of the latest scope, for log()
        self._last_due: int | None = None
        self._due: list[tuple[TensorMetric, int]] = []
        self._due_names: tuple[str, ...] = ()
        self._token_sites = TokenSites(  # token sites and their placement checks, kept across steps
            configured=frozenset(k for m, _ in self.metrics for k in m.source_kinds))
        self.routers = find_routers(model, self.index)  # routers of the frameworks sources/routers.py knows
        self._num_experts = self.manifest.num_experts or max((r.num_experts for r in self.routers), default=0)
        self._closed = False
        self._report: Any = None
        """What the first completed :meth:`close` returned (the hub's report)."""
        self._closed_by_signal = False
        self._interrupted = False
        self._close_at_step_end: RunStatus | None = None
        """The status of the first :meth:`close` called inside an open step scope, run at the scope's end."""
        self._in_scope = False
        """Whether a step scope's body is running (its end will run a deferred :meth:`close`)."""
        self.read_results = read_results
        self._in_flight: tuple[int, Pending] | None = None  # a due step launched, read a step later
        self._optimizer_count = len(getattr(self.optimizer, "optimizers", (self.optimizer,)))
        self._stepping: set[int] = set()
        """The optimizers (ids) whose step began in this scope."""
        self._stepped: set[int] = set()
        """The optimizers (ids) whose step ended in this scope."""
        check_against_model(self, key_rules or {})
        self._verify_replicas = verify_replicas
        self.params = self._param_observer()
        self.params.verify_startup()
        self._scaler: ScalerWatch | None = None
        self._read_after_unscale = False
        """observe_gradients() was called while the loss scaler's gradients were scaled."""
        if grad_scaler is not None:
            if self.optimizer is None:
                raise ConfigError("grad_scaler= needs optimizer= (the optimizer the scaler steps)", path="grad_scaler")
            self._scaler = ScalerWatch(grad_scaler, torch_optimizers(self.optimizer),
                                       due=lambda: self._step is not None and bool(self._due),
                                       on_unscaled=self._read_unscaled, on_stepped=self._after_scaler_step)
        self._owner = new_owner()  # this object's observer takes its own hooks' calls, another's does not
        self._observed = self._observation_hooks()
        self._hooks: list[Any] = []
        if self._scaler is not None:
            self._hooks.append(self._scaler)
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
    def from_config(cls, source: Any, *, model: torch.nn.Module, optimizer: Any = None,
                    mesh: Any = None, axes: Mapping[str, Any] | None = None, sinks: str | Sequence[str] | None = None,
                    run_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> "TensorMetrics":
        """Build from a config file path, a dict, or a loaded ``Config`` (the README's Config section).

        ``mesh`` (a DeviceMesh with dim names) or ``axes`` (``{name: process_group}``) give
        the topology; ``sinks`` (``"tensorboard,mlflow"`` or a list) overrides the config's sinks;
        ``run_dir`` overrides ``run.dir``; ``check_plan``, ``verify_replicas``, ``timeout_s``,
        ``log_rank`` and ``read_results`` override ``distributed.check_plan``,
        ``distributed.verify_replicas``, ``distributed.collective_timeout_s``,
        ``distributed.log_rank`` and ``run.read_results`` (the run's recorded config shows the
        values used). Other keyword arguments go to :class:`TensorMetrics` as they are, except
        those the config builds (``metrics``, ``topology``, ``hub``, ``run``, ``modules``,
        ``key_rules``, ``placements``). Raises ``ConfigError`` for every invalid input, before
        any step runs and before any sink starts.

        One run by default: a configured MLflow or W&B sink writes into the process's active run
        (``mlflow.active_run()``, ``wandb.run``) under ``tmetrics/``, and leaves it open.
        ``trackers`` (a ``SummaryWriter``, an MLflow or W&B run, Lightning loggers, accelerate
        trackers) adds a sink writing into each of those runs (a ``SummaryWriter``: into its
        directory); see :mod:`tmetrics_core.sinks.trackers`.
        """
        from tmetrics_core.build import build_from_config

        return build_from_config(cls, source, model=model, optimizer=optimizer, mesh=mesh, axes=axes,
                                 sinks=sinks, run_dir=run_dir, **kwargs)

    # -- the step scope -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["TensorMetrics"]:
        """Scope of training step ``step`` (an int, increasing). Metric errors are reported and
        skipped; the training loop's exceptions pass through.

        Raises:
            TypeError: ``step`` is not an int (a float, str or bool).
            TMetricsError: on entering a step not larger than the last due one (one scope per
                optimizer step: micro-batches go in one scope), a scope inside another, or the
                scope after :meth:`close`. After SIGTERM closed
                this object, steps still run (their records go nowhere), so a job that shuts
                down gracefully keeps the same collectives on every rank.
        """
        self._check_open(f"step({step})")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"metrics.step(step): step must be an int, the number of the optimizer step; got "
                            f"{step!r} ({type(step).__name__}). Pass e.g. int(trainer_state.global_step)")
        if self._in_scope:
            raise TMetricsError(
                f"metrics.step({step}) entered inside the scope of step {self._step}: step scopes do not nest. "
                "Use one `with metrics.step(n)` per optimizer step, around all of its micro-batches")
        if self._last_due is not None and step <= self._last_due:
            raise TMetricsError(
                f"metrics.step({step}) entered after step {self._last_due} was measured: step numbers must "
                "increase, and one optimizer step is one scope. Wrap all micro-batches of an optimizer step "
                "(every forward and backward, then optimizer.step()) in one `with metrics.step(n)`; "
                "gradients accumulate and are read once, before the update")
        if self._first_step is None:
            quiet_shape_inference()  # pipelining imported after construction: its first-step shape pass
        first = step if self._first_step is None else self._first_step
        due = [(m, i) for m, i in self.metrics if step % i == 0 or step == first]  # may raise: no state set yet
        self._first_step, self._step, self._due = first, step, due
        self._last_entered = step
        if self._due:
            self._last_due = step
            self._adapters.check(step, say=self.logs)
        self._unfed = set()
        if self._due and self._replan_due:
            self._replan(step)
        self._stepping, self._stepped = set(), set()
        self._stale = False
        self._read_after_unscale = False
        if self._scaler is not None:
            self._scaler.begin()
        self.params.begin(step, [m for m, _ in self._due])
        token_metrics = [m for m, _ in self._due if set(m.source_kinds) & TOKEN_KINDS]
        observer = reset = None
        if token_metrics:
            observer = TokenObserver(token_metrics, self.topology, self.index, num_experts=self._num_experts,
                                     modules=self._token_modules, known=self._token_sites, owner=self._owner,
                                     cotangent_scale=CotangentScale(self._cotangent_divisor, self._loss_scale))
            reset = _ACTIVE.set(observer)
        failed = interrupted = False
        try:
            self._in_scope = True
            if observer is not None and observer.kinds & GRAD_KINDS:
                with in_backward(self._owner, observer):
                    yield self
            else:
                yield self
        except BaseException as exc:
            failed, interrupted = True, isinstance(exc, KeyboardInterrupt)
            raise
        finally:
            if reset is not None:
                _ACTIVE.reset(reset)
            try:
                if not failed and self._due:
                    self._finish_step(step, observer)
                if not failed:
                    self._deliver_earlier(step)
            finally:
                # Nothing outlives the step: the update snapshot is a copy of the parameters.
                self._step, self._due = None, []
                self.params.end()
                self._in_scope = False
                if interrupted and not self._closed:
                    self._close_interrupted()
                elif self._close_at_step_end is not None:
                    self._close_deferred(failed)

    def log(self, values: Mapping[str, Any], *, step: int | None = None) -> None:
        """Send your own scalars (``{"loss": loss, "lr": lr}``) to every sink, beside the layer
        metrics: the loss and the per-layer norms then sit in one run of each tracker.

        Args:
            values: name -> a Python number or a one-element tensor (read in one host copy per
                call, see :mod:`tmetrics_core.user_scalars`); logged as given, not reduced
                across ranks (the logging rank's values; other ranks do nothing).
            step: the step; default the open step scope's, else the last scope entered.

        Raises:
            ConfigError: on the logging rank, a bad name or value, or a name the run's metrics
                use (path ``log``).
            TMetricsError: no step given before the first step scope, or after :meth:`close`.
        """
        self._check_open("log(...)")
        step = self._step if step is None else step
        if step is None:
            step = self._last_entered
        if step is None:
            raise TMetricsError("metrics.log(...) before the first step scope: pass step=")
        if self.hub is not None and not isinstance(self.hub, NullHub):  # no host copy on other ranks
            self.hub.submit(scalar_records(values, step, reserved={m.name for m, _ in self.metrics}), step)

    def _read_pre(self) -> None:
        """Read the parameters and gradients (the ``pre`` phase), noting whether the model's
        parameters had changed since they were planned: then this read used a stale plan."""
        self._stale = self._stale or parameter_signature(self.model) != self._signature
        self.params.prepare("pre")

    def _param_observer(self) -> ParamObserver:
        return ParamObserver(self.manifest, self.topology, self.executor, optimizer=self.optimizer, flat=self.flat,
                             metrics=[m for m, _ in self.metrics], verify_replicas=self._verify_replicas,
                             on_verified=self._rewrite_manifest)

    def _replan(self, step: int) -> None:
        """Plan the model again as it is now: its parameters changed after the last plan on some
        rank (:func:`~tmetrics_core.naming.signature.parameter_signature`), which the last due
        step's agreement told every rank, so every rank re-plans here, at the same due step,
        with the same collectives: the manifest shared again, the parameter side and the
        forward hooks made anew, Replica claims of the parameters checked, plans compared again."""
        self._replan_due = False
        before = len(self.manifest.entries)
        self.manifest = Manifest.build(self.model, self.topology, **self._manifest_options,
                                       share=lambda mine: share_holdings(mine, self.executor))
        self._signature = parameter_signature(self.model)
        self.index = ModuleIndex(self.model, layer_offset=self._manifest_options["layer_offset"])
        self.routers = find_routers(self.model, self.index)
        self._num_experts = self.manifest.num_experts or max((r.num_experts for r in self.routers), default=0)
        self.params = self._param_observer()
        self.params.verify_startup()
        for handle in self._observed:
            handle.remove()
        self._observed = self._observation_hooks()
        self._checked = set()
        self._rewrite_manifest()
        if self.logs:
            log.warning("tmetrics: the model's parameters changed after they were planned; re-planned at step %d: %d "
                        "tensors (were %d). Said at every re-plan", step, len(self.manifest.entries), before)

    def _observation_hooks(self) -> list[Any]:
        """The forward hooks of every token source a configured metric reads, installed once and
        kept until :meth:`close`: on steps with no due metric of their kind they pass their
        tensors to ``tmetrics_core.observe``, which drops them; and a compiled model sees the
        same hooks on every step (a hook added or removed is a recompile)."""
        token_metrics = [m for m, _ in self.metrics if set(m.source_kinds) & TOKEN_KINDS]
        kinds = frozenset(k for m in token_metrics for k in m.source_kinds)
        # A metric built without modules: (layer-activation-rms) hooks its documented defaults.
        patterns = tuple(p for m in token_metrics for p in self.modules.get(m.name, getattr(m, "modules", ())))
        mine = self._owner
        handles = self.index.install(functools.partial(record, owner=mine),
                                     functools.partial(record_residual, owner=mine),
                                     residual="residual_accumulator" in kinds,
                                     contribution="residual_contribution" in kinds, logits="logits" in kinds,
                                     patterns=patterns, tap=functools.partial(tap, owner=mine),
                                     grads=kinds & GRAD_KINDS,
                                     grad_patterns=tuple(p for m in token_metrics if "activation_grad" in m.source_kinds
                                                         for p in self._token_modules.get(m.name, ())))
        if token_metrics:
            handles += install_padding(self.model, functools.partial(record, owner=mine), say=self.logs)
        if self.routers and kinds & ROUTER_OUTPUT_KINDS:
            handles += install_routers(self.routers, functools.partial(record, owner=mine),
                                       functools.partial(fail, owner=mine), functools.partial(fail_unless, owner=mine),
                                       kinds)
        if "attn_qk" in kinds:
            # Hugging Face attention through its attention table (transformers imported lazily);
            # raises ConfigError for an implementation it cannot reach.
            from tmetrics_core.integrations.hf_attention import install as install_hf_attention

            handles += install_hf_attention(self.model, functools.partial(record_attention, owner=mine))
            tp = self.topology.axes.get("tp")
            handles += install_inner_attention(self.model, functools.partial(record_attention, owner=mine),
                                               heads_split=tp is not None and tp.size > 1)
        return handles

    def observe_gradients(self) -> None:
        """Read gradients (and parameters) now, e.g. before clipping, instead of in the optimizer's
        pre-hook. Call between ``backward()`` and ``optimizer.step()`` inside ``step()``, or inside
        the closure of ``optimizer.step(closure)`` after its ``backward()``. Called again before
        ``optimizer.step()`` (after each micro-batch's backward), it reads them again: the last
        call's values are the step's. Metrics of parameters alone still see them as the
        optimizer step does when an update metric is due: they are read from its snapshot (see
        :class:`~tmetrics_core.sources.param_observer.DueSetPlan`).

        Raises:
            TMetricsError: after :meth:`close`, or outside a step scope (nothing would be read).
        """
        self._check_open("observe_gradients()")
        if not self._in_scope:
            raise TMetricsError("observe_gradients() called outside a step scope: gradients are read for the step "
                                "whose `with metrics.step(n)` is open; call it inside, after backward()")
        self.params.read_again()
        if self._scaler is not None and self._scaler.scaling:
            self._read_after_unscale = True  # read by the next unscale_ (the user's or scaler.step's)
            return
        self._read_pre()

    def _read_unscaled(self) -> None:
        """The gradient read ``observe_gradients()`` asked for while they were scaled, now that
        every optimizer of the step has been unscaled."""
        if self._read_after_unscale:
            self._read_after_unscale = False
            self.params.read_again()
            self._read_pre()

    def _after_scaler_step(self, optimizer: Any) -> None:
        """After ``scaler.step(optimizer)`` on a due step: if the optimizer's step did not run,
        the scaler skipped it (inf or NaN gradients). The gradients are read now (unscaled, with
        their inf and NaN), and the update and state metrics of the step fail with the reason."""
        if id(optimizer) in self._stepping:
            return
        self._read_pre()
        reason = (f"GradScaler skipped {type(optimizer).__name__}.step() at step {self._step}: a gradient was inf or "
                  "NaN (layer-grad-nonfinite counts them); no update, the optimizer state unchanged")
        self.params.fail_post(reason)
        if self.logs:
            log.log(logging.INFO if self._skip_said else logging.WARNING, "tmetrics: %s%s", reason,
                    "" if self._skip_said else ". Said at WARNING once; later skips at INFO")
        self._skip_said = True

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
        if self.params.done("post") or id(optimizer) in self._stepping:
            self.params.fail_post(f"optimizer.step() ran again inside the scope of step {self._step}: the update and "
                                  "optimizer-state metrics read after the first one only. Use one `with "
                                  "metrics.step(n)` per optimizer step")
            return None
        first = not self._stepping
        self._stepping.add(id(optimizer))
        if not first:
            return None  # another optimizer of the chain: the gradients were read, the snapshot taken
        # torch passes the optimizer itself as args[0]: step(closure) has the closure at args[1].
        closure = kwargs.get("closure") if "closure" in kwargs else args[1] if len(args) > 1 else None
        changed = None
        if callable(closure) and not self.params.done("pre"):
            wrapped = self._after(closure)
            changed = ((args[0], wrapped, *args[2:]), kwargs) if "closure" not in kwargs else (
                args, {**kwargs, "closure": wrapped})
        else:
            self._read_pre()
            self.params.settle()  # the read the update uses: its Replica claims must hold
        self.params.take_snapshot()  # only the tensors some update metric reads
        return changed

    def _after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, then the pre phase (once per step: LBFGS calls the closure again at
        other points; its gradients are read at the parameters the step started from)."""
        def closure_then_read() -> Any:
            out = closure()
            if self._step is not None and self._due:
                self._read_pre()
                self.params.settle()
            return out
        return closure_then_read

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Read updates and state once every optimizer of the step has stepped (one, or each of
        an :class:`~tmetrics_core.sources.optimizers.OptimizerChain`); an optimizer of the chain
        that does not step in this scope leaves its parameters' updates 0, read at the step's end."""
        if self._step is None or not self._due:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == self._optimizer_count:
            self.params.prepare("post")

    def _rewrite_manifest(self) -> None:
        """``manifest.json`` again after a verification past start-up marked claims in it."""
        if self.run is not None and self.hub is not None and not isinstance(self.hub, NullHub):
            _write_manifest(dataclasses.replace(self.run, manifest=tuple(self.manifest.rows())))

    # -- the step's end -----------------------------------------------------------------------
    @torch.no_grad()
    def _finish_step(self, step: int, observer: TokenObserver | None) -> None:
        if not self.params.done("pre"):
            self._read_pre()
        prepared = self.params.finish()
        sites: dict[SiteKey, Site] = dict(self.params.sites)
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
                state, error = prepared.get(metric.name, ({}, None))
            due.append((metric, state, error))
        check = self.check_plan == "always" or (
            self.check_plan == "first" and (changed or any(m.name not in self._checked for m, _, _ in due)))
        say = not self._no_grad_said and any("grad" in m.source_kinds for m, _ in self._due)
        # A change before the read: read with the old plan, so left out on every rank (the failure
        # agreement). A change after it (an optimizer that resized a parameter): this step's
        # reads stand; the next due step re-plans either way.
        changed = self._stale or parameter_signature(self.model) != self._signature
        if self._stale:
            due = [(m, s, _CHANGED if set(m.source_kinds) & _PARAM_SIDE else e) for m, s, e in due]
        self._deliver_earlier(step)
        pending = self.executor.launch(due, sites, check=check, unfed=self._unfed | self.params.unfed, step=step,
                                       flag=bool(self.params.no_grad) if say else None,
                                       checks=observer.device_checks() if observer is not None else (),
                                       changed=changed)
        self._replan_due = self.executor.changed
        if say:
            self._say_missing_gradients(step)
        self._checked.update(m.name for m, _, _ in due)
        if self.read_results == "next-step":
            self._in_flight = (step, pending)
        else:
            self._deliver(step, pending)

    def _deliver_earlier(self, step: int) -> None:
        """Deliver the results launched at a step before ``step`` (``read_results: next-step``):
        their copy has landed by now, so reading it waits for nothing."""
        if self._in_flight is not None and self._in_flight[0] < step:
            earlier, self._in_flight = self._in_flight, None
            self._deliver(*earlier)

    def _deliver(self, step: int, pending: Pending) -> None:
        """The results of due step ``step`` read (:meth:`Executor.collect`), warned about, kept
        in :attr:`last_records` and submitted to the sinks."""
        # A step read a step later is read where ranks need not be in step (a scope whose body
        # raised on one rank, close()): nothing may be exchanged there.
        results, failures = self.executor.collect(pending, gather=self.read_results == "now")
        records = [MetricRecord(name, step, r.value, r.labels) for name, rs in results.items() for r in rs]
        self.last_records = records
        self.failures.extend(failures)
        # After SIGTERM closed this object its hooks are gone: steps that still run (for the
        # ranks' collectives) find nothing and fail their update metrics, which says nothing
        # about the model; the failures are kept, not warned about.
        quiet = self._closed_by_signal
        for failure in failures if not quiet else ():
            if failure.metric not in self._warned and self.logs:
                self._warned.add(failure.metric)
                log.warning("tmetrics: metric %r skipped at step %d on every rank (raised on ranks %s): %s. "
                            "Further failures of this metric are counted silently.", failure.metric, step,
                            list(failure.ranks), failure.error)
        for name in pending.unfed if not quiet else ():
            if name not in self._said_unfed and self.topology.global_rank == 0:
                self._said_unfed.add(name)
                metric = next(m for m, _ in self.metrics if m.name == name)  # _due: another step's, a step later
                log.warning("tmetrics: metric %r found nothing to measure on any rank at step %d and wrote no record: "
                            "%s. Said once; later steps without anything to measure write no record either.", name,
                            step, what_feeds(metric.source_kinds,
                                             self.modules.get(name, getattr(metric, "modules", ()))))
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
        everyone = self.executor.gather_objects(sorted(self.params.no_grad))
        if self.topology.global_rank != 0 or not any(everyone):
            return
        # Frozen tensors (requires_grad False everywhere: PEFT's base weights) have none by design.
        frozen = {e.name for e in self.manifest.entries if e.frozen}
        missing = sorted({name for names in everyone for name in names} - frozen)
        ranks = [r for r, names in enumerate(everyone) if set(names) - frozen]
        if not missing:
            return
        log.warning("tmetrics: at step %d, %d parameter(s) had no gradient (.grad and .main_grad None) on rank(s) %s "
                    "and are left out of gradient statistics (not counted as zeros): %s%s", step, len(missing), ranks,
                    missing[:20], " ..." if len(missing) > 20 else "")

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, status: RunStatus = "finished") -> Any:
        """Remove hooks, flush every sink and end the tracker runs with ``status``; returns the
        hub's report (counts written, retried, spooled, dropped per sink; None without a hub).
        Idempotent: a later call returns the same report (the status of the first close
        stands). Called inside an open step scope, it returns None and closes at the scope's
        end, after that step is measured and logged (its optimizer hooks and observations still
        run), with the first status asked for (``"failed"`` where the scope's body raised and
        ``"finished"`` was asked); ``close()`` after the scope returns that report. SIGTERM
        closes at once."""
        if self._closed:
            return self._report
        if self._in_scope and not self._closed_by_signal:
            if self._close_at_step_end is None:
                self._close_at_step_end = status
            return None
        self._closed = True
        for h in [*self._observed, *self._hooks]:
            h.remove()
        try:
            if self._in_flight is not None:  # read_results: next-step; the last due step's results
                earlier, self._in_flight = self._in_flight, None
                self._deliver(*earlier)
        finally:  # what the sinks already have is flushed even if that step cannot be read
            self._report = (None if self.hub is None else self.hub.close_interrupted() if self._interrupted
                            else self.hub.close(status))
        return self._report

    def _close_deferred(self, failed: bool) -> None:
        """The :meth:`close` asked for inside the scope that just ended: ``"failed"`` instead
        of ``"finished"`` when the scope's body raised; a close that raises then is logged, so
        the body's own exception is the one that propagates."""
        status, self._close_at_step_end = self._close_at_step_end, None
        assert status is not None  # called only with a close pending
        try:
            self.close("failed" if failed and status == "finished" else status)
        except Exception:
            if not failed:
                raise
            log.exception("tmetrics: close() asked for inside the step scope failed at the scope's end")

    def _close_interrupted(self) -> None:
        """Ctrl-C (``KeyboardInterrupt``) left a step scope: close with ``"killed"`` now, while
        the tracker libraries still work (a loop with no ``with`` and no ``finally`` otherwise
        closes at interpreter exit, after some have torn down). As after SIGTERM, later step
        scopes still run and log nothing, so a loop that catches the interrupt goes on."""
        self._closed_by_signal = self._interrupted = True
        try:
            self.close("killed")
        except Exception:
            log.exception("tmetrics: closing after KeyboardInterrupt failed")

    def __enter__(self) -> "TensorMetrics":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status_on_exit(exc_type))

    def _install_signal_handler(self) -> None:
        def closed_by_sigterm() -> None:
            self._closed_by_signal = not self._closed
            self.close("killed")

        on_sigterm(closed_by_sigterm)


def _write_manifest(run: RunInfo) -> None:
    """``<run dir>/manifest.json``: the manifest rows, for people and for ``tmetrics names``."""
    path = Path(run.dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps(list(run.manifest), indent=1))
