"""The update snapshot: exact copies of the selected parameters (one batched torch copy, any
dtype and layout); a mapping the parameter side reads and leaves unchanged."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.sources.snapshot import Snapshot, snapshot


def _manifest(model: torch.nn.Module) -> Manifest:
    """Only ``local`` is read by a snapshot."""
    return Manifest(entries=[], local=dict(model.named_parameters()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[t.dtype])


class Mixed(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(300, 700, generator=g).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(17, generator=g).bfloat16())
        self.c = torch.nn.Parameter(torch.randn(5, 3, generator=g).to(dtype))
        self.empty = torch.nn.Parameter(torch.zeros(0))
        with torch.no_grad():
            self.c[0, 0], self.c[0, 1], self.c[0, 2] = -0.0, float("nan"), float("-inf")


def test_copies_are_exact_and_keep_the_values_before_the_step() -> None:
    model = Mixed()
    manifest = _manifest(model)
    snap = snapshot(manifest, ["a", "b", "c", "empty"])
    assert isinstance(snap, Snapshot) and len(snap) == 4 and set(snap) == {"a", "b", "c", "empty"}
    a_before = model.a.detach().clone()
    with torch.no_grad():
        model.a.add_(1.0)  # the optimizer step: the snapshot keeps the values before it
    assert torch.equal(_bits(snap["c"]), _bits(model.c.detach())) and snap["b"].dtype == torch.bfloat16
    assert torch.equal(_bits(snap["a"]), _bits(a_before)) and snap["empty"].numel() == 0


def test_the_general_path_pops_and_overwrites_entries() -> None:
    model = Mixed()
    snap = snapshot(_manifest(model), ["a", "c"])
    c = snap.pop("c")
    assert "c" not in snap and len(snap) == 1 and torch.equal(_bits(c), _bits(model.c.detach()))
    snap["a"] = torch.zeros(1)
    assert dict(snap) == {"a": snap["a"]} and snap["a"].tolist() == [0.0]
    assert snap.pop("missing", None) is None
    with pytest.raises(KeyError):
        snap["c"]


@pytest.mark.parametrize("kind", ["float64", "non-contiguous"])
def test_float64_and_non_contiguous_parameters_are_copied_as_they_are(kind: str) -> None:
    model = Mixed(torch.float64 if kind == "float64" else torch.float32)
    if kind == "non-contiguous":
        model.a.data = model.a.data.t()
    snap = snapshot(_manifest(model), ["a", "c"])
    assert torch.equal(_bits(snap["c"]), _bits(model.c.detach()))
    assert snap["a"].stride() == model.a.stride() and torch.equal(snap["a"], model.a.detach())
