"""``StepHooks``: pre hooks, the framework's step, then post hooks (or skipped hooks when the
framework skipped the step); ``remove()`` puts the framework's own ``step`` back."""
from __future__ import annotations

from tmetrics_core.integrations.step_hooks import StepHooks


class Framework:
    """A framework optimizer: ``step`` a class method, ``overflow`` set when it skipped."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.overflow = False

    def step(self, scale: float = 1.0) -> float:
        self.calls.append(f"step {scale}")
        return scale * 2


class Skipping(StepHooks):
    def skipped(self) -> bool:
        return self.wrapped.overflow


def test_hooks_run_around_the_step_and_remove_restores_it():
    opt = Framework()
    hooks = Skipping(opt)
    hooks.register_step_pre_hook(lambda o, args, kwargs: opt.calls.append(f"pre {args}"))
    hooks.register_step_post_hook(lambda o, args, kwargs: opt.calls.append("post"))
    hooks.register_step_skipped_hook(lambda o, args, kwargs: opt.calls.append("skipped"))
    assert opt.step(3.0) == 6.0
    opt.overflow = True
    opt.step()
    assert opt.calls == ["pre (3.0,)", "step 3.0", "post", "pre ()", "step 1.0", "skipped"]
    hooks.remove()
    assert "step" not in vars(opt) and type(opt).step is Framework.step
    opt.calls.clear()
    opt.step()
    assert opt.calls == ["step 1.0"]


def test_an_instance_step_is_put_back_and_a_later_patch_is_kept():
    opt = Framework()
    own = opt.step
    opt.step = own  # an instance attribute before tmetrics came
    hooks = StepHooks(opt)
    hooks.remove()
    assert vars(opt)["step"] is own
    later = StepHooks(opt)
    opt.step = lambda: "someone else's"  # patched again after tmetrics
    later.remove()
    assert opt.step() == "someone else's"
