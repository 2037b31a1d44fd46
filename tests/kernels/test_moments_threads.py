"""The fused moments kernel under thread counts, piece edges and concurrent callers: many tiny
tensors next to a large one, tensors of exactly one or several pieces, empty tensors among large
ones, one to three OpenMP threads, two Python threads calling at once, and ``parts`` with a
non-finite value in only one of the pair, all against float64 references or single-threaded
calls bit for bit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tmetrics_core.kernels import moments

pytestmark = pytest.mark.skipif(not moments.available(), reason="no C compiler for the fused kernel")

PIECE = 1 << 16


def _reference(t: torch.Tensor) -> list[float]:
    x = t.double().reshape(-1)
    kept = x[~torch.isnan(x)]
    return [float(x.pow(2).sum()), float(x.sum()), float(kept.max()) if kept.numel() else -math.inf,
            float(kept.min()) if kept.numel() else math.inf, float((x == 0).sum())]


def _assert_reference(row: list[float], t: torch.Tensor) -> None:
    ref = _reference(t)
    if math.isnan(ref[0]):
        assert math.isnan(row[0]) and math.isnan(row[1])
    else:
        assert row[0] == pytest.approx(ref[0], rel=1e-12, abs=1e-12)
        assert row[1] == pytest.approx(ref[1], rel=1e-9, abs=1e-9)
    assert row[2:] == ref[2:]


def _mixed(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Many tiny tensors, empty ones, exactly-piece-sized ones and a large one, interleaved."""
    g = torch.Generator().manual_seed(seed)
    sizes = [i % 41 for i in range(3000)] + [0, PIECE, 2 * PIECE, 0, 3 * PIECE + 1, PIECE - 1, 0, 5 * PIECE]
    sizes = sizes[:1500] + sizes[3000:] + sizes[1500:3000]
    return [(torch.randn(n, generator=g) * 2).to(dtype) for n in sizes]


def _with_threads(n: int, call):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tiny_empty_and_piece_sized_tensors_match_float64_on_one_to_three_threads(dtype) -> None:
    tensors = _mixed(0, dtype)
    others = _mixed(1, dtype)
    assert sum(t.numel() for t in tensors) >= moments._PARALLEL
    got = {n: _with_threads(n, lambda: (moments.moments(tensors), moments.parts(tensors, others)))
           for n in (1, 2, 3)}
    for n in (2, 3):
        assert torch.equal(got[n][0], got[1][0]), n
        assert torch.equal(got[n][1], got[1][1]), n
    rows, parts = got[1]
    for i in list(range(0, len(tensors), 97)) + list(range(1500, 1508)):
        _assert_reference(rows[i].tolist(), tensors[i])
        _assert_reference(parts[i, 1].tolist(), tensors[i])
        _assert_reference(parts[i, 2].tolist(), others[i])
        # x - y in float32 (bfloat16 widened first, as documented), accumulated in float64.
        _assert_reference(parts[i, 0].tolist(), tensors[i].float() - others[i].float())


def test_exactly_piece_sized_tensors_split_where_the_pieces_end() -> None:
    """An extreme value in the last element of a piece and the first of the next is found in
    either piece; the zero count adds up over pieces."""
    t = torch.ones(3 * PIECE)
    t[PIECE - 1], t[PIECE], t[2 * PIECE - 1], t[-1] = 9.0, -8.0, 0.0, 0.0
    for n in (1, 2, 3):
        row = _with_threads(n, lambda: moments.moments([t, torch.empty(0)]))
        _assert_reference(row[0].tolist(), t)
        assert row[1].tolist() == [0.0, 0.0, -math.inf, math.inf, 0.0]


@pytest.mark.parametrize("where", ["x", "y"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_parts_with_a_non_finite_value_in_one_tensor_of_the_pair(where: str, value: float) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2 * PIECE + 9, generator=g), torch.randn(2 * PIECE + 9, generator=g)
    (x if where == "x" else y)[PIECE + 4] = value
    for n in (1, 3):
        block = _with_threads(n, lambda: moments.parts([x, torch.ones(5)], [y, torch.zeros(5)]))
        _assert_reference(block[0, 0].tolist(), x - y)
        _assert_reference(block[0, 1].tolist(), x)
        _assert_reference(block[0, 2].tolist(), y)
        _assert_reference(block[1, 0].tolist(), torch.ones(5))
        _assert_reference(block[1, 2].tolist(), torch.zeros(5))
        clean = block[0, 1] if where == "y" else block[0, 2]
        assert math.isfinite(clean[0].item())


def test_two_python_threads_calling_at_once_equal_single_threaded_calls_bit_for_bit() -> None:
    """ctypes releases the GIL: two Python threads run the kernel (each on torch's OpenMP
    threads) at the same time on different tensors; every result equals the same call made
    alone on one thread."""
    work = [(_mixed(10 + i), _mixed(20 + i)) for i in range(2)]
    alone = _with_threads(1, lambda: [(moments.moments(a), moments.parts(a, b)) for a, b in work])
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def call(i: int) -> None:
        try:
            start.wait(timeout=30)
            a, b = work[i]
            for _ in range(6):
                results[i].append((moments.moments(a), moments.parts(a, b)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        torch.set_num_threads(before)
    assert errors == []
    for i in range(2):
        assert len(results[i]) == 6
        for rows, parts in results[i]:
            assert torch.equal(rows, alone[i][0])
            assert torch.equal(parts, alone[i][1])


def test_a_forked_child_on_one_thread_runs_the_kernel_after_threaded_calls_in_the_parent() -> None:
    """GNU OpenMP's pool does not survive fork: a forked child that uses it hangs, for torch's
    own parallel ops as for the kernel. A child on one thread (as torch's DataLoader workers
    set) must run the kernel and get the parent's numbers bit for bit. The child exits by
    SIGALRM rather than hang."""
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from tmetrics_core.kernels import moments
        torch.set_num_threads(2)
        t = torch.randn(4 * (1 << 16) + 3, generator=torch.Generator().manual_seed(0))
        want = moments.moments([t])
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            torch.set_num_threads(1)
            got = moments.moments([t])
            os._exit(0 if torch.equal(got, want) else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
