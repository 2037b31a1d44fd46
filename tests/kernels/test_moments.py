"""The fused moments kernel against float64 references, and the statistics it feeds against
their torch kernels on the same tensors (NaN, infinities, signed zeros, empty, piece edges)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._pytree import tree_map

from tmetrics_core.topology import Topology
from tmetrics_core.kernels import moments
from tmetrics_core.metrics.statistics import ABSMAX, MAX, MIN, NONFINITE, SUM, SUMSQ, ZEROS
from tmetrics_core.site import Site

PIECE = 1 << 16
SIZES = (0, 1, 15, 16, 17, 1000, PIECE - 1, PIECE + 3, 4 * PIECE + 7)  # the last: threaded


def _reference(t: torch.Tensor) -> list[float]:
    x = t.double().reshape(-1)
    kept = x[~torch.isnan(x)]
    return [float(x.pow(2).sum()), float(x.sum()), float(kept.max()) if kept.numel() else -math.inf,
            float(kept.min()) if kept.numel() else math.inf, float((x == 0).sum())]


def _tensor(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 3
    if n > 4:
        t[:: max(1, n // 7)] = 0.0
        t[1] = -0.0
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_moments_match_float64_reference(dtype: torch.dtype, threads: int) -> None:
    tensors = [_tensor(n, i, dtype) for i, n in enumerate(SIZES)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = moments.moments(tensors)
    finally:
        torch.set_num_threads(before)
    assert rows.shape == (len(SIZES), 5) and rows.dtype == torch.float64
    for t, row in zip(tensors, rows.tolist()):
        ref = _reference(t)
        assert row[0] == pytest.approx(ref[0], rel=1e-12, abs=1e-12)
        assert row[1] == pytest.approx(ref[1], rel=1e-9, abs=1e-9)
        assert row[2:] == ref[2:]


def test_the_thread_count_does_not_change_a_bit() -> None:
    """Pieces are merged in their order whichever thread read them: one and two threads agree
    bit for bit (moments, parts and row softmax sums), on a call large enough to go parallel."""
    tensors = [_tensor(n, i, torch.float32) for i, n in enumerate(SIZES)]
    others = [_tensor(n, 50 + i, torch.float32) for i, n in enumerate(SIZES)]
    tables = [torch.randn(700, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    assert sum(t.numel() for t in tensors) >= moments._PARALLEL
    assert sum(t.numel() for t in tables) >= moments._PARALLEL // 16
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append((moments.moments(tensors), moments.parts(tensors, others),
                        moments.row_softmax_sums(tables, [8] * 6, [False] * 6)))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*got):
        assert torch.equal(one, two)


def test_moments_of_a_difference_without_materializing_it() -> None:
    a, b = _tensor(PIECE + 5, 1, torch.float32), _tensor(PIECE + 5, 2, torch.float32)
    rows = moments.moments([a, b], [b, None])
    assert rows[0].tolist()[0] == pytest.approx(_reference(a - b)[0], rel=1e-12)
    assert rows[0].tolist()[2:] == _reference(a - b)[2:]
    assert rows[1].tolist()[0] == pytest.approx(_reference(b)[0], rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_parts_are_the_moments_of_the_difference_and_of_each_tensor_bit_for_bit(dtype: torch.dtype,
                                                                                 threads: int) -> None:
    """One read of each pair gives the rows of x - y, x and y, equal to three separate passes
    (bfloat16 differences widened to float32 in both), across piece edges and the threaded path."""
    xs = [_tensor(n, i, dtype) for i, n in enumerate(SIZES)]
    ys = [_tensor(n, 100 + i, dtype) for i, n in enumerate(SIZES)]
    xs[3][5], ys[3][7], xs[4][2], ys[5][3] = float("nan"), float("inf"), float("-inf"), float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = moments.parts(xs, ys)
        want = torch.stack([moments.moments(xs, ys), moments.moments(xs), moments.moments(ys)], dim=1)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (len(SIZES), 3, 5) and got.dtype == torch.float64
    assert torch.equal(got.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
    assert torch.isnan(got[3, 0, 0]) and torch.isnan(got[3, 1, 0]) and got[3, 2, 0] == math.inf
    assert got[5, 0:3:2, 0].isnan().all() and not got[5, 1, 0].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_sums_of_squares_alone_have_the_bits_of_full_rows(dtype: torch.dtype, threads: int) -> None:
    """``sumsq_only`` computes the sum of squares with the same bits as a full row (plain,
    difference and parts passes; NaN and infinities, empty tensors, piece edges, threads) and
    leaves NaN in every other column, so a statistic that read one would show NaN."""
    xs = [_tensor(n, i, dtype) for i, n in enumerate(SIZES)]
    ys = [_tensor(n, 100 + i, dtype) for i, n in enumerate(SIZES)]
    xs[3][5], ys[3][7], xs[4][2] = float("nan"), float("inf"), float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = [(moments.moments(xs, sumsq_only=True), moments.moments(xs)),
                 (moments.moments(xs, ys, sumsq_only=True), moments.moments(xs, ys)),
                 (moments.parts(xs, ys, sumsq_only=True), moments.parts(xs, ys))]
    finally:
        torch.set_num_threads(before)
    for squares, full in pairs:
        assert squares.shape == full.shape and squares.dtype == torch.float64
        assert torch.equal(squares[..., 0].nan_to_num(nan=7.0), full[..., 0].nan_to_num(nan=7.0))
        assert squares[..., 1:].isnan().all()
    assert moments.sumsq_suffices([SUMSQ, NONFINITE]) and not moments.sumsq_suffices([SUMSQ, ABSMAX])
    assert not any(moments.sumsq_suffices([stat]) for stat in (SUM, MAX, MIN, ZEROS))


def test_rows_written_into_a_larger_buffer_equal_fresh_rows() -> None:
    """``out``: calls write their rows into slices of one buffer (the observer's rows of a step),
    the same numbers as fresh outputs; a buffer of the wrong shape or dtype is refused."""
    xs = [_tensor(n, i, torch.float32) for i, n in enumerate((1000, PIECE + 3))]
    ys = [_tensor(n, 50 + i, torch.float32) for i, n in enumerate((1000, PIECE + 3))]
    buffer = torch.full((10, 5), -1.0, dtype=torch.float64)
    moments.parts(xs[:1], ys[:1], out=buffer[1:4])
    moments.moments(xs[1:], ys[1:], sumsq_only=True, out=buffer[4:5])
    assert torch.equal(buffer[1:4].nan_to_num(7.0), moments.parts(xs[:1], ys[:1])[0].nan_to_num(7.0))
    assert torch.equal(buffer[4:5].nan_to_num(7.0), moments.moments(xs[1:], ys[1:], sumsq_only=True).nan_to_num(7.0))
    assert (buffer[0] == -1.0).all() and (buffer[5:] == -1.0).all()
    for wrong in (buffer[0:2], buffer[1:4].float(), buffer[1:4, :3]):
        with pytest.raises(ValueError, match="out must be a contiguous CPU float64 tensor"):
            moments.parts(xs[:1], ys[:1], out=wrong)


def test_rows_written_at_a_row_of_a_buffer_equal_fresh_rows() -> None:
    """``write_rows``: the rows of ``moments`` and ``parts`` written from a given row of one
    buffer, nothing else touched; a buffer without room from that row, or of the wrong dtype or
    width, is refused before anything is read, as is a pair list with a missing tensor."""
    xs = [_tensor(n, i, torch.float32) for i, n in enumerate((1000, PIECE + 3))]
    ys = [_tensor(n, 50 + i, torch.float32) for i, n in enumerate((1000, PIECE + 3))]
    buffer = torch.full((10, 5), -1.0, dtype=torch.float64)
    moments.write_rows(buffer, 1, xs, ys, parts=True)
    moments.write_rows(buffer, 7, xs[1:], [None], sumsq_only=True)
    moments.write_rows(buffer, 8, xs[:1], ys[:1])
    assert torch.equal(buffer[1:7].nan_to_num(7.0), moments.parts(xs, ys).flatten(0, 1).nan_to_num(7.0))
    assert torch.equal(buffer[7:8].nan_to_num(7.0), moments.moments(xs[1:], sumsq_only=True).nan_to_num(7.0))
    assert torch.equal(buffer[8:9], moments.moments(xs[:1], ys[:1]))
    assert (buffer[0] == -1.0).all() and (buffer[9] == -1.0).all()
    for wrong, at in ((buffer, 5), (buffer, -1), (buffer.float(), 0), (buffer[:, :3], 0)):
        with pytest.raises(ValueError, match="out must be a contiguous CPU float64 tensor"):
            moments.write_rows(wrong, at, xs, ys, parts=True)
    with pytest.raises(ValueError, match="a tensor to subtract for every tensor"):
        moments.write_rows(buffer, 0, xs, [ys[0], None], parts=True)
    for wrong_at in (1.0, True, torch.tensor(1.5)):
        with pytest.raises(ValueError, match="at must be an integer row index"):
            moments.write_rows(buffer, wrong_at, xs[:1], ys[:1])  # type: ignore[arg-type]
    before = buffer.clone()
    refused = [([xs[0].half()], None, False), ([xs[0]], [ys[0].bfloat16()], False), ([xs[0]], [ys[1]], True),
               ([xs[1][:64].reshape(8, 8).t()], None, False), ([xs[0], xs[1]], [None, ys[0]], False)]
    for tensors, minus, parts in refused:  # what moments() refuses: False, nothing written, no exception
        assert moments.write_rows(buffer, 0, tensors, minus, parts=parts) is False
    assert torch.equal(buffer.nan_to_num(7.0), before.nan_to_num(7.0))


def test_pairs_are_checked_as_pairs() -> None:
    """A list of pairs (every tensor subtracts one, read in one call of the C++ reader) is
    refused when a pair differs in size or dtype, or when one side is not taken."""
    a, b = torch.zeros(4), torch.zeros(5)
    for minus in ([a, b], [b, a], [a, torch.zeros(4, dtype=torch.bfloat16)], [a, torch.zeros(2, 2).t()]):
        with pytest.raises(ValueError, match="minus must match"):
            moments.parts([a, a], minus)
    with pytest.raises(ValueError, match="contiguous CPU"):
        moments.parts([a, torch.zeros(4, dtype=torch.float64)], [a, a])
    rows = moments.parts([torch.arange(4.0), torch.ones(3)], [torch.ones(4), torch.zeros(3)])
    assert rows[:, 0, 0].tolist() == [6.0, 3.0]


def test_parts_need_a_tensor_to_subtract_for_every_tensor() -> None:
    with pytest.raises(ValueError, match="moments\\(\\) for single tensors"):
        moments.parts([torch.ones(3)], [None])  # type: ignore[list-item]


def test_nan_and_infinity_show_in_the_sum_of_squares() -> None:
    nan = torch.tensor([1.0, float("nan"), -3.0])
    inf = torch.tensor([1.0, float("-inf"), 2.0])
    rows = moments.moments([nan, inf]).tolist()
    assert math.isnan(rows[0][0]) and rows[0][2:4] == [1.0, -3.0]
    assert rows[1][0] == math.inf and rows[1][3] == -math.inf


def test_squares_of_large_values_do_not_overflow() -> None:
    big = torch.full((5,), 1e30)  # the fp32 square overflows; the kernel squares in float64
    assert moments.moments([big])[0, 0].item() == pytest.approx(5 * float(big[0]) ** 2, rel=1e-12)


def test_tensors_the_kernel_does_not_take_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="contiguous CPU float32/bfloat16"):
        moments.moments([torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="contiguous CPU"):
        moments.moments([torch.zeros(4, 4).t()])
    with pytest.raises(ValueError, match="minus must match"):
        moments.moments([torch.zeros(4)], [torch.zeros(5)])
    with pytest.raises(ValueError, match="minus must match"):  # same count, another dtype
        moments.moments([torch.zeros(4)], [torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="minus must match"):  # some tensors subtract nothing
        moments.moments([torch.zeros(4), torch.zeros(3)], [None, torch.zeros(4)])
    x, y = torch.arange(4.0), torch.ones(4)
    rows = moments.moments([x, x], [None, y])  # x alone, then x - y
    assert rows[:, 0].tolist() == [14.0, 6.0] and rows[:, 1].tolist() == [6.0, 2.0]


def _sites(tensors: list[torch.Tensor]) -> list[Site]:
    return [Site(f"t{i}", "param", tuple(t.shape)) for i, t in enumerate(tensors)]


def _awkward() -> list[torch.Tensor]:
    """Tensors the statistics meet: finite, NaN, +-inf, empty, all zeros, bf16, and ones the
    kernel does not take (float64, float16, non-contiguous) mixed in the same call."""
    base = _tensor(70_000, 3, torch.float32)
    with_nan = base.clone()
    with_nan[5] = float("nan")
    with_inf = base.clone()
    with_inf[7], with_inf[9] = float("inf"), float("-inf")
    return [base, with_nan, with_inf, torch.empty(0), torch.zeros(33), _tensor(999, 4, torch.bfloat16),
            _tensor(100, 5, torch.float64), _tensor(100, 6, torch.float16),
            _tensor(64, 7, torch.float32).reshape(8, 8).t()]


@pytest.mark.parametrize("stat", [SUMSQ, SUM, ABSMAX, MAX, MIN, NONFINITE, ZEROS], ids=lambda s: s.name)
def test_statistics_through_the_kernel_equal_their_torch_kernels(stat) -> None:
    tensors = _awkward()
    sites, topology = _sites(tensors), Topology.single_process()
    memo: dict = {}
    fused = moments.statistic_vectors(stat, tensors, sites, topology, memo)
    taken = [key for key, row in moments.rows_of(memo).items() if row is not None]
    assert len(taken) == 6  # every tensor the kernel takes, read once
    with moments.disabled():
        plain = moments.statistic_vectors(stat, tensors, sites, topology, {})
    for site, a, b in zip(sites, fused, plain):
        assert a.dtype == torch.float64 and a.shape == b.shape, site.name
        # The torch kernels accumulate fp32 per chunk; the fused kernel in float64.
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0.0, equal_nan=True, msg=site.name)


def test_without_a_compiler_statistics_fall_back_and_say_so(tmp_path) -> None:
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from tmetrics_core.topology import Topology
        from tmetrics_core.kernels import moments
        from tmetrics_core.metrics.statistics import SUMSQ
        from tmetrics_core.site import Site
        t = torch.arange(10.0)
        out = moments.statistic_vectors(SUMSQ, [t], [Site("t", "param", (10,))], Topology.single_process(), {})
        print("available", moments.available(), "sumsq", float(out[0]))
    """)
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), TMETRICS_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "available False sumsq 285.0" in done.stdout
    assert "fused moments kernel unavailable" in done.stderr and "results are the same" in done.stderr


class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass (as float8 or NF4 weights are): no data pointer of its own."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, _Wrapped) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_wrapper_subclasses_and_lazy_negations_go_to_the_torch_kernels() -> None:
    inner = _tensor(1000, 8, torch.float32)
    wrapped, negated = _Wrapped(inner), torch._neg_view(inner)
    assert not moments.takes(wrapped) and not moments.takes(negated) and moments.takes(inner)
    sites, memo = _sites([wrapped, negated]), {}
    got = moments.statistic_vectors(SUMSQ, [wrapped, negated], sites, Topology.single_process(), memo)
    assert moments.rows_of(memo) and all(row is None for row in moments.rows_of(memo).values())
    for vec in got:
        assert vec.item() == pytest.approx(_reference(inner)[0], rel=1e-6)  # fp32 torch kernels


def test_torch_kernels_on_cpu_do_not_overflow_where_the_kernel_does_not() -> None:
    big = torch.full((5,), 1e30)
    sites, topology = _sites([big]), Topology.single_process()
    with moments.disabled():
        (sumsq,) = moments.statistic_vectors(SUMSQ, [big], sites, topology, {})
        (total,) = moments.statistic_vectors(SUM, [torch.full((4,), 3e38)], sites, topology, {})
    assert sumsq.item() == pytest.approx(5 * float(big[0]) ** 2, rel=1e-12)
    assert total.item() == pytest.approx(4 * float(torch.tensor(3e38)), rel=1e-12)
