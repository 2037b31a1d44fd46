"""Mixed precision's loss scaling seen from the parameter side: :class:`ScalerWatch`.

``torch.amp.GradScaler`` multiplies the loss by its scale, so the gradients are scaled until
``scaler.unscale_(optimizer)`` divides them (the user's call, before clipping, or the one
``scaler.step`` makes itself). When a gradient is inf or NaN, ``scaler.step`` does not call
``optimizer.step()`` at all: no optimizer hook runs, and tmetrics would read the gradients at the
step's end, after ``zero_grad()``. Given the scaler, tmetrics wraps the two methods on that one
instance (removed at close):

- ``unscale_``: after it, a gradient read that ``observe_gradients()`` asked for while the
  gradients were scaled is made (so gradients are read unscaled whether or not the user
  called ``unscale_``);
- ``step``: on a due step, first unscales every optimizer of the step not yet unscaled (what
  ``scaler.step`` does itself, for one optimizer), so that the optimizer's step pre-hook reads
  unscaled gradients of all of them; after it, an optimizer whose step did not run was skipped:
  the gradients are read there (with their inf and NaN, for ``layer-grad-nonfinite``) and the
  update and state metrics of the step are failed with a reason that names the skip.

Optimizers that unscale inside their own step (``_step_supports_amp_scaling``: torch's fused
Adam and AdamW) skip their update inside the kernel, after tmetrics' pre-hook, which cannot tell
that from an update of zero: they are refused when a scaler is given.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["ScalerWatch"]


class ScalerWatch:
    """The wrapped ``unscale_`` and ``step`` of one ``torch.amp.GradScaler`` (see the module docstring).

    Args:
        scaler: the user's ``GradScaler`` (``torch.amp`` or ``torch.cuda.amp``).
        optimizers: the torch optimizers of the step (one, or a chain's).
        due: whether a due step scope is open now.
        on_unscaled: called after every optimizer of the step was unscaled in the scope.
        on_stepped: called with the optimizer after each ``scaler.step`` of a due step; the
            caller tells a skipped step (inf or NaN gradients) by its step pre-hook not having run.

    Raises:
        ConfigError: ``scaler`` has no ``unscale_`` and ``step``, or an optimizer unscales in its
            own step (fused Adam).
    """

    def __init__(self, scaler: Any, optimizers: Sequence[torch.optim.Optimizer], *, due: Callable[[], bool],
                 on_unscaled: Callable[[], None], on_stepped: Callable[[torch.optim.Optimizer], None]) -> None:
        if not all(callable(getattr(scaler, name, None)) for name in ("unscale_", "step", "is_enabled")):
            raise ConfigError(f"grad_scaler= is a {type(scaler).__name__}; pass the torch.amp.GradScaler that "
                              "scales the loss", path="grad_scaler")
        fused = [type(o).__name__ for o in optimizers if getattr(o, "_step_supports_amp_scaling", False)]
        if fused and scaler.is_enabled():
            raise ConfigError(f"grad_scaler= with {fused[0]}(fused=True), which unscales and skips inside its own "
                              "step, after tmetrics' step pre-hook: a skipped step would read as an update of 0. "
                              "Use fused=False (foreach) with a GradScaler", path="grad_scaler")
        self.scaler = scaler
        self.optimizers = tuple(optimizers)
        self._due, self._on_unscaled, self._on_stepped = due, on_unscaled, on_stepped
        self._unscale, self._step = scaler.unscale_, scaler.step
        self.unscaled: set[int] = set()
        """The optimizers (ids) unscaled since :meth:`begin`."""
        scaler.unscale_ = self._unscale_then_read
        scaler.step = self._step_then_check

    @property
    def scaling(self) -> bool:
        """Whether the gradients of some optimizer of the step are still scaled."""
        return bool(self.scaler.is_enabled()) and len(self.unscaled) < len(self.optimizers)

    def begin(self) -> None:
        """A step scope opened: no optimizer unscaled in it yet."""
        self.unscaled = set()

    def _unscale_then_read(self, optimizer: torch.optim.Optimizer) -> None:
        self._unscale(optimizer)
        self.unscaled.add(id(optimizer))
        if self._due() and not self.scaling:
            self._on_unscaled()

    def _step_then_check(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._due() or not self.scaler.is_enabled():
            return self._step(optimizer, *args, **kwargs)
        for other in self.optimizers:  # the pre-hook reads every optimizer's gradients, unscaled
            if id(other) not in self.unscaled:
                self.scaler.unscale_(other)
        out = self._step(optimizer, *args, **kwargs)
        if self._due():
            self._on_stepped(optimizer)
        return out

    def remove(self) -> None:
        """Give the scaler its own methods back."""
        for name in ("unscale_", "step"):
            self.scaler.__dict__.pop(name, None)
