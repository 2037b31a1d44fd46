"""Log-spaced histograms and the histogram median: sharded counts equal the unsharded counts
exactly on 1, 2 and 4 simulated ranks under every placement; quantile estimates stay within
the documented bound of torch.median."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import (
    MESHES,
    Case,
    MetricSpec,
    SiteCase,
    assert_results,
    run_case,
    tensor_specs,
    token_specs,
)
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.sketches import LogBins
from tmetrics_core.records import Histogram


def reference_counts(values: torch.Tensor, bins: LogBins) -> Histogram:
    """Classify each element on its own (float64, bisect on the published edges)."""
    edges = list(bins.edges)
    counts = [0] * (len(edges) - 1)
    zeros = nan = pos = neg = 0
    for x in values.double().reshape(-1).tolist():
        if math.isnan(x):
            nan += 1
        elif x == math.inf:
            pos += 1
        elif x == -math.inf:
            neg += 1
        elif x == 0:
            zeros += 1
        else:
            counts[min(max(bisect.bisect_right(edges, x) - 1, 0), len(counts) - 1)] += 1
    return Histogram(edges=tuple(edges), counts=tuple(counts), zeros=zeros, nan=nan, posinf=pos, neginf=neg)


def spread(shape, generator) -> torch.Tensor:
    """Values across 2**-50 .. 2**30 in magnitude, both signs, with zeros and non-finite ones."""
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-50, 31, shape, generator=generator).float())
    pick = torch.rand(shape, generator=generator)
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf])[torch.randint(0, 5, shape, generator=generator)]
    return torch.where(pick < 0.15, special, x)


@st.composite
def param_cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    sites = []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        tshape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
        seed = draw(st.integers(0, 2**16))
        full = spread(tshape, torch.Generator().manual_seed(seed))
        kind = draw(st.sampled_from(["param", "grad"]))
        # Partial(sum) parts of test data do not add back exactly; max parts do.
        specs = draw(tensor_specs(ndim, shape, partial_ops=("max",)))
        sites.append(SiteCase(f"layers.{i % 2}.w{i}", kind, full, specs, layer=i % 2, seed=seed))
    return Case(shape, names, sites), draw(st.sampled_from([None, 3, 16]))


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(param_cases())
def test_histograms_merge_exactly_under_every_placement(drawn):
    case, nbins = drawn
    bins = LogBins(-40, 24, 128 if nbins is None else nbins)
    opts = (("bins", nbins),) if nbins else ()
    specs = [MetricSpec("layer-param-histogram", opts), MetricSpec("layer-grad-histogram", opts)]
    want: dict = {"layer-param-histogram": [], "layer-grad-histogram": []}
    for kind in ("param", "grad"):
        for layer in sorted({sc.layer for sc in case.sites if sc.kind == kind}):
            values = torch.cat([sc.full.reshape(-1) for sc in case.sites if sc.kind == kind and sc.layer == layer])
            want[f"layer-{kind}-histogram"].append(((layer, None, None, None), reference_counts(values, bins)))
    for got in run_threaded(_rank, math.prod(case.shape), case, specs):
        assert_results(got, want)


@st.composite
def logit_cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    micro = draw(st.integers(1, 2))
    sites = []
    for layer in range(draw(st.integers(1, 2))):
        tokens, experts = draw(st.integers(0, 12)), draw(st.integers(1, 6))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(tokens, experts, generator=g) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
        specs = draw(token_specs(shape, names, class_split=True))
        sites.append(SiteCase(f"layers.{layer}.moe.router", "router_logits", full, specs, layer=layer,
                              num_experts=experts, seed=seed))
    return Case(shape, names, sites, micro=micro)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logit_cases())
def test_router_logit_median_from_merged_counts(case):
    bins = LogBins(-20, 12, 1024)
    want = []
    for sc in case.sites:
        counts = reference_counts(sc.full, bins)
        vector = list(counts.counts) + [counts.zeros, counts.nan, counts.posinf, counts.neginf]
        estimate = bins.quantile(vector, 0.5)
        want.append(((sc.layer, None, None, None), estimate))
        if sc.full.numel():
            true = sc.full.reshape(-1).median().item()
            assert abs(estimate - true) <= bins.relative_error * abs(true) + 2.0**-21
    for got in run_threaded(_rank, math.prod(case.shape), case, [MetricSpec("layer-router-logits-sampled-median")]):
        assert_results(got, {"layer-router-logits-median": want}, rtol=0.0, atol=0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=32, min_value=-1e6, max_value=1e6), min_size=1, max_size=60),
       st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
def test_quantile_error_bound(values, q):
    bins = LogBins(-20, 12, 256)
    x = torch.tensor(values, dtype=torch.float32)
    estimate = bins.quantile(bins.count(x).tolist(), q)
    true = torch.sort(x.double()).values[math.floor(q * (x.numel() - 1))].item()
    if abs(true) >= 2.0**12:
        assert estimate == math.copysign(2.0**12, true)
    elif abs(true) <= 2.0**-20:
        assert abs(estimate - true) <= 2.0**-21
    else:
        assert abs(estimate - true) <= bins.relative_error * abs(true) * (1 + 1e-12)


def test_quantile_is_exact_on_zeros_and_infinities():
    bins = LogBins()
    counts = bins.count(torch.tensor([-math.inf, 0.0, 0.0, -0.0, math.inf, math.nan])).tolist()
    assert bins.quantile(counts, 0.0) == -math.inf
    assert bins.quantile(counts, 0.5) == 0.0
    assert bins.quantile(counts, 1.0) == math.inf
    assert math.isnan(bins.quantile(bins.count(torch.tensor([math.nan])).tolist(), 0.5))


def test_bins_layout_and_bound():
    bins = LogBins(-2, 2, 4)
    assert bins.edges == (-np.finfo(np.float32).max, -4.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0,
                          np.finfo(np.float32).max)
    assert bins.relative_error == pytest.approx(math.sqrt(2) - 1)
    hist = bins.histogram(bins.count(torch.tensor([-4.0, -0.25, 0.1, 0.25, 3.9, 4.0, 1e30])).tolist())
    assert hist.counts == (0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 2)
    assert hist.total == 7


def test_bins_validation():
    with pytest.raises(ConfigError, match="bins"):
        LogBins(bins=0)
    with pytest.raises(ConfigError, match="empty"):
        LogBins(3, 3, 8)
    with pytest.raises(ConfigError, match="at most 4096"):
        LogBins(0, 1, 4097)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view  # views (a flattening, a cut) move no element
        return func(*args, **(kwargs or {}))


def test_many_tensors_are_counted_with_a_fixed_number_of_ops_and_as_each_alone(monkeypatch):
    """Histograms on the batched path (issue 35: one searchsorted per tensor cost 24 ms on a
    24 ms step): the op count does not grow with the tensor count, and a group, a cut tensor
    and a float64 neighbour change no count."""
    import tmetrics_core.metrics.sketches as sketches

    bins = LogBins(bins=16)
    g = torch.Generator().manual_seed(3)
    tensors = [spread((int(n),), g) for n in torch.randint(0, 40, (80,), generator=g)]
    tensors[5] = tensors[5].double()
    tensors[6] = tensors[6].to(torch.bfloat16)
    bins.count_many(tensors[:1])  # the edges, cached once
    ops = {}
    for n in (10, 80):
        with _CountOps() as counter:
            bins.count_many(tensors[:n])
        ops[n] = counter.ops
    assert ops[10] == ops[80]
    monkeypatch.setattr(sketches, "_GROUP", 64)  # several groups, tensors cut across them
    for tensor, vector in zip(tensors, bins.count_many(tensors), strict=True):
        assert bins.histogram(vector.tolist()) == reference_counts(tensor, bins)
