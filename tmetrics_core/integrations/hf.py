"""tmetrics in the Hugging Face ``Trainer``: :class:`TMetricsCallback`.

Usage::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TMetricsCallback("tmetrics.yaml")])
    trainer.train()

The callback builds :class:`~tmetrics_core.tensor_metrics.TensorMetrics` at ``on_train_begin``
from the Trainer's model and its torch optimizer (inside accelerate's ``AcceleratedOptimizer``),
opens one step scope per optimizer step (``on_step_begin`` of the first micro-batch to
``on_step_end``), numbered as the Trainer numbers it (``state.global_step`` after the step, the
step its ``grad_norm`` is logged at), and closes the run at ``on_train_end``.

Gradients are read before clipping: the Trainer clips right after the last micro-batch's
backward and calls ``on_pre_optimizer_step`` only after clipping, so the callback reads them at
the end of that backward (:class:`~tmetrics_core.integrations.backward.AfterBackward`). Hence
``global-grad-l2`` equals the ``grad_norm`` the Trainer logs, with or without ``max_grad_norm``.
Under DDP (the Trainer started torch.distributed) the topology is ``{"dp": WORLD}`` unless
``mesh=`` or ``axes=`` say otherwise.

With ``TrainingArguments(deepspeed=...)`` nothing changes for the user: the Trainer's DeepSpeed
optimizer leads to ZeRO's partitions (:mod:`tmetrics_core.integrations.deepspeed`), which are read
in DeepSpeed's own step, before it clips; ``global-grad-l2`` equals the ``grad_norm`` the Trainer
logs (DeepSpeed's ``get_global_grad_norm()``).

One run by default: the records also go into the tracker runs the Trainer itself reports to
(its ``report_to``), under ``tmetrics/``, instead of second runs: the MLflow run its
``MLflowCallback`` started (the ``mlflow`` sink's ``run_id`` option) and the W&B run its
``WandbCallback`` started (the ``wandb`` sink's ``reuse_run``), and the TensorBoard directory its
``TensorBoardCallback`` writes when ``TENSORBOARD_LOGGING_DIR`` names it (the ``tensorboard``
sink's ``log_dir``; TensorBoard shows the two event files as one run). By default a tracker
tmetrics cannot join is passed over with an INFO line; ``report_to=True`` refuses it instead,
``report_to=False`` joins none (the configured sinks only).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from transformers import TrainerCallback

from tmetrics_core.config.schema import Config, load_config, override_sinks
from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.axes import default_axes
from tmetrics_core.integrations.backward import AfterBackward
from tmetrics_core.integrations.deepspeed import DeepSpeedSteps
from tmetrics_core.integrations.scope import OpenScope
from tmetrics_core.sinks.trackers import SHARED_PREFIX
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["TMetricsCallback"]


class TMetricsCallback(TrainerCallback):
    """Measure a Hugging Face ``Trainer`` run with the metrics and sinks of ``config``.

    Args:
        config: as :meth:`TensorMetrics.from_config` takes it (path, dict or ``Config``).
        mesh, axes: the topology; by default ``{"dp": WORLD}`` when the Trainer runs DDP.
        sinks, run_dir: overrides, as in :meth:`TensorMetrics.from_config`.
        report_to: write into the Trainer's own tracker runs (see the module docstring): None
            (default) those tmetrics can join, True all of them or a ConfigError, False none.

    Attributes:
        metrics: the :class:`TensorMetrics` of the latest ``train()`` (None before the first).

    Raises:
        ConfigError: at ``on_train_begin``, everything :meth:`TensorMetrics.from_config` refuses;
            with ``report_to=True``, a Trainer tracker whose run tmetrics cannot join (path ``report_to``).
    """

    def __init__(self, config: Any, *, mesh: Any = None, axes: Mapping[str, Any] | None = None,
                 sinks: str | Sequence[str] | None = None, run_dir: str | os.PathLike[str] | None = None,
                 report_to: bool | None = None) -> None:
        self.config = config
        self.report_to = report_to
        self.metrics: TensorMetrics | None = None
        self._options = {"mesh": mesh, "axes": axes, "sinks": sinks, "run_dir": run_dir}
        self._scope: OpenScope | None = None
        self._backward: AfterBackward | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if self._scope is not None:
            return
        options = dict(self._options)
        options["axes"] = default_axes(options["mesh"], options["axes"])
        config = self.config
        passed_over: list[str] = []
        if self.report_to is not False:  # the sinks override first, so it cannot drop the Trainer's trackers
            config, passed_over = _join_trainer_runs(config, options.pop("sinks"), args.report_to,
                                                     strict=bool(self.report_to))
        # The Trainer's AcceleratedOptimizer is unwrapped by the accelerate adapter.
        metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer, **options)
        for message in passed_over:  # said once, by the logging rank
            metrics.reporter.info("tmetrics: %s", message)
        scope = OpenScope(metrics)
        gradient_state = getattr(optimizer, "gradient_state", None)

        def ends_accumulation() -> bool:
            return scope.is_open and (gradient_state is None or bool(gradient_state.sync_gradients))

        self.metrics, self._scope = metrics, scope
        if not isinstance(metrics.optimizer, DeepSpeedSteps):  # DeepSpeed's step hooks read its partitions
            self._backward = AfterBackward(model, when=ends_accumulation, then=metrics.observe_gradients)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._scope is not None:
            self._scope.open(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._scope is not None:
            self._scope.close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> Any:
        """End the run (``on_train_end`` calls it): hooks come off, sinks flush and close.
        Returns the hub's report. Idempotent; call it yourself when ``train()`` raised. A later
        ``train()`` starts a new run."""
        if self._backward is not None:
            self._backward.remove()
            self._backward = None
        scope, self._scope = self._scope, None
        if scope is not None and scope.is_open:
            scope.abandon(RuntimeError("the run closed inside a step"))
        return self.metrics.close() if self.metrics is not None else None


def _join_trainer_runs(source: Any, sinks_override: str | Sequence[str] | None,
                       report_to: Sequence[str] | str | None, *, strict: bool) -> tuple[Config, list[str]]:
    """The config (its sinks overridden by ``sinks_override`` when given) with a sink for each
    tracker in the Trainer's ``report_to``, set to write into the run the Trainer's callback
    started (which ran ``on_train_begin`` before this one), and why each tracker that cannot be
    joined was passed over (for an INFO line on the logging rank, once the run's reporter exists).

    Raises:
        ConfigError: ``strict`` and a tracker that cannot be joined (path ``report_to``).
    """
    config = source if isinstance(source, Config) else load_config(source)
    if sinks_override:
        config = override_sinks(config, sinks_override)
    names = [report_to] if isinstance(report_to, str) else list(report_to or ())
    names = [n for n in names if n != "none"]
    passed_over: list[str] = []

    def cannot(message: str) -> None:
        if strict:
            raise ConfigError(message, path="report_to")
        passed_over.append(message)

    unsupported = [n for n in names if n not in ("mlflow", "wandb", "tensorboard")]
    if unsupported:
        cannot(f"the Trainer reports to {unsupported}, whose runs tmetrics cannot join (only mlflow, wandb, "
               "tensorboard); pass report_to=False and configure those trackers under sinks: (a run of their own)")
    sinks = dict(config.sinks)
    if "mlflow" in names:
        import mlflow

        active = mlflow.active_run()
        if active is None:
            cannot("the Trainer reports to MLflow but no MLflow run is active at on_train_begin; "
                   "keep transformers' MLflowCallback in the Trainer's callbacks")
        else:
            sinks["mlflow"] = {**(sinks.get("mlflow") or {}), "tracking_uri": mlflow.get_tracking_uri(),
                               "run_id": active.info.run_id}
    if "wandb" in names:
        import wandb

        if wandb.run is None:
            cannot("the Trainer reports to W&B but no W&B run is active at on_train_begin; keep "
                   "transformers' WandbCallback in the Trainer's callbacks")
        else:
            heatmaps = {k: v for k, v in (sinks.get("wandb") or {}).items() if k.startswith("heatmap")}
            sinks["wandb"] = {**heatmaps, "reuse_run": True}
    if "tensorboard" in names:
        # Without the variable the Trainer's directory name holds the second it was made in.
        log_dir = os.environ.get("TENSORBOARD_LOGGING_DIR")
        if not log_dir:
            cannot("the Trainer reports to TensorBoard in a directory named by the time it started; set "
                   "TENSORBOARD_LOGGING_DIR so tmetrics can write into the same directory")
        else:
            sinks["tensorboard"] = {**(sinks.get("tensorboard") or {}), "log_dir": os.path.expanduser(log_dir),
                                    "prefix": SHARED_PREFIX}
    return dataclasses.replace(config, sinks=sinks), passed_over
