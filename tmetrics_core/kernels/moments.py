"""Fused moments: one read of each CPU tensor for all its elementwise statistics (and the
row softmax sums of small tables, :func:`row_softmax_sums`).

The parameter and gradient metrics of a step need, per tensor, a sum of squares (L2, RMS,
update ratio), an absolute maximum, non-finite counts and a zero count. Stock torch kernels
read the tensor once per statistic (four passes, about 6x one ``torch._foreach_norm`` on CPU).
The C kernel ``moments.c`` reads it once and writes five float64 numbers per tensor
(``FIELDS``): sum of squares and sum (float64 accumulation), largest and smallest element
(NaN skipped), and the count of zeros. Statistics that derive from them set
``Statistic.moments`` and implement ``from_moments``; a NaN or infinity shows in the sum of
squares, so exact non-finite counts run only for the tensors that have one.

The kernel is compiled with the system C compiler (``$CC``, else ``cc``) on first use and cached
(:mod:`tmetrics_core.kernels.build`), keyed by the source, the compiler and the CPU's
instruction sets; its arguments for a list of tensors are read by a small C++ function
(:mod:`tmetrics_core.kernels.tensor_lists`), built beside it. Without either compiler, with
``TMETRICS_FUSED_KERNEL=0``, and for tensors it does not take (accelerator, float64, float16,
non-contiguous), the same rows come from batched torch ops
(:mod:`tmetrics_core.kernels.foreach_moments`, a fixed number per statistic and group).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import itertools
import logging
import operator
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Iterable, Iterator, NamedTuple, Sequence, cast

import torch

from tmetrics_core.kernels import build, tensor_lists
from tmetrics_core.site import Site, SiteKey
from tmetrics_core import torch_private

if TYPE_CHECKING:
    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.statistics import Statistic

__all__ = ["FIELDS", "SMALL_TABLE", "Held", "available", "copied", "derivable", "disabled", "moments", "moments_rows",
           "parts", "rows_of", "row_softmax_sums", "spaced", "statistic_vectors", "sumsq_suffices", "rows_if_taken", "takes", "takes_all", "write_rows"]

FIELDS = ("sumsq", "sum", "max", "min", "zeros")
"""The columns of a moments row."""

_ROWS = ("moments rows",)
"""The memo key of :func:`rows_of`'s table."""
_KEY = operator.attrgetter("key")
_MISSING = object()

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_DTYPE_OF = {code: dtype for dtype, code in _DTYPES.items()}
_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math")
_ARCH = (("-march=native",), ())
_PARALLEL = 1 << 17
"""Elements from which a :func:`moments` call spreads its pieces (``1 << 16`` elements each)
over ``torch.get_num_threads()`` threads: torch's own OpenMP workers (see :func:`_openmp`),
which cost a few microseconds to wake right after the model's kernels. Row softmax tables cost
about 16x more per element, so they go parallel from ``_PARALLEL // 16`` elements."""
SMALL_TABLE = 1 << 16
"""Elements up to which :func:`row_softmax_sums` takes a table (router logits of a few thousand
tokens): there one kernel call replaces some twenty small torch ops per table."""
_SOURCE = Path(__file__).with_name("moments.c")
_log = logging.getLogger("tmetrics.kernel")
_switch = {"on": os.environ.get("TMETRICS_FUSED_KERNEL", "1") != "0"}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _openmp() -> tuple[str, ...]:
    """``("-fopenmp",)`` where this process's OpenMP runtime is GNU ``libgomp.so.1`` (torch's
    Linux wheels): the kernel, linked against the same soname, then shares torch's thread pool.
    Else ``()``: a second runtime's threads would fight torch's spinning workers for the cores
    (measured slower than one thread), so the kernel stays on one thread. As for torch's own
    parallel ops, a ``fork()``-ed child must set ``torch.set_num_threads(1)`` before using the
    kernel (GNU OpenMP's pool does not survive a fork; torch's DataLoader workers do so)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    loaded = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "libgomp" in line}
    return ("-fopenmp",) if "libgomp.so.1" in loaded else ()


def _compile(cc: list[str], target: Path) -> None:
    """Build the shared library at ``target`` (see :func:`tmetrics_core.kernels.build.build`)."""
    # -march=native vectorizes the lanes for this CPU (2.7x faster than the baseline ISA);
    # compilers or architectures without it get the portable build, and compilers without
    # OpenMP (clang without libomp) the single-threaded one.
    openmp = _openmp()
    build.build(target, [[*cc, *_FLAGS, *omp, *arch, str(_SOURCE), "-lm"]
                         for arch in _ARCH for omp in dict.fromkeys((openmp, ()))], timeout=120)


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = build.compiler("CC", ("cc", "gcc"), "C")
    if cc is None:
        return None
    try:
        key = build.key(_SOURCE.read_text(), " ".join(cc), build.version(cc), repr((_FLAGS, _ARCH, _openmp())),
                        platform.machine(), _cpu_flags())
        path = build.cache_dir() / f"moments-{key}.so"
        if not path.exists():
            _compile(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        _log.warning("fused moments kernel unavailable (%s; compiler %s, cache %s): tmetrics reads each CPU tensor "
                     "once per statistic instead of once for all; results are the same. Fix the compiler (CC) or "
                     "the cache directory (TMETRICS_CACHE); TMETRICS_FUSED_KERNEL=0 silences this",
                     exc, " ".join(cc), build.cache_dir())
        return None
    lib.tm_moments.restype = ctypes.c_int
    lib.tm_moments.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 3 + [ctypes.c_void_p]
    lib.tm_layout.restype = ctypes.c_int64
    lib.tm_layout.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.tm_copy.restype = ctypes.c_int
    lib.tm_copy.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_uint64, ctypes.c_int32]
    lib.tm_row_softmax.restype = ctypes.c_int
    lib.tm_row_softmax.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int32, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the fused kernel is switched on and compiled, with the C++ reader of its
    arguments (:mod:`~tmetrics_core.kernels.tensor_lists`; compiles both on first call, so
    callers holding accelerator tensors ask only when they hold a CPU one: runs without CPU
    tensors build nothing)."""
    return _switch["on"] and _library() is not None and tensor_lists.available()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, statistics use their torch kernels (for comparisons and benchmarks)."""
    before = _switch["on"]
    _switch["on"] = False
    try:
        yield
    finally:
        _switch["on"] = before


def takes(t: torch.Tensor) -> bool:
    """Whether the kernel reads ``t``: a plain (not a subclass: wrapper tensors such as float8
    or NF4 weights have no data pointer of their own), contiguous, strided CPU float32 or
    bfloat16 tensor without a lazy negation, whose memory the pointer addresses."""
    return takes_all((t,))


def takes_all(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel reads every tensor of ``tensors`` (:func:`takes`)."""
    return _pack(tensors) is not None


def _pack(tensors: Sequence[torch.Tensor]) -> tuple[array.array, array.array, array.array] | None:
    """Data pointers, element counts and dtype codes of ``tensors`` when the kernel takes every
    one (:func:`takes`), else None: one C++ call over the list
    (:func:`tmetrics_core.kernels.tensor_lists.pack`; this runs for every tensor of every due
    step). A list that starts with an accelerator tensor, or any list without a compiled
    kernel, is refused first: runs without CPU tensors build nothing."""
    if tensors and not tensors[0].is_cpu or _library() is None:
        return None
    return tensor_lists.pack(tensors, _DTYPES)


def rows_if_taken(tensors: Sequence[torch.Tensor], *, sumsq_only: bool = False) -> torch.Tensor | None:
    """:func:`moments` of ``tensors`` when the kernel is available and takes every one, else
    None (decided from metadata: nothing is read then)."""
    if not available():
        return None
    packed = _pack(tensors)
    return None if packed is None else _run(_kernel(), _with_minus(packed, None), squares=sumsq_only)


def derivable(statistics: Sequence[Statistic]) -> bool:
    """Whether every statistic derives from moments rows (or the shape) without reading an
    element, and the kernel is on: then moments rows put in a memo stand for the tensors
    themselves, and a tensor of the same shape (even one not holding those values) stands in
    for each."""
    return (bool(statistics) and all((s.moments and not s.reads_elements) or s.shape_only for s in statistics)
            and _switch["on"] and _library() is not None)


def moments(tensors: Sequence[torch.Tensor], minus: Sequence[torch.Tensor | None] | None = None, *,
            sumsq_only: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(tensors), 5]`` float64 rows of :data:`FIELDS`, one read of each tensor.

    Args:
        tensors: contiguous CPU float32 or bfloat16 tensors, any shape (empty included).
        minus: optional tensors of the same dtype and element count subtracted elementwise
            before the moments are taken, without materializing the difference (in float32:
            bfloat16 inputs are widened first, so their difference is not rounded to bfloat16).
        sumsq_only: compute the sum of squares alone (the other columns are NaN), the same
            bits as a full row's, in up to half the time where the pass is bound by arithmetic;
            for calls whose statistics pass :func:`sumsq_suffices`.
        out: a contiguous float64 ``[len(tensors), 5]`` tensor the rows are written into (and
            returned), e.g. rows of a larger buffer, so that rows of several calls lie in one
            tensor; a new one by default.

    The sum of squares and sum accumulate in float64; the maximum and minimum skip NaN (a NaN
    shows as a NaN sum of squares); an empty tensor gives ``[0, 0, -inf, inf, 0]``. Calls of
    at least ``_PARALLEL`` elements run on ``torch.get_num_threads()`` threads where the kernel
    shares torch's OpenMP pool (the numbers do not depend on the thread count).

    Raises:
        ValueError: a tensor the kernel does not take, or a ``minus`` that does not match.
        RuntimeError: the kernel is unavailable (see :func:`available`), ran out of memory,
            or was given a non-empty tensor without a data pointer.
    """
    return _run(_kernel(), _packed(tensors, minus), squares=sumsq_only, out=out)


def parts(tensors: Sequence[torch.Tensor], minus: Sequence[torch.Tensor] | Held, *,
          sumsq_only: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[len(tensors), 3, 5]`` float64: for each pair ``(x, y)`` of ``tensors`` and ``minus``
    (same dtype and element count; ``minus`` tensors or :class:`Held` memory, such as an update
    snapshot's flat buffer), the :data:`FIELDS` rows of ``x - y``, of ``x`` and of ``y``,
    from one read of each (an optimizer step's update, the parameter after and before it). The
    pass takes what reading ``x - y`` and then ``x`` again takes; ``y``'s row comes free. Each
    row equals :func:`moments` of that tensor bit for bit (``sumsq_only`` as there; ``out``: a
    contiguous float64 ``[3 * len(tensors), 5]`` tensor to write into).

    Raises:
        ValueError, RuntimeError: as :func:`moments` (a ``minus`` entry may not be None).
    """
    if not isinstance(minus, Held) and any(m is None for m in minus):
        raise ValueError("parts() needs a tensor to subtract for every tensor; use moments() for single tensors")
    return _run(_kernel(), _packed(tensors, minus), rows=3, squares=sumsq_only, out=out).view(
        len(tensors), 3, len(FIELDS))


def write_rows(out: torch.Tensor, at: int, tensors: Sequence[torch.Tensor],
               minus: Sequence[torch.Tensor | None] | None = None, *, parts: bool = False,
               sumsq_only: bool = False) -> bool:
    """Write into rows ``at`` onwards of ``out`` (a contiguous CPU float64 ``[m, 5]`` buffer
    that several calls fill: a step's rows of every observation) what :func:`moments` (or, with
    ``parts``, :func:`parts`, every ``minus`` given) returns for ``tensors``: no tensor object
    made for the destination, as an ``out=buffer[at:...]`` view would be. Returns False, with
    nothing read or written, where :func:`moments` would refuse the tensors (a tensor the kernel
    does not take, a ``minus`` of another dtype or element count): decided from metadata, so a
    caller with another way to read them asks without an exception.

    Raises:
        ValueError: ``parts`` with a missing ``minus``, or ``out`` without room for the rows
            from ``at``.
        RuntimeError: as :func:`moments`.
    """
    if parts and (minus is None or any(m is None for m in minus)):
        raise ValueError("write_rows(parts=True) needs a tensor to subtract for every tensor")
    packed = _taken(tensors, minus)
    if packed is None:
        return False
    _run(_kernel(), packed, rows=3 if parts else 1, squares=sumsq_only, out=out, at=at)
    return True


class Held(NamedTuple):
    """Values a caller keeps outside any tensor object, given to :func:`parts` as ``minus``:
    those of tensor ``i`` start at ``addresses[i]`` (contiguous, alive during the call), with
    ``numels[i]`` elements of the dtype of kernel code ``codes[i]`` (see :attr:`dtypes`). One
    block describes them all (an update snapshot's flat buffer: no Python object per parameter
    on a due step)."""

    addresses: array.array
    numels: array.array
    codes: array.array
    owner: torch.Tensor | None = None
    """The tensor whose memory the addresses point into, kept alive with the block."""

    @property
    def dtypes(self) -> list[torch.dtype]:
        """The dtype of each entry."""
        return list(map(_DTYPE_OF.__getitem__, self.codes))

    def head(self, count: int) -> Held:
        """The first ``count`` entries."""
        return Held(self.addresses[:count], self.numels[:count], self.codes[:count], self.owner)

    def pick(self, rows: Sequence[int]) -> Held:
        """The entries at ``rows``, in that order."""
        return Held(array.array("Q", map(self.addresses.__getitem__, rows)),
                    array.array("q", map(self.numels.__getitem__, rows)),
                    array.array("i", map(self.codes.__getitem__, rows)), self.owner)


def copied(tensors: Sequence[torch.Tensor], spare: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, Held] | None:
    """One flat byte buffer holding exact copies of ``tensors`` (every bit: -0.0, NaN payloads),
    each at a byte offset aligned to 64 bytes, and where each copy lies in it (a :class:`Held`
    block, in the order of ``tensors``, keeping the buffer alive), made by one kernel call over
    ``torch.get_num_threads()`` threads: the update snapshot of the parameters, about 0.6x the
    time of ``torch_private.foreach_mul(tensors, 1.0)`` on CPU, which launches a kernel and makes a
    tensor object per copy. ``spare``: a uint8 CPU buffer no one else reads, written into when
    it is large enough (an earlier snapshot's: fresh memory costs a page fault per 4 KiB on
    first write, some 3x the copy itself). None (nothing copied) when the kernel is off or
    does not take a tensor (:func:`takes`).

    Raises:
        RuntimeError: the kernel ran out of memory.
    """
    packed = _pack(tensors) if tensors and tensors[0].is_cpu and available() else None
    if packed is None:
        return None
    srcs, numels, codes = packed
    lib = _kernel()
    # Where each copy goes (64-byte aligned offsets, turned into addresses by the copy) and
    # the bytes needed, laid out by the kernel: no Python per tensor.
    n = len(srcs)
    sizes, dsts = array.array("q", bytes(8 * n)), array.array("Q", bytes(8 * n))
    needed = lib.tm_layout(n, _address(numels), _address(codes), _address(sizes), _address(dsts))
    buffer = (spare if spare is not None and spare.numel() >= needed and spare.dtype is torch.uint8
              and spare.is_cpu and spare.is_contiguous() else torch.empty(needed, dtype=torch.uint8))
    threads = torch.get_num_threads() if needed >= 4 * _PARALLEL else 1
    if n and lib.tm_copy(n, _address(srcs), _address(dsts), _address(sizes), buffer.data_ptr(), threads):
        raise RuntimeError("the kernel's copy ran out of memory")
    return buffer, Held(dsts, numels, codes, buffer)


def sumsq_suffices(statistics: Iterable[Statistic]) -> bool:
    """Whether the moments rows of ``statistics`` may be computed with ``sumsq_only``: each
    reads at most the sum-of-squares column (``Statistic.reads_sumsq_only``, or ``shape_only``:
    no column)."""
    return all(s.reads_sumsq_only or s.shape_only for s in statistics)


def _kernel() -> ctypes.CDLL:
    """The kernel library.

    Raises:
        RuntimeError: it is unavailable (see :func:`available`).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the fused moments kernel is unavailable; see tmetrics_core.kernels.moments")
    return lib


_Packed = tuple[array.array, array.array, array.array, array.array]
"""Kernel arguments: data pointers of the tensors and of what they subtract (0: nothing), element
counts and dtype codes."""


def _packed(tensors: Sequence[torch.Tensor], minus: Sequence[torch.Tensor | None] | Held | None) -> _Packed:
    """The kernel's arguments for ``tensors`` minus ``minus`` (:func:`_taken`).

    Raises:
        ValueError: a tensor the kernel does not take (:func:`takes`), or a ``minus`` entry
            whose dtype or element count differs from its tensor's.
    """
    taken = _taken(tensors, minus)
    if taken is not None:
        return taken
    packed = _pack(tensors)
    if packed is None:
        bad = next(t for t in tensors if _pack((t,)) is None)
        raise ValueError(f"moments takes contiguous CPU float32/bfloat16 tensors; got {bad.dtype} on "
                         f"{bad.device}, contiguous={bad.is_contiguous()}")
    return _with_minus(packed, minus)  # raises: what does not match


def _taken(tensors: Sequence[torch.Tensor], minus: Sequence[torch.Tensor | None] | Held | None) -> _Packed | None:
    """The kernel's arguments for ``tensors`` minus ``minus``, or None (no exception, nothing
    read) where it does not take a tensor or a ``minus`` entry differs from its tensor in dtype
    or element count: decided from metadata by the C++ reader."""
    if (minus is not None and not isinstance(minus, Held) and len(minus) == len(tensors)
            and type(None) not in set(map(type, minus))):
        # Pairs (a residual's h - x): both lists in one reader call, split afterwards.
        both = _pack([*tensors, *cast("Sequence[torch.Tensor]", minus)])
        n = len(tensors)
        if both is None or both[1][:n] != both[1][n:] or both[2][:n] != both[2][n:]:
            return None
        return both[0][:n], both[0][n:], both[1][:n], both[2][:n]
    packed = _pack(tensors)
    if packed is None:
        return None
    try:
        return _with_minus(packed, minus)
    except ValueError:  # some tensors subtract nothing, and another differs from its tensor
        return None


def _with_minus(packed: tuple[array.array, array.array, array.array],
                minus: Sequence[torch.Tensor | None] | Held | None) -> _Packed:
    """:func:`_pack`'s arrays with the addresses of what each tensor subtracts (0: nothing; None:
    nothing for every tensor), as the kernel takes them (Python arrays, not torch tensors: no
    torch op).

    Raises:
        ValueError: a ``minus`` entry whose dtype or element count differs from its tensor's,
            or one the kernel does not take.
    """
    xs, ns, codes = packed
    if minus is None:
        return xs, array.array("Q", bytes(8 * len(xs))), ns, codes
    if isinstance(minus, Held):
        if minus.numels != ns or minus.codes != codes:
            raise ValueError("held values must match their tensors (same dtype and element count)")
        return xs, minus.addresses, ns, codes
    if type(None) not in set(map(type, minus)):  # each tensor subtracts one (parts()): arrays compared in C
        taken = _pack(cast("Sequence[torch.Tensor]", minus))
        if taken is None or taken[1] != ns or taken[2] != codes:
            raise ValueError("each minus must match its tensor (same dtype and element count, contiguous CPU "
                             "float32/bfloat16)")
        return xs, taken[0], ns, codes
    at = [i for i, m in enumerate(minus) if m is not None]
    taken = _pack([m for m in minus if m is not None])
    if (taken is None or len(minus) != len(xs) or list(map(ns.__getitem__, at)) != list(taken[1])
            or list(map(codes.__getitem__, at)) != list(taken[2])):
        raise ValueError("each minus must match its tensor (same dtype and element count, contiguous CPU "
                         "float32/bfloat16)")
    ys = array.array("Q", bytes(8 * len(xs)))
    for i, address in zip(at, taken[0]):
        ys[i] = address
    return xs, ys, ns, codes


def _address(values: array.array) -> int:
    """Where an array's items start (the array must outlive the call that reads them)."""
    return values.buffer_info()[0]


def _run(lib: ctypes.CDLL, packed: _Packed, rows: int = 1, squares: bool = False,
         out: torch.Tensor | None = None, at: int | None = None) -> torch.Tensor:
    """``[rows * n, 5]`` for the ``n`` tensors of ``packed``: :func:`moments` (``rows=1``) or
    :func:`parts` (``rows=3``); ``squares`` and ``out``: their ``sumsq_only`` and ``out``. With
    ``at``, the rows go to ``out``'s rows from ``at`` on (:func:`write_rows`) and ``out`` is
    returned whole.

    Raises:
        ValueError: an ``out`` that is not a contiguous CPU float64 tensor of that shape (or,
            with ``at``, with room for the rows from there).
    """
    xs, ys, ns, dtypes = packed
    n = len(xs)
    if at is not None:
        try:
            if isinstance(at, bool):
                raise TypeError("a bool")
            at = operator.index(at)
        except TypeError:
            raise ValueError("at must be an integer row index") from None
    if out is None:
        out = torch.empty((rows * n, len(FIELDS)), dtype=torch.float64)
    elif ((out.shape != (rows * n, len(FIELDS)) if at is None else
           (out.dim() != 2 or out.shape[1] != len(FIELDS) or not 0 <= at <= out.shape[0] - rows * n))
          or out.dtype is not torch.float64 or not out.is_cpu or not out.is_contiguous()):
        room = f"({rows * n}, {len(FIELDS)})" if at is None else f"(at least {at + rows * n}, {len(FIELDS)})"
        raise ValueError(f"out must be a contiguous CPU float64 tensor of shape {room}; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not n:
        return out
    threads = torch.get_num_threads() if sum(ns) >= _PARALLEL else 1
    status = lib.tm_moments(n, _address(xs), _address(ys), _address(ns), _address(dtypes), threads, rows, squares,
                            out.data_ptr() + (at or 0) * len(FIELDS) * 8)
    if status:
        raise RuntimeError("the fused moments kernel " + ("ran out of memory" if status == -1 else
                                                          "was given a tensor without data (null pointer)"))
    return out


def row_softmax_sums(tables: Sequence[torch.Tensor], classes: Sequence[int], probabilities: Sequence[bool]
                     ) -> torch.Tensor | None:
    """Row softmax sums of small ``[rows, cols]`` tables in one kernel call: ``[len(tables), 6]``
    float64 rows ``[0, sum H, sum H / log classes, sum lse, sum lse**2, rows]``, the finished
    vector of :mod:`tmetrics_core.metrics.softmax` (same formulas, float64, one pass per row;
    ``probabilities[i]``: rows are probabilities, else logits). None when the kernel is off or
    unavailable, or a table is not a 2-D tensor it takes with at most :data:`SMALL_TABLE`
    elements: above that torch's vectorized exp beats the kernel's scalar one.

    Raises:
        RuntimeError: a non-empty table without a data pointer.
    """
    if (not _switch["on"] or not all(t.dim() == 2 and t.numel() <= SMALL_TABLE for t in tables)
            or not takes_all(tables)):
        return None
    lib = _library()
    if lib is None:
        return None
    n = len(tables)
    out = torch.empty((n, 6), dtype=torch.float64)
    if not n:
        return out
    arrays = (array.array("Q", [t.data_ptr() for t in tables]), array.array("q", [t.shape[0] for t in tables]),
              array.array("q", [t.shape[1] for t in tables]), array.array("q", classes),
              array.array("i", [_DTYPES[t.dtype] for t in tables]), array.array("i", map(int, probabilities)))
    threads = torch.get_num_threads() if sum(t.numel() for t in tables) >= _PARALLEL // 16 else 1
    status = lib.tm_row_softmax(n, *map(_address, arrays), threads, out.data_ptr())
    if status:
        raise RuntimeError("the row softmax kernel was given a table without data (null pointer)")
    return out


def rows_of(memo: dict[Hashable, Any]) -> dict[SiteKey, tuple[torch.Tensor, int] | None]:
    """The step memo's moments rows by site key: ``(kernel output, row index)``, or None for a
    tensor the kernel does not take (one table, so a metric's sites are looked up in C loops)."""
    table = memo.get(_ROWS)
    if table is None:
        table = memo[_ROWS] = {}
    return table


def _rows(entries: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The moments rows of memo entries ``(kernel output, row)``: a slice of the output when the
    entries are evenly spaced rows of it, as they are when one statistic asks for the sites of
    the kernel call that read them (every row, or every third row where updates and parameters
    after and before the step come from one pass), else one gather from it, so no per-site rows
    are made and stacked again."""
    blocks, rows = zip(*entries)
    block = blocks[0]
    if not all(map(operator.is_, blocks, itertools.repeat(block))):
        # Rows of several kernel calls (e.g. a general-path statistic over sites read in
        # different passes): the few outputs joined, then one gather, not an op per row.
        starts: dict[int, int] = {}
        outputs: list[torch.Tensor] = []
        for b in blocks:
            if id(b) not in starts:
                starts[id(b)] = sum(o.shape[0] for o in outputs)
                outputs.append(b)
        rows = tuple(starts[id(b)] + j for b, j in entries)
        block = torch.cat(outputs)
    even = spaced(rows)
    return block[even] if even is not None else block.index_select(0, torch.tensor(rows, device=block.device))


def spaced(rows: Sequence[int]) -> slice | None:
    """``rows`` (indices into a kernel output) as a slice when they are evenly spaced and
    increasing (every row, or one kind of row of :func:`parts`: a view, no gather), else None."""
    first = rows[0]
    step = rows[1] - first if len(rows) > 1 else 1
    if step > 0 and list(rows) == list(range(first, first + step * len(rows), step)):
        return slice(first, first + step * (len(rows) - 1) + 1, step)
    return None


def _entries(tensors: Sequence[torch.Tensor], sites: Sequence[Site], memo: dict[Hashable, Any]
             ) -> list[tuple[torch.Tensor, int] | None]:
    """The memo entries of the sites' moments rows, the missing ones read in one kernel call."""
    table = rows_of(memo)
    keys = list(map(_KEY, sites))
    entries = list(map(table.get, keys, itertools.repeat(_MISSING)))
    if _MISSING in entries:
        missing = [i for i, entry in enumerate(entries) if entry is _MISSING]
        # A tensor the kernel does not take is remembered as None: checked once per step. The
        # library is only looked for when some tensor needs it (not on accelerator-only runs).
        taken = (missing if takes_all([tensors[i] for i in missing])
                 else [i for i in missing if takes(tensors[i])])
        lib = _library() if taken else None
        table.update((keys[i], None) for i in missing)
        if lib is not None:
            block = _run(lib, _packed([tensors[i] for i in taken], None))
            table.update((keys[i], (block, j)) for j, i in enumerate(taken))
        entries = list(map(table.__getitem__, keys))
    return cast("list[tuple[torch.Tensor, int] | None]", entries)  # every key is in the table now


def moments_rows(tensors: Sequence[torch.Tensor], sites: Sequence[Site], memo: dict[Hashable, Any]
                 ) -> torch.Tensor | None:
    """``[len(sites), 5]`` moments rows of the sites (from ``memo``, the missing ones read in one
    kernel call and remembered), or None when the kernel is off or does not take every tensor
    (nothing is read then beyond what the memo gets)."""
    if not _switch["on"] or not sites:
        return None
    entries = _entries(tensors, sites, memo)
    if None in entries:
        return None
    return _rows(cast("list[tuple[torch.Tensor, int]]", entries))


def statistic_vectors(stat: Statistic, tensors: Sequence[torch.Tensor], sites: Sequence[Site],
                      topology: Topology, memo: dict[Hashable, torch.Tensor]) -> list[torch.Tensor]:
    """``stat``'s local vectors of ``tensors`` (as :meth:`Statistic.compute`), through the fused
    kernel where it applies: one moments row per site, kept in the memo's :func:`rows_of` table
    as ``(kernel output, row)`` (None for a tensor the kernel does not take) so every statistic
    of the step reuses the same read."""
    if not stat.moments or not _switch["on"]:
        return stat.compute(tensors, sites, topology)
    entries = _entries(tensors, sites, memo)
    fused = [i for i, entry in enumerate(entries) if entry is not None]
    present = [entry for entry in entries if entry is not None]
    if len(fused) == len(tensors):
        return stat.from_moments(_rows(present), tensors)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    if fused:
        rows = _rows(present)
        for i, vec in zip(fused, stat.from_moments(rows, [tensors[i] for i in fused])):
            out[i] = vec
    rest = [i for i in range(len(tensors)) if out[i] is None]
    for i, vec in zip(rest, stat.compute([tensors[i] for i in rest], [sites[i] for i in rest], topology)):
        out[i] = vec
    return cast("list[torch.Tensor]", out)  # every index is filled: fused or rest
