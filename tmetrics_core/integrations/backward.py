"""Run a function once at the end of a backward pass, after its gradients are complete.

Trainer and accelerate loops clip the gradients right after the last micro-batch's
``backward()`` and before ``optimizer.step()``, with no callback in between (the Trainer's
``on_pre_optimizer_step`` comes after clipping). To read the gradients the framework's
``grad_norm`` is computed from, :class:`AfterBackward` puts a post-accumulate-grad hook on every
trainable parameter; the first hook that fires in a backward pass where ``when()`` holds asks the
autograd engine to call back when the pass ends. That callback queues the reader once more, so
it runs after every callback the pass queued, DDP's gradient all-reduce finalization among
them: the reader sees the all-reduced gradients, exactly what ``clip_grad_norm_`` sees next.
The engine's final-callback queue is what DDP and FSDP themselves use for this. Each forward of
the model re-arms the reader, so a backward that raised (a skipped out-of-memory batch) does not
leave it waiting for a callback that never comes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import Variable

__all__ = ["AfterBackward"]


class AfterBackward:
    """Call ``then()`` after each backward pass of ``model``'s parameters during which ``when()``
    is true (checked at the pass's first accumulated gradient), once per pass.
    :meth:`remove` takes the hooks off.

    Args:
        model: whose trainable parameters (``requires_grad``) are watched.
        when: e.g. "a step scope is open and this micro-batch ends the accumulation".
        then: the reader, e.g. ``metrics.observe_gradients``.
    """

    def __init__(self, model: torch.nn.Module, *, when: Callable[[], bool], then: Callable[[], None]) -> None:
        self._when = when
        self._then = then
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in model.parameters() if p.requires_grad]
        self._handles.append(model.register_forward_pre_hook(self._rearm))

    def _rearm(self, module: torch.nn.Module, args: object) -> None:
        self._queued = False

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._queued or not self._when():
            return
        self._queued = True
        Variable._execution_engine.queue_callback(self._requeue)  # type: ignore[attr-defined]

    def _requeue(self) -> None:
        Variable._execution_engine.queue_callback(self._run)  # type: ignore[attr-defined]

    def _run(self) -> None:
        self._queued = False
        self._then()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
