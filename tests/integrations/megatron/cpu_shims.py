"""The CUDA-only calls of megatron-core 0.16.1 replaced so a tiny model trains on CPU (test
scaffolding only; see /work/shared/MACHINE-NOTES.md). Nothing here tells tmetrics anything.

- ``torch.cuda.current_device()`` returns ``"cpu"``: the global memory buffer of attention,
  the router's weight move in ``gating()``, expert parallelism and Megatron's DDP buffers
  allocate on the current device;
- the CUDA RNG tracker's ``fork()`` is a no-op context (dropout is 0, no CUDA RNG state);
- ``torch.cuda.synchronize()`` does nothing (Megatron's pipeline schedules call it after their
  point-to-point transfers);
- ``moe_utils.te_general_gemm`` is None (0.16.1 leaves it undefined without Transformer Engine);
- for Megatron's optimizers (:func:`cuda_tensors_on_cpu`, :func:`cuda_type_names`): tensors
  asked for on ``"cuda"`` are made on the CPU, and CPU tensors name CUDA types.
"""

from __future__ import annotations

import contextlib

import torch


def apply() -> None:
    """Install the shims in this process (idempotent)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils

    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore
    moe_utils.te_general_gemm = None


def cuda_tensors_on_cpu() -> None:
    """``torch.tensor``/``torch.zeros`` with ``device="cuda"`` make CPU tensors: Megatron's
    ``FP32Optimizer`` keeps its loss scale there and ``get_grad_norm_fp32`` (called by
    ``ChainedOptimizer.step``) its buffers. Installed only by the optimizer cases."""
    for name in ("tensor", "zeros"):
        original = getattr(torch, name)
        if getattr(original, "_cpu_shim", False):
            continue

        def factory(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        factory._cpu_shim = True  # type: ignore[attr-defined]
        setattr(torch, name, factory)


def cuda_type_names() -> None:
    """``Tensor.type()`` (no argument) of a CPU tensor names the CUDA type
    (``torch.cuda.FloatTensor``): Megatron's mixed-precision and distributed optimizers accept
    only parameters whose type names are CUDA ones. Installed only by the optimizer cases."""
    original = torch.Tensor.type
    if getattr(original, "_cpu_shim", False):
        return

    def type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    type_name._cpu_shim = True  # type: ignore[attr-defined]
    torch.Tensor.type = type_name  # type: ignore[method-assign]
