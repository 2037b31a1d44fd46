"""Update ratio and optimizer-state RMS: sharded on 1, 2 and 4 simulated ranks over every
placement, equal to the unsharded float64 reference; the ratio of a real AdamW step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import MESHES, Case, MetricSpec, SiteCase, assert_results, run_case, tensor_specs
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives

SPECS = [MetricSpec("layer-update-ratio"), MetricSpec("layer-optimizer-state-rms")]


def reference(case: Case) -> dict[str, list]:
    full = {(sc.name, sc.kind): sc for sc in case.sites}
    layers = sorted({sc.layer for sc in case.sites})
    ratio, state = [], []
    for layer in layers:
        names = sorted({sc.name for sc in case.sites if sc.layer == layer})
        updated = [n for n in names if (n, "update") in full]
        if updated:
            upd = sum(full[(n, "update")].full.double().pow(2).sum().item() for n in updated)
            par = sum(full[(n, "param")].full.double().pow(2).sum().item() for n in updated)
            value = (math.nan if upd == 0 else math.inf) if par == 0 else math.sqrt(upd / par)
            ratio.append(((layer, None, None, None), value))
        for kind in ("exp_avg", "exp_avg_sq"):
            parts = [full[(n, kind)].full.double().reshape(-1) for n in names if (n, kind) in full]
            if parts:
                x = torch.cat(parts)
                if x.numel():  # no state element anywhere: no stat
                    state.append(((layer, None, None, kind), x.pow(2).mean().sqrt().item()))
    return {"layer-update-ratio": ratio, "layer-optimizer-state-rms": state}


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    sites = []
    for i in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(1, 3))
        tshape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        # Partial(sum) test parts are N(0, 1) in float32: they would swamp 1e-3-scale values.
        specs = draw(tensor_specs(ndim, shape, partial_ops=("max",)))
        layer, name = i % 2, f"layers.{i % 2}.w{i}"
        g = torch.Generator().manual_seed(i * 101 + math.prod(tshape))
        sites.append(SiteCase(name, "param", torch.randn(tshape, generator=g), specs, layer=layer, seed=i))
        if draw(st.booleans()):
            sites.append(SiteCase(name, "update", torch.randn(tshape, generator=g) * 1e-3, specs, layer=layer, seed=i))
        if draw(st.booleans()):
            m = torch.randn(tshape, generator=g) * 1e-2
            sites.append(SiteCase(name, "exp_avg", m, specs, layer=layer, seed=i))
            sites.append(SiteCase(name, "exp_avg_sq", m * m + 1e-8, specs, layer=layer, seed=i))
    return Case(shape, names, sites)


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_update_ratio_and_state_rms_equal_unsharded_reference(case):
    want = reference(case)
    for got in run_threaded(_rank, math.prod(case.shape), case, SPECS):
        assert_results(got, want)


def test_update_ratio_of_an_adamw_step():
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 4)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(3, 6)).sum().backward()
    before = [p.detach().clone() for p in layer.parameters()]
    optimizer.step()
    sites = []
    for (name, p), old in zip(layer.named_parameters(), before):
        sites.append(SiteCase(f"layers.0.{name}", "param", p.detach().clone(), (), layer=0))
        sites.append(SiteCase(f"layers.0.{name}", "update", p.detach() - old, (), layer=0))
        state = optimizer.state[p]
        sites.append(SiteCase(f"layers.0.{name}", "exp_avg", state["exp_avg"].clone(), (), layer=0))
        sites.append(SiteCase(f"layers.0.{name}", "exp_avg_sq", state["exp_avg_sq"].clone(), (), layer=0))
    got = run_case(0, Case((), (), sites), Topology.single_process(), TorchCollectives(), SPECS)
    params = list(layer.parameters())
    delta = torch.cat([(p.detach() - o).reshape(-1) for p, o in zip(params, before)]).double()
    theta = torch.cat([p.detach().reshape(-1) for p in params]).double()
    assert got["layer-update-ratio"][0][1] == pytest.approx((delta.norm() / theta.norm()).item(), rel=1e-6)
    # AdamW's first step moves every element by about lr (plus weight decay).
    assert 1e-3 < got["layer-update-ratio"][0][1] < 1e-1
    stats = {labels[3]: v for labels, v in got["layer-optimizer-state-rms"]}
    assert set(stats) == {"exp_avg", "exp_avg_sq"}
