"""Every private torch name tmetrics uses, in one module.

A name here has a leading underscore in torch: it may change or vanish in any release. Each is
tested against the pinned torch (``tests/test_torch_private.py``), so an upgrade that breaks one
fails there, naming it, instead of deep in a training step. Product code imports private torch
names from here only.

- ``in_backward()``: autograd's engine is running a backward graph on this thread
  (``torch._C._current_graph_task_id() != -1``); checkpoint recomputation runs there too.
- ``EffectType`` and ``register_effectful_op``: keep an output-less custom operator in the
  compiled graph, in program order (``torch._library.effects``).
- ``foreach_*``: the multi-tensor kernels ``torch._foreach_*`` (one launch per tensor list on
  CUDA); the optimizers in ``torch.optim`` use the same.
- ``PIPELINE_SHAPE_INFERENCE``: the ``torch.distributed.pipelining`` stage methods that run a
  forward to learn shapes (``_forward_metadata_inference``; ``_shape_inference`` before it).
- ``replicate_with_fsdp()``: FSDP2's replicate mode (``torch.distributed._composable``), which,
  unlike DDP, takes DTensor parameters; the demo's data parallel over tensor parallel uses it.
- ``strided_shard()``: DTensor's ``_StridedShard`` placement class (what ``fully_shard`` gives
  a parameter tensor parallelism already sharded on the same dim).
- ``held_local(t)``: a DTensor's local tensor as held (``DTensor._local_tensor``), without the
  autograd function ``to_local()`` adds; None for anything else.
- ``version(t)``: a tensor's version counter (``Tensor._version``), which every in-place change
  moves.
- ``child_modules(m)``: a module's registered children by key (``Module._modules``), a module
  held under several keys listed under each (``named_children()`` lists it once).
- ``dtensor_spec(t)``: a DTensor's spec (``DTensor._spec``: mesh and placements by identity).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._library.effects import EffectType

__all__ = ["EffectType", "PIPELINE_SHAPE_INFERENCE", "child_modules", "foreach_abs", "foreach_add_", "foreach_clamp_max",
           "foreach_clamp_min", "foreach_max", "foreach_mul", "foreach_mul_", "foreach_neg",
           "foreach_neg_", "foreach_norm", "foreach_powsum", "foreach_sub", "foreach_sub_",
           "dtensor_spec", "held_local", "in_backward", "register_effectful_op", "replicate_with_fsdp",
           "strided_shard", "version"]

register_effectful_op = torch.library._register_effectful_op

foreach_abs = torch._foreach_abs
foreach_add_ = torch._foreach_add_
foreach_clamp_max = torch._foreach_clamp_max
foreach_clamp_min = torch._foreach_clamp_min
foreach_max = torch._foreach_max
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_neg = torch._foreach_neg
foreach_neg_ = torch._foreach_neg_
foreach_norm = torch._foreach_norm
foreach_powsum = torch._foreach_powsum
foreach_sub = torch._foreach_sub
foreach_sub_ = torch._foreach_sub_

PIPELINE_SHAPE_INFERENCE = ("_forward_metadata_inference", "_shape_inference")


def in_backward() -> bool:
    """Whether autograd's engine runs a backward graph on this thread now (checkpoint
    recomputation included); ``False`` in forward and outside autograd."""
    return bool(torch._C._current_graph_task_id() != -1)


def replicate_with_fsdp() -> Callable[..., Any]:
    """``replicate(module, mesh=...)`` of ``torch.distributed._composable.replicate_with_fsdp``,
    imported on call (it imports FSDP2)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate  # type: ignore[no-any-return]


def strided_shard() -> Any:
    """``torch.distributed.tensor.placement_types._StridedShard``, imported on call."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def held_local(tensor: Any) -> torch.Tensor | None:
    """``tensor._local_tensor`` of a DTensor (the data ``to_local()`` views, without its
    autograd function); None where ``tensor`` has none."""
    return getattr(tensor, "_local_tensor", None)


def dtensor_spec(tensor: Any) -> Any:
    """``tensor._spec`` of a DTensor: its ``DTensorSpec`` (``.mesh``, ``.placements``)."""
    return tensor._spec


def version(tensor: torch.Tensor) -> int:
    """``tensor._version``: bumped by every in-place change of the tensor (or of a view of it)."""
    return int(tensor._version)


def child_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module._modules``: its children by key, repeats included (not a copy: do not change it)."""
    return module._modules
