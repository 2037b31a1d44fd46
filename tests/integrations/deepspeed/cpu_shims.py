"""Test scaffolding only: accelerate's ``PartialState`` knows no distributed backend for a machine
without an accelerator unless told ``cpu=True``, and ``cpu=True`` turns DeepSpeed off. Under
DeepSpeed on its CPU accelerator it then counts one process, and the Trainer sizes DeepSpeed's
batch and shards its data for one. Here it is told that the CPU's backend is gloo, as
``accelerate launch`` on GPUs finds nccl."""

from __future__ import annotations

from typing import Any


def apply() -> None:
    import accelerate.state as state

    original = state.get_distributed_backend
    state.get_torch_accelerator_backend = lambda: ("cpu", None)

    def backend(device_type: Any) -> Any:
        return "gloo" if device_type == "cpu" else original(device_type)

    state.get_distributed_backend = backend
