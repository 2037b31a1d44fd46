"""The update snapshot: exact copies of the selected parameters, one flat buffer read by address
where the kernel takes every tensor, torch copies otherwise; a mapping the general path may pop
and change in place."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.kernels import moments
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
        self.a = torch.nn.Parameter(torch.randn(300, 700, generator=g).to(dtype))  # several kernel pieces
        self.b = torch.nn.Parameter(torch.randn(17, generator=g).bfloat16())     # odd byte size: aligned next
        self.c = torch.nn.Parameter(torch.randn(5, 3, generator=g).to(dtype))
        self.empty = torch.nn.Parameter(torch.zeros(0))
        with torch.no_grad():
            self.c[0, 0], self.c[0, 1], self.c[0, 2] = -0.0, float("nan"), float("-inf")


def test_copies_are_exact_views_of_one_buffer_made_when_looked_up() -> None:
    model = Mixed()
    manifest = _manifest(model)
    snap = snapshot(manifest, ["a", "b", "c", "empty"])
    assert isinstance(snap, Snapshot) and len(snap) == 4 and set(snap) == {"a", "b", "c", "empty"}
    held = snap.held(["a", "b", "c", "empty"])
    assert held is not None and list(held.numels) == [300 * 700, 17, 15, 0]
    assert all(address % 64 == 0 for address in held.addresses)
    assert held.dtypes == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    head, picked = snap.held(["a", "b"]), snap.held(["c", "a"])  # a prefix of the copy order; any order
    assert head is not None and list(head.addresses) == list(held.addresses[:2]) and head.owner is held.owner
    assert picked is not None and list(picked.addresses) == [held.addresses[2], held.addresses[0]]
    assert picked.dtypes == [torch.float32, torch.float32] and list(picked.numels) == [15, 300 * 700]
    a_before = model.a.detach().clone()
    with torch.no_grad():
        model.a.add_(1.0)  # the optimizer step: the snapshot keeps the values before it
    stepped = moments.parts([model.a, model.c], snap.held(["a", "c"]))
    direct = moments.parts([model.a, model.c], [snap["a"], snap["c"]])
    assert torch.equal(stepped.nan_to_num(7.0), direct.nan_to_num(7.0))
    assert stepped[0, 0, 0].item() == pytest.approx(300 * 700, rel=1e-5)  # the update: +1 everywhere
    assert torch.equal(_bits(snap["c"]), _bits(model.c.detach())) and snap["b"].dtype == torch.bfloat16
    assert torch.equal(_bits(snap["a"]), _bits(a_before))
    assert snap.held(["a"]) is None  # copies were handed out: they may have been changed in place


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


@pytest.mark.parametrize("kind", ["float64", "non-contiguous", "kernel off"])
def test_tensors_the_kernel_does_not_take_are_copied_by_torch(kind: str) -> None:
    model = Mixed(torch.float64 if kind == "float64" else torch.float32)
    if kind == "non-contiguous":
        model.a.data = model.a.data.t()
    manifest = _manifest(model)
    if kind == "kernel off":
        with moments.disabled():
            snap = snapshot(manifest, ["a", "c"])
    else:
        snap = snapshot(manifest, ["a", "c"])
    assert snap.held(["a", "c"]) is None  # no flat buffer: the program leaves it to the general path
    assert torch.equal(_bits(snap["c"]), _bits(model.c.detach()))
    assert snap["a"].stride() == model.a.stride() and torch.equal(snap["a"], model.a.detach())


def test_a_pristine_snapshot_lends_its_buffer_to_the_next_one() -> None:
    """The next due step writes into the buffer of the last one (no fresh memory, no page faults)
    only when no copy of it was handed out; its copies are exact all the same."""
    model = Mixed()
    manifest = _manifest(model)
    first = snapshot(manifest, ["a", "c"])
    spare = first.spare()
    assert spare is not None
    with torch.no_grad():
        model.a.add_(1.0)
    second = snapshot(manifest, ["a", "c"], spare)
    held = second.held(["a", "c"])
    assert held is not None and held.owner is spare and held.addresses[0] == spare.data_ptr()
    assert torch.equal(_bits(second["a"]), _bits(model.a.detach()))
    assert second.spare() is None  # a copy was handed out: it may be read or changed elsewhere
    small = snapshot(manifest, ["c"], torch.empty(8, dtype=torch.uint8))  # too small: fresh memory
    assert torch.equal(_bits(small["c"]), _bits(model.c.detach()))
