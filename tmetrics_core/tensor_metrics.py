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
:meth:`observe_gradients` to read them earlier), or, for ``optimizer.step(closure)``, when the
closure has run; Adam state and updates in its post-hook (:mod:`~tmetrics_core.scope.optimizer_steps`);
activations while the forward runs (:mod:`~tmetrics_core.scope.observation_hooks`). At the step's end
(:mod:`~tmetrics_core.scope.step_end`) the executor reduces every due metric in one pass and the
records go to the sinks (logging rank only). Plans: :mod:`~tmetrics_core.scope.planning`; start-up
checks: :mod:`~tmetrics_core.scope.startup_checks`; closing: :mod:`~tmetrics_core.scope.shutdown`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
from typing import Any, Collection, Iterator, Mapping, Sequence

import torch

from tmetrics_core.config.sections import READ_RESULTS, ReadResults
from tmetrics_core.distributed.backends import collective_device, control_group
from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.distributed.agreement import MetricFailure
from tmetrics_core.distributed.executor import Executor, Pending
from tmetrics_core.errors import ConfigError, TMetricsError
from tmetrics_core.hub.sink_hub import NullHub
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.scope.observation_hooks import install_observation_hooks
from tmetrics_core.observe import in_backward, new_owner
from tmetrics_core.observer import _ACTIVE
from tmetrics_core.scope.optimizer_steps import OptimizerSteps
from tmetrics_core.placements import Placement
from tmetrics_core.scope.planning import Planning, write_manifest
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus, status_on_exit
from tmetrics_core.reporter import Reporter
from tmetrics_core.scope.shutdown import Shutdown
from tmetrics_core.sinks.keys import KeyRules
from tmetrics_core.sources.adapters import AdapterWatch
from tmetrics_core.kinds import GRAD_KINDS, TOKEN_KINDS
from tmetrics_core.sources.cotangents import CotangentScale, data_parallel_divisor, grad_scaler_scale
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.sources.grad_scaler import ScalerWatch
from tmetrics_core.sources.optimizer_state import torch_optimizers
from tmetrics_core.sources.optimizers import unwrap_optimizer
from tmetrics_core.sources.pipelining import quiet_shape_inference
from tmetrics_core.sources.token_plan import TokenPlan
from tmetrics_core.sources.token_step import TokenSites
from tmetrics_core.sources.tokens import TokenObserver
from tmetrics_core.scope.startup_checks import StartupInputs, check_against_model
from tmetrics_core.scope.step_end import StepEnd
from tmetrics_core.topology import Topology
from tmetrics_core.user_scalars import scalar_records

__all__ = ["TensorMetrics"]


class TensorMetrics(OptimizerSteps, StepEnd, Shutdown, Planning):
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
            :class:`~tmetrics_core.manifest.table.Manifest`).
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
        self.reporter = Reporter(self.topology, log_rank)
        self.metrics = list(metrics)
        self.hub = hub
        self.check_plan = check_plan
        self.executor = Executor(self.topology, collectives=collectives, timeout_s=timeout_s,
                                 device=collective_device(),
                                 control=control_group() if self.topology.world_size > 1 else None)
        self._manifest_options: dict[str, Any] = dict(
            overrides=placements, framework_placements=framework_placements, layer_offset=layer_offset,
            expert_offset=expert_offset, qkv_select=[g for m, _ in self.metrics for g in getattr(m, "select", ())])
        self._plan_model()
        self._replan_due = False
        """Some rank's parameters changed at the last due step: re-plan at the next one."""
        self._stale = False
        """The parameters had changed since they were planned when this step read them."""
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
        self._unfed: set[str] = set()  # due token metrics that read no tensor here this step
        self._no_grad_said = False
        self._skip_said = False
        self._step: int | None = None
        self._first_step: int | None = None
        self._last_entered: int | None = None  # the step of the latest scope, for log()
        self._last_due: int | None = None
        self._due: list[tuple[TensorMetric, int]] = []
        self._token_sites = TokenSites(  # token sites and their placement checks, kept across steps
            configured=frozenset(k for m, _ in self.metrics for k in m.source_kinds))
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
        self.metrics = check_against_model(self.metrics, StartupInputs(
            model=model, manifest=self.manifest, index=self.index, routers=self.routers,
            num_experts=self._num_experts, topology=self.topology, executor=self.executor, optimizer=self.optimizer,
            flat_kinds=frozenset(self.flat), modules=self.modules, token_modules=self._token_modules,
            optional=frozenset(optional_metrics), reporter=self.reporter), key_rules or {})
        skipped = {m.name for m, _ in metrics} - {m.name for m, _ in self.metrics}
        self.modules = {name: p for name, p in self.modules.items() if name not in skipped}
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
                write_manifest(run)
            hub.open(run)
            hub.log_config(run.config)
        self.run = run
        self._install_signal_handler()

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
            self._adapters.check(step, say=self.reporter.speaks)
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
                                     cotangent_scale=CotangentScale(self._cotangent_divisor, self._loss_scale),
                                     reporter=self.reporter)
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

    def _observation_hooks(self) -> list[Any]:
        """The token sources' hooks (:func:`~tmetrics_core.scope.observation_hooks.install_observation_hooks`)."""
        return install_observation_hooks(self.model, [m for m, _ in self.metrics], index=self.index,
                                         routers=self.routers, topology=self.topology, modules=self.modules,
                                         token_modules=self._token_modules, owner=self._owner, reporter=self.reporter)

    def __enter__(self) -> "TensorMetrics":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status_on_exit(exc_type))
