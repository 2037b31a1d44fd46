"""Rows from batched torch ops against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.kernels import rows as rows_module
from tmetrics_core.kernels.rows import nonfinite_counts, rows, spaced


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 7, generator=g), torch.randn(33, generator=g).bfloat16(), torch.empty(0),
            torch.randn(4, 6, generator=g).t(), torch.randn(9, generator=g, dtype=torch.float64),
            torch.tensor([0.0, 1.5, -2.0, 0.0]).half(), torch.tensor([-0.0, 3.0])]


def _reference(t: torch.Tensor) -> list[float]:
    x = t.double()
    if not x.numel():
        return [0.0, 0.0, -math.inf, math.inf, 0.0]
    return [x.pow(2).sum().item(), x.sum().item(), x.max().item(), x.min().item(), float((x == 0).sum())]


def test_every_column_of_mixed_dtypes_layouts_and_empties_equals_float64():
    ts = _tensors()
    got = rows(ts)
    assert got.dtype == torch.float64 and got.shape == (len(ts), 5)
    for i, t in enumerate(ts):
        for column, (a, b) in enumerate(zip(got[i].tolist(), _reference(t))):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12), (i, column)


def test_only_the_columns_asked_for_are_computed():
    ts = _tensors()
    squares = rows(ts, {"sumsq"})
    assert torch.isnan(squares[:, 1:]).all() and torch.equal(squares[:, 0], rows(ts)[:, 0])
    peaks = rows(ts, {"absmax"})
    absmax = [max(abs(r[2]), abs(r[3])) if t.numel() else 0.0 for t, r in zip(ts, map(_reference, ts))]
    assert peaks[:, 2].tolist() == absmax and peaks[:, 3].tolist() == [-a for a in absmax]
    with pytest.raises(ValueError, match="unknown moments columns"):
        rows(ts, {"mean"})


def test_a_group_above_the_temporary_budget_is_copied_in_parts(monkeypatch):
    ts = [t for t in _tensors() if t.dtype == torch.float32] * 3
    whole, peaks = rows(ts), rows(ts, {"absmax"})[:, 2:4]
    monkeypatch.setattr(rows_module, "TEMPORARY", 40)  # parts of at most 40 elements, or one tensor
    assert len(rows_module._parts(tuple(t.numel() for t in ts), 40)) > 3
    assert torch.equal(rows(ts), whole) and torch.equal(rows(ts, {"absmax"})[:, 2:4], peaks)
    for i, t in enumerate(ts):
        for a, b in zip(whole[i].tolist(), _reference(t)):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_non_finite_counts_per_tensor():
    ts = [torch.tensor([1.0, math.nan, math.inf, -math.inf, math.nan]), torch.randn(3), torch.arange(4),
          torch.tensor([math.inf]).bfloat16(), torch.empty(0)]
    assert nonfinite_counts(ts).tolist() == [[2, 1, 1], [0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0]]
    # The largest finite values are finite; a mixed group of dtypes keeps each tensor's row.
    edge = [torch.tensor([torch.finfo(d).max, -torch.finfo(d).max, math.nan, -math.inf], dtype=d)
            for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    assert nonfinite_counts(edge).tolist() == [[1, 0, 1]] * 4


def test_non_finite_counts_in_parts_equal_the_counts_of_the_whole_group(monkeypatch):
    ts = [torch.tensor([1.0, math.nan, math.inf]), torch.tensor([-math.inf] * 5 + [0.0] * 3),
          torch.full((7,), math.nan), torch.randn(6)] * 3
    want = [[1, 1, 0], [0, 0, 5], [7, 0, 0], [0, 0, 0]] * 3
    assert nonfinite_counts(ts).tolist() == want
    monkeypatch.setattr(rows_module, "TEMPORARY", 8)  # parts of at most 8 elements, or one tensor
    assert len(rows_module._parts(tuple(t.numel() for t in ts), 8)) > 6
    assert nonfinite_counts(ts).tolist() == want


def test_a_real_maximum_or_minimum_is_computed_alone_and_both_beside_absmax():
    t = [torch.tensor([-3.0, 2.0]), torch.tensor([0.5, -0.25])]
    only_max, only_min = rows(t, {"max"}), rows(t, {"min"})
    assert only_max[:, 2].tolist() == [2.0, 0.5] and only_max[:, 3].isnan().all()
    assert only_min[:, 3].tolist() == [-3.0, -0.25] and only_min[:, 2].isnan().all()
    both = rows(t, {"absmax", "max"})  # absmax is read as max(max, -min): both are real
    assert both[:, 2].tolist() == [2.0, 0.5] and both[:, 3].tolist() == [-3.0, -0.25]


def test_evenly_spaced_indices_are_a_slice():
    assert spaced([0, 1, 2]) == slice(0, 3, 1) and spaced([1, 4, 7]) == slice(1, 8, 3) and spaced([5]) == slice(5, 6, 1)
    assert spaced([0, 2, 3]) is None and spaced([3, 2]) is None
