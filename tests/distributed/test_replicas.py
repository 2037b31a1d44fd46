"""Replica fingerprints (single process): equal tensors give equal rows bit for bit, permuted
pieces and one changed element do not, and empty or absent tensors have rows of their own."""

from __future__ import annotations

import torch

from tmetrics_core.distributed.replicas import FINGERPRINT, fingerprints

CPU = torch.device("cpu")


def test_columns_are_presence_sums_and_position_weighted_sums():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (row,) = fingerprints([t], CPU).tolist()
    # rows sum to 3 and 7 (weights 1, 2), columns to 4 and 6 (weights 1, 2)
    assert dict(zip(FINGERPRINT, row)) == {"present": 1.0, "sum": 10.0, "sumsq": 30.0,
                                           "row-weighted": 17.0, "column-weighted": 16.0}


def test_permuted_rows_or_columns_differ_and_equal_copies_do_not():
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    rows = fingerprints([t, t.clone(), t.flip(0), t.flip(1)], CPU)
    assert torch.equal(rows[0], rows[1])
    assert abs(rows[0, 2] - rows[2, 2]) < 1e-9  # the same values: the plain sums cannot tell
    assert rows[0, 3] != rows[2, 3] and rows[0, 4] != rows[3, 4]


def test_one_changed_element_changes_the_row():
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    drifted = t.clone()
    drifted[17, 3] = torch.nextafter(drifted[17, 3], torch.tensor(float("inf")))
    a, b = fingerprints([t, drifted], CPU)
    assert not torch.equal(a, b)


def test_empty_absent_and_scalar_tensors():
    rows = fingerprints([torch.empty(0, 4), None, torch.tensor(3.0)], CPU).tolist()
    assert rows == [[1.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 5, [1.0, 3.0, 9.0, 3.0, 3.0]]
    assert fingerprints([], CPU).shape == (0, 5)
