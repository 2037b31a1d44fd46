"""``torch.distributed.pipelining``'s metadata inference, kept out of the records.

At a schedule's first step every stage runs its submodule once to learn the shapes it sends and
receives: the first stage on the real micro-batch, the others on placeholder tensors
(``torch.empty`` or ones, never the activations of the step). The residual and activation hooks
saw that forward as a micro-batch of the step: torchtitan with 2 pipeline stages read a first-step
residual L2 of 157 for 128, and 3.5e37 on stage 1. The stage method that runs it
(``_forward_metadata_inference``; ``_shape_inference`` in older releases) is wrapped, once per
process, to run with observation suspended (`tmetrics_core.observe.suspended`), when the
pipelining module is imported; nothing else of the stage changes.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from tmetrics_core.observe import suspended
from tmetrics_core import torch_private

__all__ = ["quiet_shape_inference"]

_METHODS = torch_private.PIPELINE_SHAPE_INFERENCE
_MARK = "_tmetrics_suspended"


def quiet_shape_inference() -> bool:
    """Wrap the stage classes' shape-inference methods if ``torch.distributed.pipelining`` is
    imported; returns whether it is (a later call wraps what a new import brought)."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is None:
        return False
    for cls in vars(stage).values():
        if not isinstance(cls, type):
            continue
        for name in _METHODS:
            original = cls.__dict__.get(name)
            if original is None or getattr(original, _MARK, False):
                continue
            setattr(cls, name, _suspending(original))
    return True


def _suspending(original: Any) -> Any:
    @functools.wraps(original)
    def inference(*args: Any, **kwargs: Any) -> Any:
        with suspended():
            return original(*args, **kwargs)
    setattr(inference, _MARK, True)
    return inference
