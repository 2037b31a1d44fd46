"""Activation metrics on token sites split across ranks (uneven, empty), replicated or split
by feature/vocabulary on tp, owned by a pipeline stage, observed in micro-batches: equal to the
unsharded float64 reference on 1, 2 and 4 simulated ranks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import MESHES, Case, MetricSpec, SiteCase, assert_results, run_case, token_specs
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.errors import PlacementError

SPECS = [MetricSpec(n) for n in (
    "layer-residual-accumulator-l2", "layer-residual-contribution-l2", "layer-residual-accumulator-rms",
    "layer-residual-contribution-rms", "global-output-logits-l2", "output-logits-max", "output-entropy",
    "layer-activation-rms")] + [MetricSpec("layer-activation-rms", (("modules", "layers.*.mlp.up"),))]
MODULES = ("layers.{i}.attn", "layers.{i}.mlp", "layers.{i}.mlp.up")


def reference(case: Case) -> dict[str, list]:
    def of(kind):
        return [sc for sc in case.sites if sc.kind == kind]

    def per_layer(kind, fn):
        layers = sorted({sc.layer for sc in of(kind)})
        return [((layer, None, None, None), fn(torch.cat([sc.full.double().reshape(-1) for sc in of(kind)
                                                           if sc.layer == layer]))) for layer in layers]

    def l2(x):
        return x.pow(2).sum().sqrt().item()

    def rms(x):
        return x.pow(2).mean().sqrt().item() if x.numel() else None  # no element anywhere: no record

    out = {}
    for part in ("accumulator", "contribution"):
        out[f"layer-residual-{part}-l2"] = per_layer(f"residual_{part}", l2)
        out[f"layer-residual-{part}-rms"] = per_layer(f"residual_{part}", rms)
    logits = [sc.full.double() for sc in of("logits")]
    z = torch.cat(logits) if logits else None
    out["global-output-logits-l2"] = [((None, None, None, None), l2(z))] if logits else []
    out["output-logits-max"] = [((None, None, None, None), z.max().item() if z.numel() else -math.inf)] if logits else []
    if logits:
        logp = torch.log_softmax(z, dim=1)
        entropy = -(logp.exp() * logp).sum(1)
        out["output-entropy"] = [((None, None, None, None), entropy.mean().item() if z.shape[0] else math.nan)]
    else:
        out["output-entropy"] = []
    acts = sorted(of("activation"), key=lambda sc: sc.name)
    out["layer-activation-rms"] = [((sc.layer, None, sc.name, None), rms(sc.full.double()))
                                   for sc in acts if not sc.name.endswith(".up")]
    custom = [((sc.layer, None, sc.name, None), rms(sc.full.double())) for sc in acts if sc.name.endswith(".up")]
    return ({name: [(k, v) for k, v in values if v is not None] for name, values in out.items()},
            [(k, v) for k, v in custom if v is not None])


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    sites = []
    for layer in range(draw(st.integers(1, 2))):
        tokens, width = draw(st.integers(0, 9)), draw(st.integers(1, 5))
        for j, kind in enumerate(("residual_accumulator", "residual_contribution")):
            full = torch.randn(tokens, width, generator=torch.Generator().manual_seed(layer * 10 + j)) * (j + 1)
            sites.append(SiteCase(f"layers.{layer}", kind, full, draw(token_specs(shape, names, class_split=True)),
                                  layer=layer))
        for pattern in draw(st.lists(st.sampled_from(MODULES), unique=True, max_size=3)):
            full = torch.randn(tokens, width + 1, generator=torch.Generator().manual_seed(len(pattern) + layer))
            sites.append(SiteCase(pattern.format(i=layer), "activation", full,
                                  draw(token_specs(shape, names, class_split=True)), layer=layer))
    if draw(st.booleans()):
        tokens, vocab = draw(st.integers(0, 9)), draw(st.integers(1, 7))
        scale = draw(st.sampled_from([0.1, 3.0, 60.0]))
        full = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(tokens * 7 + vocab)) * scale
        sites.append(SiteCase("head", "logits", full, draw(token_specs(shape, names, class_split=True))))
    return Case(shape, names, sites, micro=draw(st.integers(1, 2)))


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_activation_metrics_equal_unsharded_reference(case):
    want, custom = reference(case)
    for got in run_threaded(_rank, math.prod(case.shape), case, SPECS[:-1]):
        assert_results(got, want)
    for got in run_threaded(_rank, math.prod(case.shape), case, SPECS[-1:]):
        assert_results(got, {"layer-activation-rms": custom})


def test_entropy_of_uniform_and_certain_outputs():
    logits = torch.cat([torch.zeros(3, 5), torch.tensor([[0.0, 0.0, 1e4, 0.0, 0.0]])])
    case = Case((), (), [SiteCase("head", "logits", logits, ())])
    got = run_case(0, case, Topology.single_process(), TorchCollectives(), [MetricSpec("output-entropy")])
    assert got["output-entropy"][0][1] == pytest.approx(3 * math.log(5) / 4, rel=1e-12)


def test_entropy_rejects_a_flat_shard():
    case = Case((2,), ("dp",), [SiteCase("head", "logits", torch.randn(4, 3), (("F", (0.0, 0.4, 1.0)),))])
    with pytest.raises(PlacementError, match="FlatShard"):
        run_threaded(_rank, 2, case, [MetricSpec("output-entropy")])
