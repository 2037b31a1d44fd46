"""The optimizer's step hooks of a :class:`~tmetrics_core.tensor_metrics.TensorMetrics`.

Parameters and gradients are read in the optimizer's step pre-hook (before the update,
gradients before ``zero_grad``), or, for ``optimizer.step(closure)``, when the closure has run;
Adam state and updates in its post-hook, once every optimizer of a chain has stepped. A
``GradScaler`` that skips a step (inf or NaN gradients) fails the step's update metrics.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.naming.signature import parameter_signature
from tmetrics_core.errors import TMetricsError
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.grad_scaler import ScalerWatch
from tmetrics_core.sources.param_observer import ParamObserver

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """The optimizer step pre- and post-hooks and the gradient scaler's callbacks, mixed into
    :class:`~tmetrics_core.tensor_metrics.TensorMetrics` (whose state they read)."""

    model: torch.nn.Module
    params: ParamObserver
    reporter: Reporter
    _signature: Any
    _stale: bool
    _step: int | None
    _due: list[tuple[TensorMetric, int]]
    _stepping: set[int]
    _stepped: set[int]
    _optimizer_count: int
    _read_after_unscale: bool
    _skip_said: bool
    _in_scope: bool
    _scaler: ScalerWatch | None
    _check_open: Callable[[str], None]
    """Refuses a call after ``close()`` (:meth:`~tmetrics_core.scope.shutdown.Shutdown._check_open`)."""

    def observe_gradients(self) -> None:
        """Read gradients (and parameters) now, e.g. before clipping, instead of in the optimizer's
        pre-hook. Call between ``backward()`` and ``optimizer.step()`` inside ``step()``, or inside
        the closure of ``optimizer.step(closure)`` after its ``backward()``. Called again before
        ``optimizer.step()`` (after each micro-batch's backward), it reads them again: the last
        call's values are the step's. Metrics of parameters alone still see them as the
        optimizer step does when an update metric is due: they are read from its snapshot (see
        :class:`~tmetrics_core.sources.param_plan.DueSetPlan`).

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


    def _read_pre(self) -> None:
        """Read the parameters and gradients (the ``pre`` phase), noting whether the model's
        parameters had changed since they were planned: then this read used a stale plan."""
        self._stale = self._stale or parameter_signature(self.model) != self._signature
        self.params.prepare("pre")

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
        self.reporter.log(logging.INFO if self._skip_said else logging.WARNING, "tmetrics: %s%s", reason,
                          "" if self._skip_said else ". Said at WARNING once; later skips at INFO")
        self._skip_said = True

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
