"""A framework's optimizer with torch's step-hook interface, and the patch undone on close.

Megatron-Core's and DeepSpeed's optimizers are not ``torch.optim.Optimizer``s: they have no
``register_step_pre_hook``. :class:`StepHooks` replaces the instance's ``step`` with one that
runs the pre hooks, the framework's own ``step()``, then the post hooks (or the skipped hooks,
where the framework says it skipped the step), and is itself a handle: ``remove()`` puts the
framework's ``step`` back, so ``TensorMetrics.close()`` leaves the optimizer as it found it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

__all__ = ["StepHooks"]

Hook = Callable[..., None]


class StepHooks:
    """Step hooks around ``optimizer.step`` (``hook(self, args, kwargs)``, as torch's).

    Attributes:
        wrapped: the framework's optimizer (not ``optimizer``: that would read as a wrapper to
            unwrap).
    """

    def __init__(self, optimizer: Any) -> None:
        self.wrapped = optimizer
        self._pre: OrderedDict[int, Hook] = OrderedDict()  # weakly referenced by handles
        self._post: OrderedDict[int, Hook] = OrderedDict()
        self._skipped: OrderedDict[int, Hook] = OrderedDict()
        self._had_own_step = "step" in vars(optimizer)
        self._original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            for hook in list(self._pre.values()):
                hook(self, args, kwargs)
            out = self._original(*args, **kwargs)
            for hook in list((self._skipped if self.skipped() else self._post).values()):
                hook(self, args, kwargs)
            return out

        self._step = step
        optimizer.step = step

    def skipped(self) -> bool:
        """Whether the framework skipped the step that just ran (never, unless a subclass knows)."""
        return False

    def register_step_pre_hook(self, hook: Hook) -> RemovableHandle:
        """Run ``hook(self, args, kwargs)`` before every framework ``step`` (``args``, ``kwargs``:
        those the step was called with), in registration order, as torch's
        ``Optimizer.register_step_pre_hook``. An exception from the hook propagates and the
        step does not run. Returns the handle whose ``remove()`` takes the hook off."""
        return self._register(self._pre, hook)

    def register_step_post_hook(self, hook: Hook) -> RemovableHandle:
        """Run ``hook(self, args, kwargs)`` after every framework ``step`` that was not skipped
        (:meth:`skipped`; the skipped hooks run instead), in registration order, as torch's
        ``Optimizer.register_step_post_hook``. Returns the handle that takes the hook off."""
        return self._register(self._post, hook)

    def register_step_skipped_hook(self, hook: Hook) -> RemovableHandle:
        """``hook(self, args, kwargs)`` after a step the framework skipped, in place of the post
        hooks."""
        return self._register(self._skipped, hook)

    def remove(self) -> None:
        """Put the framework's ``step`` back (once; a later patch by someone else is kept)."""
        if vars(self.wrapped).get("step") is self._step:
            if self._had_own_step:
                self.wrapped.step = self._original
            else:
                del self.wrapped.step

    @staticmethod
    def _register(hooks: OrderedDict[int, Hook], hook: Hook) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle
