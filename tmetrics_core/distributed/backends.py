"""Where the executor's two kinds of collective run: metric values on the accelerator, yes/no
agreements on the host.

A due step's metric values live where the tensors were read (the accelerator) and are reduced
there, by the backend the default group has for that device (NCCL on CUDA). Its agreements
(which metrics failed, whether any rank saw new token sites, whether any rank has device
checks) are Python facts: all-reduced as CPU tensors over a group whose backend carries CPU
tensors (gloo), so they never wait for the accelerator's queue. Where the default group has no
CPU backend (``init_process_group("nccl")``), :func:`control_group` makes one gloo group over
the world, once, when ``TensorMetrics`` is built.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["collective_device", "control_group", "object_device"]

_LAZY = "TORCH_GLOO_LAZY_INIT"


def _backends(group: Any = None) -> dict[str, str]:
    """Device type -> backend of ``group`` (None: the default group), e.g. ``{"cpu": "gloo",
    "cuda": "nccl"}`` for ``init_process_group("cpu:gloo,cuda:nccl")``, ``{"cuda": "nccl"}`` for
    ``"nccl"``."""
    pairs = (part.split(":") for part in dist.get_backend_config(group).split(","))
    return {device: backend for device, backend in pairs}


def _current_accelerator() -> torch.device | None:
    """This process's current accelerator device (with its index), or None without one."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else torch.device(accelerator.type, torch.accelerator.current_device_index())


def object_device(group: Any) -> torch.device:
    """Where ``group`` moves pickled objects: the CPU when it has a CPU backend, else the
    current accelerator.

    Raises:
        RuntimeError: the group has no CPU backend and this process no accelerator.
    """
    if "cpu" in _backends(group):
        return torch.device("cpu")
    device = _current_accelerator()
    if device is None:
        raise RuntimeError(f"process group {group} has no CPU backend ({dist.get_backend_config(group)}) and this "
                           "process has no accelerator")
    return device


def collective_device() -> torch.device:
    """The device of metric collectives: the current accelerator when the default group reduces
    its tensors with a backend of its own (NCCL, XCCL, ...), else the CPU (gloo, or no process
    group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    device = _current_accelerator()
    if device is None or _backends().get(device.type) in (None, "gloo"):
        return torch.device("cpu")
    return device


def control_group() -> Any:
    """The world group for host-side agreements: None (the default group) when it carries CPU
    tensors or when no process group runs; else a new gloo group over every rank, which
    connects to a peer only when a collective first needs it (torch's ``TORCH_GLOO_LAZY_INIT``,
    unless the environment sets it): a ring all-reduce's two neighbours, not a full mesh of
    world-size sockets per rank. Collective: every rank calls it at the same point
    (``TensorMetrics`` construction)."""
    if not (dist.is_available() and dist.is_initialized()) or "cpu" in _backends():
        return None
    if _LAZY in os.environ:
        return dist.new_group(backend="gloo")
    os.environ[_LAZY] = "1"  # read by the gloo backend as the group is made
    try:
        return dist.new_group(backend="gloo")
    finally:
        del os.environ[_LAZY]
