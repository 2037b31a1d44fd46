"""tmetrics in a loop driven by Hugging Face accelerate: :func:`attach`.

Usage::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with attach(accelerator, model, optimizer, "tmetrics.yaml"):   # or attached = attach(...); attached.close()
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()

The loop stays as it is. One step scope spans the micro-batches of one optimizer step: it opens
at the first training forward (grad enabled, model in train mode) after the previous optimizer
step and closes right after the torch optimizer's ``step()`` ran (accelerate skips that step on
micro-batches that only accumulate). Gradients are read when the backward of the micro-batch that
sets ``accelerator.sync_gradients`` ends, after DDP's all-reduce and before any clipping, so
``global-grad-l2`` equals the total norm ``accelerator.clip_grad_norm_`` returns.
Steps are numbered 1, 2, ... by optimizer steps (``first_step=`` to resume). One run by default:
the records also go into the runs of ``accelerator.trackers`` (after ``init_trackers``:
TensorBoard, MLflow, W&B), under ``tmetrics/`` (see :mod:`tmetrics_core.sinks.trackers`).

With a ``DeepSpeedPlugin`` the loop is the same: ``accelerator.backward`` runs DeepSpeed's step at
the accumulation boundary, and the scope closes after it; gradients, state and updates are read
from ZeRO's partitions (:mod:`tmetrics_core.integrations.deepspeed`), ``global-grad-l2`` equals
DeepSpeed's own ``get_global_grad_norm()``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.integrations.accelerate_adapter import unwrap_accelerated
from tmetrics_core.integrations.axes import default_axes
from tmetrics_core.integrations.backward import AfterBackward
from tmetrics_core.integrations.deepspeed import DeepSpeedSteps
from tmetrics_core.integrations.scope import OpenScope
from tmetrics_core.records import RunStatus, status_on_exit
from tmetrics_core.sinks.trackers import known_trackers
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["Attached", "attach"]


class Attached:
    """What :func:`attach` returns: the :class:`TensorMetrics` (``.metrics``) driven by the loop's
    own forward, backward and optimizer step; :meth:`close` (or leaving a ``with`` block) ends the run."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any,
                 metrics: TensorMetrics, *, first_step: int) -> None:
        self.metrics = metrics
        self.next_step = first_step
        self._scope = OpenScope(metrics)
        self._accelerator = accelerator
        self._hooks = [model.register_forward_pre_hook(self._before_forward),
                       optimizer.register_step_post_hook(self._after_step)]
        # DeepSpeed reads its reduced partitions in its own step hooks (before it clips them).
        self._backward = (AfterBackward(model, when=self._ends_accumulation, then=metrics.observe_gradients)
                          if not isinstance(optimizer, DeepSpeedSteps) else None)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._scope.is_open and module.training and torch.is_grad_enabled():
            self._scope.open(self.next_step)

    def _ends_accumulation(self) -> bool:
        return self._scope.is_open and bool(self._accelerator.sync_gradients)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._scope.is_open:
            self._scope.close()
            self.next_step += 1

    def close(self, status: RunStatus = "finished") -> Any:
        """End the run with ``status``: a step still open (forward without an optimizer step) is
        left without records; hooks come off; sinks flush and close. Returns the hub's report.
        Idempotent."""
        if self._scope.is_open:
            self._scope.abandon(RuntimeError("the run closed before this step's optimizer step"))
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._backward is not None:
            self._backward.remove()
        return self.metrics.close(status)

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(status_on_exit(exc_type))


def attach(accelerator: Any, model: torch.nn.Module, optimizer: Any, config: Any, *, mesh: Any = None,
           axes: Mapping[str, Any] | None = None, sinks: str | Sequence[str] | None = None,
           run_dir: str | os.PathLike[str] | None = None, first_step: int = 1) -> Attached:
    """Measure the model and optimizer that ``accelerator.prepare`` returned.

    Args:
        accelerator: the ``accelerate.Accelerator`` (its ``sync_gradients`` marks the micro-batch
            that ends an accumulation).
        model: prepared or not; measured unwrapped (``accelerator.unwrap_model``).
        optimizer: prepared (``AcceleratedOptimizer``) or the torch optimizer.
        config: as :meth:`TensorMetrics.from_config` takes it (path, dict or ``Config``).
        mesh, axes: the topology; by default ``{"dp": WORLD}`` under multi-process accelerate
            (DDP), one process otherwise.
        sinks, run_dir: overrides, as in :meth:`TensorMetrics.from_config`.
        first_step: the number of the first optimizer step measured.

    Raises:
        ConfigError: everything :meth:`TensorMetrics.from_config` refuses.
    """
    inner = accelerator.unwrap_model(model)
    torch_optimizer = unwrap_accelerated(optimizer)
    metrics = TensorMetrics.from_config(config, model=inner, optimizer=torch_optimizer, mesh=mesh,
                                        axes=default_axes(mesh, axes), sinks=sinks, run_dir=run_dir,
                                        trackers=known_trackers(getattr(accelerator, "trackers", ())))
    # Under DeepSpeed the step is ZeRO's, inside accelerator.backward(): its adapter carries the hooks.
    stepped = metrics.optimizer if isinstance(metrics.optimizer, DeepSpeedSteps) else torch_optimizer
    return Attached(accelerator, inner, stepped, metrics, first_step=first_step)
