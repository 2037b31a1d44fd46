"""The moments kernel's arguments for a list of tensors, read in C++ (``tensor_lists.cpp``).

Before each pass the kernel needs, per tensor, its data pointer, element count and dtype, and
the proof that it may read the tensor's memory as a flat array (a plain, dense, contiguous CPU
float32 or bfloat16 tensor without a lazy negation). From Python each of those properties is
one call through torch's bindings per tensor; a due step packs every gradient, parameter and
snapshot, so at thousands of small tensors the checks cost more than the passes. The C++
function reads them all from the tensors' C++ objects in one call.

It is built with the system C++ compiler (``$CXX``, else ``c++`` or ``g++``) against this
process's torch and Python headers on first use, and cached (see
:mod:`tmetrics_core.kernels.build`). Where it cannot be built, the fused kernel is unavailable
(:func:`tmetrics_core.kernels.moments.available`) and every tensor takes the batched torch ops:
the same numbers, slower on CPU.
"""

from __future__ import annotations

import array
import functools
import importlib.machinery
import importlib.util
import logging
import platform
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Mapping, Sequence

import torch

from tmetrics_core.kernels import build
from tmetrics_core import torch_private

__all__ = ["available", "pack"]

_SOURCE = Path(__file__).with_name("tensor_lists.cpp")
_NAME = "tmetrics_tensor_lists"
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_log = logging.getLogger("tmetrics.kernel")


def _flags() -> list[str]:
    from torch.utils import cpp_extension  # imported only to build: it imports setuptools

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = torch_private.cxx11_abi()
    return ["-O2", "-fPIC", "-shared", "-std=c++20", f"-DTORCH_EXTENSION_NAME={_NAME}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-isystem{path}" for path in includes)]


def _libraries() -> list[str]:
    from torch.utils import cpp_extension

    return [*(f"-L{path}" for path in cpp_extension.library_paths()),
            "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


@functools.cache
def _module() -> ModuleType | None:
    """The built extension module, or None (with a warning) where it cannot be built or loaded."""
    cxx = build.compiler("CXX", ("c++", "g++"), "C++")
    if cxx is None:
        return None
    try:
        flags, libraries = _flags(), _libraries()
        key = build.key(_SOURCE.read_text(), " ".join(cxx), build.version(cxx), torch.__version__, torch.__file__,
                        platform.python_version(), *flags, *libraries)
        path = build.cache_dir() / f"tensor-lists-{key}.so"
        if not path.exists():
            build.build(path, [[*cxx, *flags, str(_SOURCE), *libraries]])
        spec = importlib.util.spec_from_file_location(
            _NAME, path, loader=importlib.machinery.ExtensionFileLoader(_NAME, str(path)))
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        _log.warning("tmetrics' C++ tensor-list reader is unavailable (%s; compiler %s, cache %s): the fused moments "
                     "kernel is off, and tmetrics reads each CPU tensor once per statistic instead of once for all; "
                     "results are the same. Fix the compiler (CXX, Python headers) or the cache directory "
                     "(TMETRICS_CACHE); TMETRICS_FUSED_KERNEL=0 silences this", exc, " ".join(cxx), build.cache_dir())
        return None
    return module


def available() -> bool:
    """Whether the reader is built (builds it on first call)."""
    return _module() is not None


def pack(tensors: Sequence[torch.Tensor], codes: Mapping[torch.dtype, int]
         ) -> tuple[array.array, array.array, array.array] | None:
    """``(data pointers, element counts, dtype codes)`` of ``tensors`` (``codes``: the kernel's
    code of float32 and of bfloat16) when the kernel takes every one: a plain ``torch.Tensor``
    or ``Parameter`` (not a subclass: wrapper tensors such as DTensor, float8 or NF4 weights
    have no data pointer of their own), dense, strided and contiguous on the CPU, float32 or
    bfloat16, without a lazy negation, whose memory the pointer addresses (non-empty tensors).
    Else None, also when the reader is unavailable (see :func:`available`). One C++ call;
    nothing is read but metadata.
    """
    if not set(map(type, tensors)) <= _PLAIN:
        return None
    module = _module()
    if module is None:
        return None
    n = len(tensors)
    xs, ns, cs = array.array("Q", bytes(8 * n)), array.array("q", bytes(8 * n)), array.array("i", bytes(4 * n))
    try:
        taken = module.pack(tensors if isinstance(tensors, list) else list(tensors), xs.buffer_info()[0],
                            ns.buffer_info()[0], cs.buffer_info()[0], codes[torch.float32], codes[torch.bfloat16])
    except (TypeError, RuntimeError):  # an entry that is not a tensor, or one torch refuses to describe
        return None
    return (xs, ns, cs) if taken else None
