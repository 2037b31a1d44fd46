"""Replica fingerprints (single process): equal tensors give equal rows bit for bit, pieces
holding the same values in another order and one changed element do not, and empty or absent
tensors have rows of their own."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.distributed.replicas import FINGERPRINT, fingerprints

CPU = torch.device("cpu")


def test_columns_are_presence_moments_and_a_position_weighted_sample():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (row,) = fingerprints([t], CPU).tolist()
    # 64 evenly spaced positions over 4 elements, rounded: 0 for weights 1-11, 1 for 12-32, 2 for 33-53, 3 for 54-64
    weights = [sum(range(a, b + 1)) for a, b in ((1, 11), (12, 32), (33, 53), (54, 64))]
    assert dict(zip(FINGERPRINT, row)) == {"present": 1.0, "sum": 10.0, "sumsq": 30.0, "max": 4.0, "min": 1.0,
                                           "sampled": sum(w * v for w, v in zip(weights, (1.0, 2.0, 3.0, 4.0)))}


def test_reordered_values_differ_and_equal_copies_do_not():
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    rows = fingerprints([t, t.clone(), t.flip(0), t.flip(1)], CPU)
    assert torch.equal(rows[0], rows[1])
    assert rows[0, 5] != rows[2, 5] and rows[0, 5] != rows[3, 5]


def test_one_changed_element_changes_the_row():
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    drifted = t.clone()
    drifted[17, 3] = torch.nextafter(drifted[17, 3], torch.tensor(float("inf")))
    a, b = fingerprints([t, drifted], CPU)
    assert not torch.equal(a, b)


def test_empty_absent_and_scalar_tensors():
    rows = fingerprints([torch.empty(0, 4), None, torch.tensor(3.0)], CPU).tolist()
    assert rows == [[1.0, 0.0, 0.0, -math.inf, math.inf, 0.0], [0.0] * 6, [1.0, 3.0, 9.0, 3.0, 3.0, 3.0 * 64 * 65 / 2]]
    assert fingerprints([], CPU).shape == (0, 6)
