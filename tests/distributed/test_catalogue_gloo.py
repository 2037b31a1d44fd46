"""Every catalogue metric on real gloo processes (world sizes 1, 2 and 4; 1-D and 2-D meshes),
against the unsharded float64 references of tests/metrics, one launch per world size: each
launch runs a parameter/gradient case, an activation case, a router case and a drift case on
every mesh of that size."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tests.metrics import test_activations, test_norms, test_updates
from tests.metrics.cases import Case, MetricSpec, SiteCase, assert_results, drift_replicas, run_case
from tests.metrics.router_reference import Layer, family_results, simple_results
from tests.metrics.test_drift import expected as drift_expected
from tests.metrics.test_router import ALL as ROUTER_SPECS
from tests.metrics.test_router import router_sites
from tests.metrics.test_sketches import reference_counts
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.metrics.sketches import LogBins

MESHES = {1: [((1,), ("dp",))], 2: [((2,), ("dp",)), ((2,), ("tp",))],
          4: [((2, 2), ("dp", "tp")), ((2, 2), ("pp", "dp")), ((4,), ("dp",))]}
PARAM_SPECS = test_norms.SPECS + test_updates.SPECS + [MetricSpec("layer-param-histogram"),
                                                     MetricSpec("layer-grad-histogram", (("bins", 24),))]


def _pad(names, **by_axis):
    return tuple(by_axis.get(n, ("R",)) for n in names)


def param_case(shape, names) -> Case:
    g = torch.Generator().manual_seed(11)
    first, last = names[0], names[-1]
    n = shape[0]

    def t(*s):
        return torch.randn(s, generator=g)

    grad_special = t(5, 6)
    grad_special[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    grad_special[2] = 0.0
    layout = [
        ("layers.0.attn.q.weight", 0, (9, 6), _pad(names, **{first: ("S", 0)})),
        ("layers.0.attn.o.weight", 0, (6, 7), _pad(names, **{last: ("S", 1)})),
        ("layers.0.attn_norm.weight", 0, (6,), _pad(names)),
        ("layers.1.mlp.up.weight", 1, (3, 5), _pad(names, **{first: ("S", 0)})),
        ("layers.1.mlp.down.weight", 1, (4, 6),
         _pad(names, **{first: ("F", tuple(i / n * 0.9 if i < n else 1.0 for i in range(n + 1)))})),
        ("layers.1.moe.experts.0.up.weight", 1, (5, 4), _pad(names, **{first: ("O", n - 1)})),
        ("layers.2.attn.v.weight", 2, (4, 4), _pad(names, **{last: ("P", "max")})),
    ]
    sites = []
    for i, (name, layer, size, specs) in enumerate(layout):
        sites.append(SiteCase(name, "param", t(*size), specs, layer=layer, seed=i, family=name))
        grad = grad_special if i == 3 else t(*size) * 1e-2
        if grad.shape != size:
            grad = t(*size)
            grad.view(-1)[0] = math.nan
        sites.append(SiteCase(name, "grad", grad, specs, layer=layer, seed=i, family=name))
        if i % 2 == 0:
            sites.append(SiteCase(name, "update", t(*size) * 1e-3, specs, layer=layer, seed=i))
            m = t(*size) * 1e-2
            sites.append(SiteCase(name, "exp_avg", m, specs, layer=layer, seed=i))
            sites.append(SiteCase(name, "exp_avg_sq", m * m, specs, layer=layer, seed=i))
    return Case(shape, names, sites)


def param_reference(case: Case) -> dict:
    want = test_norms.reference(case) | test_updates.reference(case)
    for kind, bins in (("param", LogBins()), ("grad", LogBins(bins=24))):
        want[f"layer-{kind}-histogram"] = [
            ((layer, None, None, None), reference_counts(torch.cat([sc.full.reshape(-1) for sc in case.sites
                                                                    if sc.kind == kind and sc.layer == layer]), bins))
            for layer in sorted({sc.layer for sc in case.sites if sc.kind == kind})]
    return want


def activation_case(shape, names) -> Case:
    g = torch.Generator().manual_seed(12)
    n_dp = dict(zip(names, shape)).get("dp", 1)
    cuts = tuple([0.0] + [0.3 * (i + 1) / n_dp for i in range(n_dp - 1)] + [1.0])
    rows = _pad(names, dp=("S*", cuts), pp=("O", 0))
    split = _pad(names, dp=("S*", cuts), tp=("S", 1), pp=("O", 0))
    sites = []
    for layer in range(2):
        sites.append(SiteCase(f"layers.{layer}", "residual_accumulator", torch.randn(10, 6, generator=g), rows,
                              layer=layer))
        sites.append(SiteCase(f"layers.{layer}", "residual_contribution", torch.randn(10, 6, generator=g), split,
                              layer=layer))
        sites.append(SiteCase(f"layers.{layer}.mlp", "activation", torch.randn(10, 5, generator=g), split, layer=layer))
    sites.append(SiteCase("head", "logits", torch.randn(10, 7, generator=g) * 5, split))
    return Case(shape, names, sites, micro=2)


def router_case(shape, names) -> tuple[Case, dict]:
    g = torch.Generator().manual_seed(13)
    n_dp = dict(zip(names, shape)).get("dp", 1)
    cuts = tuple([0.0] + [(i + 1) / (n_dp + 1) for i in range(n_dp - 1)] + [1.0])
    sites, layers = [], {}
    for layer, (experts, k, seq_len, style) in enumerate(((4, 2, 3, "logits"), (5, 1, 2, "sigmoid"))):
        logits = torch.randn(6 * seq_len, experts, generator=g)
        raw = torch.sigmoid(logits) if style == "sigmoid" else None
        probs = torch.softmax(logits.double(), 1) if raw is None else raw.double() / raw.double().sum(1, keepdim=True)
        bias = torch.randn(experts, generator=g) * 0.3 if layer else None
        ids = torch.topk(probs + (0 if bias is None else bias.double()), k, dim=1).indices
        specs = _pad(names, dp=("S*", cuts), pp=("O", layer % 2))
        sites += router_sites(layer, scores=raw, logits=logits, ids=ids, bias=bias, seq_len=seq_len, specs=specs,
                              bias_specs=_pad(names, pp=("O", layer % 2)))
        layers[layer] = Layer(probs, ids, bias, seq_len, logits=logits)
    want = family_results(layers) | simple_results(layers)
    full = {sc.layer: sc.full.double() for sc in sites if sc.kind == "router_logits"}
    want["layer-router-logits-l2"] = [((i, None, None, None), z.pow(2).sum().sqrt().item()) for i, z in full.items()]
    bins = LogBins(-20, 12, 1024)
    want["layer-router-logits-median"] = []
    for i, z in full.items():
        counts = reference_counts(z, bins)
        vector = list(counts.counts) + [counts.zeros, counts.nan, counts.posinf, counts.neginf]
        want["layer-router-logits-median"].append(((i, None, None, None), bins.quantile(vector, 0.5)))
    return Case(shape, names, sites, micro=2), want


ROUTER_ALL = ROUTER_SPECS + [MetricSpec("layer-router-logits-l2"), MetricSpec("layer-router-logits-median")]


def drift_case(shape, names) -> Case:
    g = torch.Generator().manual_seed(14)
    other = next((n for n in names if n != "dp"), None)
    specs_s0 = _pad(names, **({other: ("S", 0)} if other else {}))
    sites = [
        SiteCase("layers.0.w", "param", torch.randint(-9, 9, (5, 3), generator=g).float(), specs_s0, layer=0,
                 drift="first"),
        SiteCase("layers.1.w", "param", torch.randint(-9, 9, (4,), generator=g).float(), _pad(names), layer=1,
                 drift="everywhere"),
        SiteCase("layers.2.w", "param", torch.randint(-9, 9, (6, 2), generator=g).float(), specs_s0, layer=2),
    ]
    return Case(shape, names, sites)


def _rank(rank, world, meshes):
    out = []
    for shape, names in meshes:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        topology = Topology.from_mesh(mesh)
        comm = TorchCollectives(30.0)
        out.append({
            "param": run_case(rank, param_case(shape, names), topology, comm, PARAM_SPECS),
            "activation": run_case(rank, activation_case(shape, names), topology, comm, test_activations.SPECS[:-1]),
            "router": run_case(rank, router_case(shape, names)[0], topology, comm, ROUTER_ALL),
            # Without a dp axis the drift metric is refused at start-up (tests/metrics/test_drift.py).
            "drift": run_case(rank, drift_case(shape, names), topology, comm, [MetricSpec("dp-replica-drift")],
                              perturb=drift_replicas) if "dp" in names else None,
        })
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_catalogue_equals_reference_on_gloo(world):
    meshes = MESHES[world]
    results = run_distributed(_rank, world, meshes, timeout=240)
    for index, (shape, names) in enumerate(meshes):
        param_want = param_reference(param_case(shape, names))
        act_want, _ = test_activations.reference(activation_case(shape, names))
        router_want = router_case(shape, names)[1]
        drift = drift_case(shape, names)
        exact, (low, high) = drift_expected(drift)
        for rank_results in results:
            got = rank_results[index]
            assert_results(got["param"], param_want)
            assert_results(got["activation"], act_want)
            assert_results(got["router"], router_want)
            if "dp" in names:
                values = {labels[3]: v for labels, v in got["drift"]["dp-replica-drift"]}
                assert {k: values[k] for k in exact} == exact
                assert low <= values["sampled-max-diff"] <= high
            if dict(zip(names, shape)).get("dp", 1) > 1:
                assert exact["tensors-differing"] == 2.0
