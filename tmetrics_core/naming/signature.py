"""What the manifest was built from, to tell when a model's parameters change after start-up.

A model may change while it trains: a layer appended (and given to the optimizer with
``add_param_group``), a layer unfrozen (``requires_grad_(True)``), an embedding resized (a new
``Parameter``), a parameter cast to another dtype. The manifest lists the tensors as they were
at start-up, so after such a change its records would leave the new tensors out without a word.
:func:`parameter_signature` is the identity, shape, dtype and ``requires_grad`` of every
parameter, compared at each due step's end (host only, no device work). The shape is the
logical one: a ZeRO-3 parameter's ``data`` is empty outside the forward and whole inside it,
so its ``ds_shape`` (the shape DeepSpeed partitioned) stands for it.
"""

from __future__ import annotations

from typing import Hashable

import torch

__all__ = ["parameter_signature"]


def parameter_signature(model: torch.nn.Module) -> Hashable:
    """``(id, shape, dtype, requires_grad)`` of every parameter of ``model``, in order (tied
    parameters once): equal before and after a step that changed none of them."""
    return tuple((id(p), tuple(getattr(p, "ds_shape", p.shape)), p.dtype, p.requires_grad) for p in model.parameters())
