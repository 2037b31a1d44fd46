"""dp-replica-drift on 1, 2 and 4 simulated ranks: replicas that agree give 0, replicas that
differ everywhere or in one element per shard are counted and measured, whatever the tensor's
placement on the other axes."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import (
    MESHES,
    Case,
    MetricSpec,
    SiteCase,
    drift_replicas,
    local_view,
    run_case,
    tensor_specs,
)
from tests.simulation import mesh_coords, run_threaded, sim_topology
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.errors import PlacementError
from tmetrics_core.placements import Shard
from tmetrics_core.site import Site


@st.composite
def cases(draw):
    # Without a dp axis the metric is refused at start-up (test_refused_without_a_dp_axis).
    shape, names = draw(st.sampled_from([m for m in MESHES if "dp" in m[1] or math.prod(m[0]) == 1]))
    other_shape = tuple(s for s, n in zip(shape, names) if n != "dp")
    sites = []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 2))
        tshape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        inner = iter(draw(tensor_specs(ndim, other_shape, partial_ops=())))
        specs = tuple(("R",) if n == "dp" else next(inner) for n in names)
        full = torch.randint(-50, 50, tshape, generator=torch.Generator().manual_seed(i)).float()
        sites.append(SiteCase(f"layers.{i}.w", "param", full, specs, layer=i,
                              drift=draw(st.sampled_from(["", "everywhere", "first"]))))
    return Case(shape, names, sites), draw(st.sampled_from([None, 1, 7]))


def expected(case: Case) -> tuple[dict[str, float], float]:
    """Exact tensors-differing and max-sum-diff; the largest possible sampled-max-diff (the
    low end is the "everywhere" spread)."""
    world = math.prod(case.shape)
    replicas = dict(zip(case.names, case.shape)).get("dp", 1)
    differing, sum_diff, low, high = 0.0, 0.0, 0.0, 0.0
    for sc in case.sites:
        shards: dict[tuple, list[torch.Tensor]] = {}
        for rank in range(world):
            coords = mesh_coords(rank, case.shape)
            _, local = local_view(sc, coords, case)
            if local is None:
                continue
            local = drift_replicas(sc, dict(zip(case.names, coords)), local)
            key = tuple(c for c, n in zip(coords, case.names) if n != "dp")
            shards.setdefault(key, []).append(local)
        differs = False
        for copies in shards.values():
            sums = [c.sum(dtype=torch.float64).item() for c in copies]
            sum_diff = max(sum_diff, max(sums) - min(sums))
            differs |= any(not torch.equal(copies[0], c) for c in copies)
            if copies[0].numel() and replicas > 1:
                spread = (torch.stack(copies).max(0).values - torch.stack(copies).min(0).values).max().item()
                if sc.drift == "everywhere":
                    low = max(low, spread)
                high = max(high, spread)
        differing += differs
    return {"tensors-differing": differing, "max-sum-diff": sum_diff}, (low, high)


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs, perturb=drift_replicas)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_drift_counts_and_measures_replica_differences(drawn):
    case, sample = drawn
    exact, (low, high) = expected(case)
    spec = MetricSpec("dp-replica-drift", (("sample", sample),) if sample else ())
    for got in run_threaded(_rank, math.prod(case.shape), case, [spec]):
        values = {labels[3]: v for labels, v in got["dp-replica-drift"]}
        assert {k: values[k] for k in exact} == exact
        assert values["sampled-max-diff"] in (low, high) and low <= values["sampled-max-diff"] <= high


def test_agreeing_replicas_give_zero_and_sharded_sites_are_not_compared():
    metric = build_metric("dp-replica-drift")
    assert not metric.accepts(Site("layers.0.w", "param", (4, 4), placements=(("dp", Shard(0)),), layer=0))
    full = torch.randn(6, 3)
    case = Case((4,), ("dp",), [SiteCase("layers.0.w", "param", full, (("R",),), layer=0)])
    for got in run_threaded(_rank, 4, case, [MetricSpec("dp-replica-drift")]):
        assert {labels[3]: v for labels, v in got["dp-replica-drift"]} == {
            "tensors-differing": 0.0, "max-sum-diff": 0.0, "sampled-max-diff": 0.0}


def test_a_single_flipped_bit_is_detected():
    full = torch.randn(1000)

    def flip(sc, coords, local):
        if coords["dp"] == 1:
            local = local.clone()
            local.view(torch.int32)[777] ^= 1
        return local

    def rank_fn(rank, world, comm, case):
        return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm,
                        [MetricSpec("dp-replica-drift")], perturb=flip)

    case = Case((2,), ("dp",), [SiteCase("layers.0.w", "param", full, (("R",),), layer=0)])
    for got in run_threaded(rank_fn, 2, case):
        values = {labels[3]: v for labels, v in got["dp-replica-drift"]}
        assert values["tensors-differing"] == 1.0
        # One ulp of the element: between 2**-24 and 2**-23 of its magnitude.
        assert 0 < values["max-sum-diff"] <= abs(full[777].item()) * 2.0**-23


def test_refused_without_a_dp_axis():
    """Nothing to compare would read 0 on every step: a false all-clear."""
    site = Site("layers.0.w", "param", (4, 4), layer=0)
    try:
        build_metric("dp-replica-drift").check(site, sim_topology(0, (2,), ("tp",)))
    except PlacementError as exc:
        assert "'dp'" in str(exc) and "['tp']" in str(exc)
    else:
        raise AssertionError("dp-replica-drift accepted a topology without a dp axis")
    build_metric("dp-replica-drift").check(site, sim_topology(0, (2,), ("dp",)))
