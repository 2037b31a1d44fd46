"""The row softmax kernel gives what the torch path gives on every edge row: each of the six
finished sums, NaN for NaN and the same infinities, for logits and probabilities, float32 and
bfloat16, over every one- and two-entry row drawn from zeros of both signs, subnormals, the
float32 extremes, values whose exponentials under- or overflow, infinities and NaN."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tmetrics_core.kernels import moments
from tmetrics_core.metrics.softmax import (
    _finished,
    _probability_rows,
    _row_parts,
    _summed,
)

EDGES = [0.0, -0.0, 1.0, -1.0, 0.25, 1e-30, 1e-45, 3e38, -3e38, 88.0, -104.0, 700.0, math.inf, -math.inf, math.nan]


def _torch_path(table: torch.Tensor, classes: int, probabilities: bool) -> torch.Tensor:
    if probabilities:
        return _summed(*_probability_rows(table), classes)
    return _finished(*_row_parts(table, False), classes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probabilities", [False, True], ids=["logits", "probabilities"])
def test_every_edge_row_gives_the_torch_sums(dtype: torch.dtype, probabilities: bool) -> None:
    rows = [combo for width in (1, 2) for combo in itertools.product(EDGES, repeat=width)]
    tables = [torch.tensor([row], dtype=torch.float32).to(dtype) for row in rows]
    got = moments.row_softmax_sums(tables, [2] * len(tables), [probabilities] * len(tables))
    assert got is not None
    for row, table, sums in zip(rows, tables, got):
        want = _torch_path(table, 2, probabilities)
        torch.testing.assert_close(sums, want, rtol=1e-12, atol=0, equal_nan=True, msg=lambda m, row=row: f"{row}: {m}")


def test_edge_rows_among_ordinary_ones_spoil_only_their_own_table() -> None:
    """One call of many tables: a NaN row makes its table's sums NaN, the next tables keep theirs."""
    torch.manual_seed(0)
    tables = [torch.randn(9, 3), torch.randn(4, 3), torch.softmax(torch.randn(5, 3), 1), torch.randn(6, 3)]
    tables[1][2, 0] = math.nan
    tables[2][1] = 0.0  # a probability row summing to 0: its entropy is 0/0
    got = moments.row_softmax_sums(tables, [3] * 4, [False, False, True, False])
    for sums, table, prob in zip(got, tables, [False, False, True, False]):
        torch.testing.assert_close(sums, _torch_path(table, 3, prob), rtol=1e-12, atol=1e-12, equal_nan=True)
    assert math.isnan(got[1, 1]) and math.isnan(got[2, 1]) and got[2, 3] == -math.inf  # log of a zero sum
    assert all(math.isfinite(v) for v in got[[0, 3], 1:].reshape(-1).tolist())
