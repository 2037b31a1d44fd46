"""tmetrics in a Lightning ``Trainer``: :class:`TMetricsCallback`.

Usage::

    trainer = lightning.Trainer(max_steps=1000, accumulate_grad_batches=2, gradient_clip_val=1.0,
                                callbacks=[TMetricsCallback("tmetrics.yaml")])
    trainer.fit(module, loader)

Lightning steps the optimizer as ``optimizer.step(closure)``: the forward and backward of the
micro-batch that ends an accumulation run inside ``step()``, after the optimizer's step
pre-hooks, and the gradients are clipped after ``on_before_optimizer_step``. So the callback
drives the step scope itself: it opens at ``on_train_batch_start`` of the first micro-batch of
an optimizer step (numbered ``trainer.global_step + 1``), reads gradients and parameters at
``on_before_optimizer_step`` (after the closure's backward and DDP's all-reduce, before
clipping and the update: tmetrics' step pre-hook is run from there, not when ``step()`` is
entered), and closes at ``on_train_batch_end`` of the micro-batch that stepped (or tried to: a
step that mixed precision skips is reported as a step without an update).
Under manual optimization (``automatic_optimization = False``) the user's ``training_step``
calls ``manual_backward``, may clip (``self.clip_gradients``) and calls ``opt.step()``, after
which ``on_before_optimizer_step`` sees the clipped gradients. There the gradients are read at
``on_after_backward`` instead (:meth:`TensorMetrics.observe_gradients`, after every
``manual_backward``; the last one before the step counts): before the user's clipping, with
every accumulated micro-batch.
Under ``strategy="ddp"`` the topology is ``{"dp": WORLD}`` unless ``mesh=`` or ``axes=`` say
otherwise. One optimizer per run. One run by default: the records also go into the runs of the
Trainer's loggers (TensorBoard, MLflow, W&B), under ``tmetrics/`` (see
:mod:`tmetrics_core.sinks.trackers`). A LightningModule that keeps its network in one attribute is
measured as that network (:func:`~tmetrics_core.integrations.lightning_adapter.measured_model`), so its
tensors get canonical names.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle

from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.axes import default_axes
from tmetrics_core.integrations.scope import OpenScope
from tmetrics_core.sinks.trackers import known_trackers
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["TMetricsCallback"]


class _PreHooksAfterClosure:
    """The optimizer as :class:`TensorMetrics` sees it under Lightning: everything is the torch
    optimizer's, except that step pre-hooks registered here run when :meth:`run_pre_hooks` is
    called (from ``on_before_optimizer_step``) instead of before the closure's backward."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def run_pre_hooks(self) -> None:
        for hook in list(self._pre_hooks.values()):
            hook(self._optimizer, (), {})

    @property
    def torch_optimizers(self) -> tuple[torch.optim.Optimizer]:
        return (self._optimizer,)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class TMetricsCallback(Callback):
    """Measure a Lightning ``fit`` with the metrics and sinks of ``config``.

    Args:
        config: as :meth:`TensorMetrics.from_config` takes it (path, dict or ``Config``).
        mesh, axes: the topology; by default ``{"dp": WORLD}`` when Lightning runs several processes.
        sinks, run_dir: overrides, as in :meth:`TensorMetrics.from_config`.

    Attributes:
        metrics: the :class:`TensorMetrics` of the latest ``fit`` (None before the first).

    Raises:
        ConfigError: at ``on_train_start``: the module has several optimizers, or anything
            :meth:`TensorMetrics.from_config` refuses.
    """

    def __init__(self, config: Any, *, mesh: Any = None, axes: Mapping[str, Any] | None = None,
                 sinks: str | Sequence[str] | None = None, run_dir: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.metrics: TensorMetrics | None = None
        self._options = {"mesh": mesh, "axes": axes, "sinks": sinks, "run_dir": run_dir}
        self._scope: OpenScope | None = None
        self._view: _PreHooksAfterClosure | None = None
        self._stepped = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ConfigError(f"TMetricsCallback measures one optimizer; configure_optimizers returned "
                              f"{len(optimizers)}. Build TensorMetrics yourself for several")
        view = _PreHooksAfterClosure(optimizers[0])
        options = dict(self._options)
        options["axes"] = default_axes(options["mesh"], options["axes"])
        metrics = TensorMetrics.from_config(self.config, model=pl_module,
                                            optimizer=cast(torch.optim.Optimizer, view),
                                            trackers=known_trackers(trainer.loggers), **options)
        self.metrics, self._view, self._scope = metrics, view, OpenScope(metrics)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._scope is not None and not self._scope.is_open:
            self._scope.open(trainer.global_step + 1)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.automatic_optimization and self._scope is not None and self._scope.is_open \
                and self.metrics is not None:
            self.metrics.observe_gradients()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._scope is not None and self._scope.is_open and self._view is not None:
            self._stepped = True
            self._view.run_pre_hooks()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._scope is not None and self._stepped:
            self._stepped = False
            self._scope.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._scope is not None and self._scope.is_open:
            self._scope.abandon(exception)
        self._end("failed")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end("finished")

    def _end(self, status: Any) -> None:
        scope, self._scope = self._scope, None
        if scope is not None and scope.is_open:
            scope.abandon(RuntimeError("the run ended inside a step"))
        if self.metrics is not None:
            self.metrics.close(status)
