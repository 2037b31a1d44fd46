"""Property sweep on the in-process simulation: every placement, every metric of the core set,
equal to the unsharded float64 reference (relative 1e-6 for fp32; bf16 accumulates in fp32)."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.placement_cases import Case, TensorCase, assert_matches, mean_scale, reference, run_case
from tests.simulation import run_threaded, sim_topology

MESHES = [((1,), ("dp",)), ((2,), ("tp",)), ((4,), ("fsdp",)), ((2, 2), ("dp", "tp"))]


@st.composite
def specs_for(draw, ndim: int, shape: tuple[int, ...], mesh: tuple[int, ...]):
    specs = []
    flat_used = False
    for n in mesh:
        choices = ["R", "O", "P"] if flat_used else ["R", "S", "F", "O", "P", "S*"]
        kind = draw(st.sampled_from(choices))
        if kind == "S" and ndim:
            specs.append(("S", draw(st.integers(0, ndim - 1))))
        elif kind == "S*" and ndim:
            specs.append(("S", None))
        elif kind == "F":
            cuts = sorted(draw(st.lists(st.floats(0, 1), min_size=n - 1, max_size=n - 1)))
            specs.append(("F", tuple([0.0] + cuts + [1.0])))
            flat_used = True
        elif kind == "O":
            specs.append(("O", draw(st.integers(0, n - 1))))
        elif kind == "P":
            specs.append(("P", draw(st.sampled_from(["sum", "max"]))))
        else:
            specs.append(("R",))
    return tuple(specs)


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    count = draw(st.integers(1, 5))
    tensors = []
    for i in range(count):
        ndim = draw(st.integers(1, 3))
        tshape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        seed = draw(st.integers(0, 2**16))
        full = torch.randn(tshape, generator=torch.Generator().manual_seed(seed))
        tensors.append(TensorCase(f"layers.{i % 2}.t{i}", i % 2, full, draw(specs_for(ndim, tshape, shape)), seed))
    return Case(shape, names, tensors)


def _rank(rank, world, comm, case):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_sharded_equals_unsharded(case):
    world = math.prod(case.shape)
    results = run_threaded(_rank, world, case)
    want = reference(case)
    for got in results:
        assert_matches(got, want, atol_by_metric=mean_scale(case))


def test_bf16_accumulates_in_fp32():
    # 2**16 bf16 values of 256: their fp16/bf16 sum of squares would overflow or round away.
    full = torch.full((256, 256), 256.0, dtype=torch.bfloat16)
    case = Case((2, 2), ("dp", "tp"), [TensorCase("layers.0.w", 0, full, (("S", 0), ("S", 1)))])
    results = run_threaded(_rank, 4, case)
    want = reference(case)
    for got in results:
        assert_matches(got, want, rtol=1e-6, atol_by_metric=mean_scale(case))
