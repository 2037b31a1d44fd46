"""Peak memory of training steps on CPU: the high-water mark of the C heap, sampled after every
torch operation.

Every CPU tensor's storage comes from the C allocator (``malloc``), so the bytes the heap has
in use (glibc ``mallinfo2``: ``uordblks`` in the arenas plus ``hblkhd`` in mmap'd blocks)
follow the live tensor bytes exactly, plus a small, steady amount of non-tensor C memory.
A ``TorchDispatchMode`` samples it after each operation of the measured steps (forward,
backward, optimizer, tmetrics); its peak minus the heap in use before the model was built is
the training memory of the variant. ``tracemalloc`` would miss tensors (it sees Python's
allocator only) and ``ru_maxrss`` is dominated by the interpreter and libraries; the latter is
reported as context. Peaks inside a single kernel (its scratch space) are not seen, alike for
every variant.

Linux with glibc only (``mallinfo2``, glibc 2.33+).
"""

from __future__ import annotations

import ctypes
import resource
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HeapPeak", "heap_in_use", "max_rss_bytes"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    """Bytes the C heap has handed out and not taken back (arenas plus mmap'd blocks)."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def max_rss_bytes() -> int:
    """This process's resident set high-water mark, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HeapPeak(TorchDispatchMode):
    """Inside the block, ``peak`` is the largest :func:`heap_in_use` seen after any torch op."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = heap_in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        used = heap_in_use()
        if used > self.peak:
            self.peak = used
        return out
