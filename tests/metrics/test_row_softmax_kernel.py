"""The row softmax kernel against the torch path it stands in for (softmax.py), in float64."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.topology import Topology
from tmetrics_core.kernels import moments
from tmetrics_core.metrics.softmax import RowSoftmax, _finished, _probability_rows, _row_parts, _summed
from tmetrics_core.site import Site


def _torch_path(table: torch.Tensor, classes: int, probabilities: bool) -> torch.Tensor:
    if probabilities:
        return _summed(*_probability_rows(table), classes)
    return _finished(*_row_parts(table, False), classes)


def _awkward_logits() -> torch.Tensor:
    torch.manual_seed(3)
    x = torch.randn(257, 6) * 20
    x[1, 2] = -math.inf          # one impossible class: weighs nothing
    x[2, :5] = -math.inf         # a one-hot row
    x[3, 0] = 80.0               # exp(z - m) underflows for the others
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probabilities", [False, True])
def test_kernel_matches_the_torch_path(dtype: torch.dtype, probabilities: bool) -> None:
    logits = _awkward_logits()
    table = (torch.softmax(logits, 1) if probabilities else logits).to(dtype)
    if probabilities:
        table[4, 1] = 0.0  # entr(0) = 0
    for classes in (table.shape[1], 1000):  # the normalizer uses the logical class count
        got = moments.row_softmax_sums([table], [classes], [probabilities])[0]
        want = _torch_path(table, classes, probabilities)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rows_with_nan_or_positive_infinity_make_the_sums_nan_like_torch() -> None:
    for bad in (math.nan, math.inf):
        x = torch.randn(8, 4)
        x[5, 1] = bad
        got = moments.row_softmax_sums([x], [4], [False])[0]
        want = _torch_path(x, 4, False)
        assert got[5].item() == 8 and want[5].item() == 8
        assert torch.isnan(got[1:5]).all() and torch.isnan(want[1:5]).all()
    all_minus_inf = torch.full((2, 3), -math.inf)
    assert torch.isnan(moments.row_softmax_sums([all_minus_inf], [3], [False])[0][1:5]).all()


def test_one_class_has_no_normalized_entropy_and_several_tables_go_in_one_call() -> None:
    tables = [torch.randn(5, 1), torch.randn(7, 3), torch.softmax(torch.randn(9, 4), 1)]
    got = moments.row_softmax_sums(tables, [1, 3, 4], [False, False, True])
    assert got.shape == (3, 6) and math.isnan(got[0, 2].item())
    for row, table, classes, prob in zip(got, tables, [1, 3, 4], [False, False, True]):
        torch.testing.assert_close(row, _torch_path(table, classes, prob), rtol=1e-12, atol=1e-12, equal_nan=True)


def test_large_or_non_contiguous_tables_are_left_to_torch() -> None:
    assert moments.row_softmax_sums([torch.randn(moments.SMALL_TABLE + 1, 1)], [1], [False]) is None
    assert moments.row_softmax_sums([torch.randn(4, 6).t()], [4], [False]) is None
    assert moments.row_softmax_sums([torch.randn(4, 6, dtype=torch.float64)], [6], [False]) is None
    with moments.disabled():
        assert moments.row_softmax_sums([torch.randn(4, 6)], [6], [False]) is None


def test_the_statistic_gives_the_same_vectors_with_and_without_the_kernel() -> None:
    topology = Topology.single_process()
    stat = RowSoftmax(frozenset({"router_scores"}))
    sites = [Site(name=f"layers.{i}.moe.router", kind=kind, logical_shape=(-1, 4), dtype="float32", placements=(),
                  layer=i) for i, kind in enumerate(["router_logits", "router_scores", "router_logits"])]
    tables = [torch.randn(33, 4), torch.softmax(torch.randn(17, 4), 1), torch.empty(0, 4)]
    fused = stat.compute(tables, sites, topology)
    with moments.disabled():
        plain = stat.compute(tables, sites, topology)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
