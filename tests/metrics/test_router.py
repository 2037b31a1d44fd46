"""Router metrics: hand-computed closed forms (balanced routing, everything on one expert),
the sharded result equal to the single-process reference with sequences spread over dp ranks
(uneven, empty), layers owned by pipeline stages and micro-batches, and the placements that
must be refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import MESHES, Case, MetricSpec, SiteCase, assert_results, run_case
from tests.metrics.router_reference import Layer, family_results, simple_results
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.router import ExpertCounts
from tmetrics_core.site import Site

FAMILIES = ("layer-router-health", "layer-router-routing-balance", "layer-router-seq-aux-decomposition",
            "layer-router-expert-bias")
SIMPLE = ("layer-expert-tokens", "layer-expert-load-imbalance", "layer-dead-experts",
          "layer-router-decision-entropy", "layer-router-z-loss")
ALL = [MetricSpec(n) for n in FAMILIES + SIMPLE]


def router_sites(layer: int, *, scores=None, logits=None, ids, bias=None, seq_len=None, specs=None,
                 bias_specs=None) -> list[SiteCase]:
    """Sites of one MoE layer; ``specs`` for token sites, ``bias_specs`` for the bias."""
    experts = (scores if scores is not None else logits).shape[1]
    specs = specs or ()
    block = seq_len or 1
    meta = (("seq_len", seq_len),) if seq_len else ()
    name = f"layers.{layer}.moe.router"
    out = [SiteCase(name, "router_topk", ids, specs, layer=layer, num_experts=experts, meta=meta, block=block)]
    if scores is not None:
        out.append(SiteCase(name, "router_scores", scores, specs, layer=layer, num_experts=experts, block=block))
    if logits is not None:
        out.append(SiteCase(name, "router_logits", logits, specs, layer=layer, num_experts=experts, block=block))
    if bias is not None:
        out.append(SiteCase(name, "expert_bias", bias, bias_specs or (), layer=layer, num_experts=experts))
    return out


def single(sites, specs=ALL, micro=1):
    case = Case((), (), sites, micro=micro)
    return run_case(0, case, Topology.single_process(), TorchCollectives(), specs)


def values(got, name, layer=None):
    return {labels[3]: v for labels, v in got[name] if labels[0] == layer}


def test_balanced_routing_closed_form():
    # 2 sequences of 4 tokens, 4 experts, top-1: token t prefers expert t % 4 with 0.7.
    experts, length = 4, 4
    ids = torch.arange(8).remainder(4).reshape(8, 1)
    scores = torch.full((8, experts), 0.1).scatter(1, ids, 0.7)
    got = single(router_sites(0, scores=scores, ids=ids, seq_len=length))
    decomposition = values(got, "layer-router-seq-aux-decomposition", 0)
    assert decomposition["loss-mean"] == pytest.approx(1.0) and decomposition["loss-max"] == pytest.approx(1.0)
    for stat in ("assignment-imbalance-mean", "score-imbalance-mean", "imbalance-coupling-mean",
                 "imbalance-alignment-mean"):
        assert decomposition[stat] == pytest.approx(0.0, abs=1e-12)
    balance = values(got, "layer-router-routing-balance", 0)
    assert balance["actual-imbalance-mean"] == pytest.approx(0.0, abs=1e-12)
    assert balance["aux-actual-tv-mean"] == 0.0 and balance["topk-overlap-min"] == 1.0
    assert balance["actual-max-over-mean"] == pytest.approx(1.0) and balance["actual-inactive-fraction"] == 0.0
    health = values(got, "layer-router-health")
    assert health["seq-loss"] == pytest.approx(1.0) and health["global-batch-loss"] == pytest.approx(1.0)
    assert health["seq-global-loss-gap"] == pytest.approx(0.0, abs=1e-12)
    assert health["topk-boundary-relative-margin"] == pytest.approx(6 / 7)
    assert got["layer-expert-tokens"] == [((0, None, None, None), (2.0, 2.0, 2.0, 2.0))]
    assert values(got, "layer-expert-load-imbalance", 0) == {"max-over-mean": 1.0, "cv": 0.0}
    assert got["layer-dead-experts"][0][1] == 0.0
    assert got["layer-router-expert-bias"] == []  # no bias site


def test_all_tokens_on_one_expert_closed_form():
    experts = 4
    ids = torch.zeros(6, 1, dtype=torch.int64)
    scores = torch.zeros(6, experts).index_fill(1, torch.tensor([0]), 1.0)
    got = single(router_sites(0, scores=scores, ids=ids, seq_len=3))
    decomposition = values(got, "layer-router-seq-aux-decomposition", 0)
    assert decomposition["loss-mean"] == pytest.approx(experts)
    assert decomposition["assignment-imbalance-mean"] == pytest.approx(experts - 1)
    assert decomposition["score-imbalance-mean"] == pytest.approx(experts - 1)
    assert decomposition["imbalance-coupling-mean"] == pytest.approx(experts - 1)
    assert decomposition["imbalance-alignment-mean"] == pytest.approx(1.0)
    balance = values(got, "layer-router-routing-balance", 0)
    assert balance["actual-imbalance-max"] == pytest.approx(experts - 1)
    assert balance["actual-max-over-mean"] == pytest.approx(experts)
    assert balance["actual-inactive-fraction"] == pytest.approx(0.75)
    health = values(got, "layer-router-health")
    assert health["global-batch-loss"] == pytest.approx(experts)
    assert health["topk-boundary-relative-margin"] == pytest.approx(1.0)
    assert health["worst-layer-seq-loss"] == pytest.approx(experts)
    imbalance = values(got, "layer-expert-load-imbalance", 0)
    assert imbalance["max-over-mean"] == pytest.approx(experts)
    assert imbalance["cv"] == pytest.approx(math.sqrt(experts - 1))
    assert got["layer-dead-experts"][0][1] == experts - 1
    assert got["layer-router-decision-entropy"][0][1] == pytest.approx(0.0, abs=1e-12)


def test_uniform_scores_have_full_decision_entropy_and_known_z_loss():
    logits = torch.full((5, 8), 2.0)
    ids = torch.arange(5).reshape(5, 1)
    got = single(router_sites(0, logits=logits, ids=ids))
    assert got["layer-router-decision-entropy"][0][1] == pytest.approx(1.0)
    assert got["layer-router-z-loss"][0][1] == pytest.approx((2.0 + math.log(8)) ** 2)


def test_expert_bias_statistics_by_hand():
    # One sequence; bias pushes tokens from expert 0 to expert 1.
    scores = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]])
    bias = torch.tensor([-0.3, 0.3, 0.0])
    ids = torch.tensor([[1], [1]])
    got = single(router_sites(0, scores=scores, ids=ids, bias=bias, seq_len=2))
    stats = values(got, "layer-router-expert-bias", 0)
    assert stats["mean"] == pytest.approx(0.0, abs=1e-12)
    assert stats["std"] == pytest.approx(math.sqrt(0.06))
    assert stats["range"] == pytest.approx(0.6) and stats["abs-max"] == pytest.approx(0.3)
    s = torch.tensor([0.55, 0.35, 0.1], dtype=torch.float64)
    b = bias.double()
    want = ((b - b.mean()) @ (s - s.mean()) / ((b - b.mean()).norm() * (s - s.mean()).norm())).item()
    assert stats["score-correlation"] == pytest.approx(want)
    assert stats["aux-load-correlation"] == pytest.approx(-math.sqrt(3) / 2)   # aux load [1, 0, 0]
    assert stats["actual-load-correlation"] == pytest.approx(math.sqrt(3) / 2)  # dispatched [0, 1, 0]
    balance = values(got, "layer-router-routing-balance", 0)
    assert balance["topk-overlap-mean"] == 0.0 and balance["aux-actual-tv-mean"] == 1.0


def test_without_seq_len_each_observation_is_one_sequence():
    torch.manual_seed(0)
    scores = torch.softmax(torch.randn(12, 4), dim=1)
    ids = torch.topk(scores, 2).indices
    got = single(router_sites(0, scores=scores, ids=ids))
    health = values(got, "layer-router-health")
    assert health["seq-global-loss-gap"] == pytest.approx(0.0, abs=1e-12)
    probs = scores.double() / scores.double().sum(1, keepdim=True)
    want = family_results({0: Layer(probs, ids, None, None)})
    assert_results({k: got[k] for k in FAMILIES}, want)


def test_padding_tokens_are_not_seen():
    # The sources drop padding rows before metrics see them; the global statistics equal a
    # masked computation on the padded batch.
    torch.manual_seed(1)
    scores = torch.softmax(torch.randn(10, 4), dim=1)
    ids = torch.topk(scores, 1).indices
    valid = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    got = single(router_sites(0, scores=scores[valid], ids=ids[valid]))
    counts = torch.bincount(ids[valid].reshape(-1), minlength=4).double()
    load = counts / counts.sum()
    mean_score = (scores.double() * valid.unsqueeze(1)).sum(0) / valid.sum()
    assert values(got, "layer-router-health")["global-batch-loss"] == pytest.approx(4 * (load @ mean_score).item())
    assert got["layer-expert-tokens"][0][1] == tuple(counts.tolist())


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    sites, layers = [], {}
    for layer in range(draw(st.integers(1, 2))):
        experts = draw(st.integers(2, 5))
        k = draw(st.integers(1, experts))
        seq_len = draw(st.integers(1, 3))
        sequences = draw(st.integers(0, 5))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(sequences * seq_len, experts, generator=g) * draw(st.sampled_from([0.3, 2.0]))
        style = draw(st.sampled_from(["logits", "softmax", "sigmoid"]))
        raw = {"logits": None, "softmax": torch.softmax(logits, 1), "sigmoid": torch.sigmoid(logits)}[style]
        probs = torch.softmax(logits.double(), 1) if raw is None else raw.double() / raw.double().sum(1, keepdim=True)
        bias = torch.randn(experts, generator=g) * 0.3 if draw(st.booleans()) else None
        ids = torch.topk(probs + (0 if bias is None else bias.double()), k, dim=1).indices
        cuts, owner = {}, {}
        for i, (n, name) in enumerate(zip(shape, names)):
            cuts[i] = tuple([0.0] + sorted(draw(st.lists(st.floats(0, 1), min_size=n - 1, max_size=n - 1))) + [1.0])
            owner[i] = draw(st.integers(0, n - 1))
        specs = tuple(("S*", cuts[i]) if name == "dp" else ("R",) if name == "tp" else ("O", owner[i])
                      for i, name in enumerate(names))
        bias_specs = tuple(("O", owner[i]) if name == "pp" else ("R",) for i, name in enumerate(names))
        sites += router_sites(layer, scores=raw, logits=logits if style == "logits" or draw(st.booleans()) else None,
                              ids=ids, bias=bias, seq_len=seq_len, specs=specs, bias_specs=bias_specs)
        layers[layer] = Layer(probs, ids, bias, seq_len, logits=next(
            (sc.full for sc in sites if sc.layer == layer and sc.kind == "router_logits"), None))
    return Case(shape, names, sites, micro=draw(st.integers(1, 2))), layers


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_router_metrics_equal_reference_with_sequences_split_across_ranks(drawn):
    case, layers = drawn
    want = family_results(layers) | simple_results(layers)
    for got in run_threaded(_rank, math.prod(case.shape), case, ALL):
        assert_results(got, want)


def _site(kind, placements, meta=()):
    shape = (-1, 4) if kind != "expert_bias" else (4,)
    return Site(name="layers.0.moe.router", kind=kind, logical_shape=shape, placements=placements, layer=0,
                num_experts=4, meta=meta)


@pytest.mark.parametrize("name", FAMILIES + ("layer-router-decision-entropy",))
def test_scores_split_by_expert_are_refused(name):
    from tmetrics_core.placements import Shard
    topology = sim_topology(0, (2,), ("tp",))
    with pytest.raises(PlacementError, match="full row"):
        build_metric(name).check(_site("router_scores", (("tp", Shard(1)),)), topology)


def test_sequence_statistics_refuse_context_parallel_splits():
    from tmetrics_core.placements import Shard
    topology = sim_topology(0, (2,), ("cp",))
    site = _site("router_topk", (("cp", Shard(None)),), meta=(("seq_len", 8),))
    with pytest.raises(PlacementError, match="cuts sequences"):
        build_metric("layer-router-health").check(site, topology)
    build_metric("layer-expert-tokens").check(site, topology)  # counts do not need sequences


def test_sharded_expert_bias_is_refused():
    from tmetrics_core.placements import Shard
    topology = sim_topology(0, (2,), ("ep",))
    with pytest.raises(PlacementError, match="expert_bias"):
        build_metric("layer-router-expert-bias").check(_site("expert_bias", (("ep", Shard(0)),)), topology)


def test_router_logits_split_by_expert_keep_exact_entropy_and_z_loss():
    torch.manual_seed(2)
    logits = torch.randn(6, 5) * 3
    ids = torch.topk(logits, 1).indices
    sites = router_sites(0, logits=logits, ids=ids, specs=(("S", 1),))
    sites[0].specs = (("R",),)  # top-k ids are not split by expert
    case = Case((2,), ("tp",), sites)
    specs = [MetricSpec("layer-router-decision-entropy"), MetricSpec("layer-router-z-loss")]
    want = simple_results({0: Layer(torch.softmax(logits.double(), 1), ids, None, None, logits=logits)})
    for got in run_threaded(_rank, 2, case, specs):
        assert_results(got, {k: want[k] for k in ("layer-router-decision-entropy", "layer-router-z-loss")})


def test_out_of_range_expert_ids_raise():
    metric = build_metric("layer-expert-tokens")
    site = _site("router_topk", ())
    with pytest.raises(ValueError, match="expert ids"):
        metric.prepare([site], [torch.tensor([[0], [4]])], Topology.single_process(), {})


@pytest.mark.parametrize(("ids", "shown"), [([[0, 4]], "0..4"), ([[-1, 2]], "-1..2")])
def test_expert_ids_out_of_range_are_a_clear_error_and_in_range_ones_read_no_value(ids, shown, monkeypatch):
    site = Site("layers.0.router", "router_topk", (-1, 2), layer=0, num_experts=4)
    stat, topology = ExpertCounts(), Topology.single_process()
    with pytest.raises(ValueError, match=rf"expert ids must be in \[0, 4\); got {shown}"):
        stat.compute([torch.tensor(ids)], [site], topology, None)
    # The common case never reads an id on the host (no .item()/int() of a tensor value).
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: pytest.fail("host read of an expert id"))
    (counts,) = stat.compute([torch.tensor([[0, 1], [1, 3]])], [site], topology, None)
    assert counts.tolist() == [1.0, 2.0, 0.0, 1.0]
