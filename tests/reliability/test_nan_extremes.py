"""A NaN on one rank survives every cross-rank MAX/MIN of the router metrics and of
dp-replica-drift (NOTE [NaN under MAX] in ``tmetrics_core/metrics/statistics.py``).

gloo's MAX/MIN all_reduce keeps a NaN only when it comes first, so a NaN held by rank 1 alone
used to vanish. On 2 real gloo ranks, with the NaN on rank 0 only and on rank 1 only, and through
both executor paths (rounds gathered into one all_gather; plain all_reduce), every rank must
report exactly what one process reports on the whole data: NaN where the NaN reaches, the same
finite values elsewhere and in a run without NaN. A 4-rank simulation whose MAX/MIN drop a NaN
that does not come first, as gloo does, adds the second drift stage (over ``tp`` shards) and
router layers owned by pipeline stages.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.metrics.cases import (
    Case,
    MetricSpec,
    SiteCase,
    assert_results,
    drift_replicas,
    run_case,
)
from tests.metrics.test_router import router_sites
from tests.simulation import SimCollectives, SimWorld, mesh_coords, sim_topology
from tmetrics_core.distributed import rounds
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives

ROUTER_SPECS = [MetricSpec(n) for n in ("layer-router-health", "layer-router-routing-balance",
                                        "layer-router-seq-aux-decomposition", "layer-router-logits-max")]
DRIFT_SPECS = [MetricSpec("dp-replica-drift")]
EXPERTS, SEQ_LEN, TOKENS = 4, 4, 16
HALVES = (0.0, 0.5, 1.0)
"""dp cut of the tokens: rank 0 holds rows 0..7 (sequences 0, 1), rank 1 rows 8..15."""


def router_case(nan_rank: int | None, *, shape: tuple[int, ...] = (2,), names: tuple[str, ...] = ("dp",),
                nan_layer: int = 0, single: bool = False) -> Case:
    """Two MoE layers of 16 tokens (4 sequences of 4, E = 4, top-2) split in halves over ``dp``
    (layer ``l`` Owned by stage ``l`` on ``pp``); with ``nan_rank`` set, one score and one logit
    of layer ``nan_layer`` are NaN in the rows of that ``dp`` rank. ``single``: the whole data
    on one process."""
    sites = []
    for layer in (0, 1):
        g = torch.Generator().manual_seed(10 + layer)
        scores = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=g), dim=1)
        logits = torch.randn(TOKENS, EXPERTS, generator=g)
        ids = torch.topk(torch.randn(TOKENS, EXPERTS, generator=g), 2, dim=1).indices
        if nan_rank is not None and layer == nan_layer:
            row = TOKENS // 2 * nan_rank + 1
            scores[row, 2] = logits[row, 2] = math.nan
        specs = () if single else tuple(("S*", HALVES) if n == "dp" else ("O", layer) for n in names)
        sites += router_sites(layer, scores=scores, logits=logits, ids=ids, seq_len=SEQ_LEN, specs=specs)
    return Case(() if single else shape, () if single else names, sites)


def drift_case(shape: tuple[int, ...] = (2,), names: tuple[str, ...] = ("dp",)) -> Case:
    """Two parameters replicated on ``dp`` (split by rows over ``tp`` when there is one): layer 0
    is identical on every replica, layer 1 differs by 0.5 in one element on replicas >= 1."""
    g = torch.Generator().manual_seed(3)
    specs = tuple(("R",) if n == "dp" else ("S", 0) for n in names)
    return Case(shape, names, [
        SiteCase("layers.0.w", "param", torch.randint(-9, 9, (4, 3), generator=g).float(), specs, layer=0),
        SiteCase("layers.1.w", "param", torch.randint(-9, 9, (4, 3), generator=g).float(), specs, layer=1,
                 drift="first"),
    ])


class SetFirst:
    """``perturb`` for :func:`run_case`: the drift of ``drift_replicas``, plus ``value`` in the
    first local element of ``layers.0.w`` on the ranks at ``holders`` (axis coordinates)."""

    def __init__(self, value: float, *holders: dict[str, int]) -> None:
        self.value = value
        self.holders = holders

    def __call__(self, sc: SiteCase, coords: dict[str, int], local: torch.Tensor) -> torch.Tensor:
        local = drift_replicas(sc, coords, local)
        if sc.name == "layers.0.w" and coords in self.holders and local.numel():
            local = local.clone()
            local.view(-1)[0] = self.value
        return local


def values(got: dict[str, list], name: str) -> dict[Any, float]:
    """``{(layer, stat): value}`` of one metric."""
    return {(labels[0], labels[3]): v for labels, v in got[name]}


def reference(case: Case) -> dict:
    return run_case(0, case, Topology.single_process(), TorchCollectives(), ROUTER_SPECS)


# ---- real gloo ranks ------------------------------------------------------------------------


def _gloo_rank(rank: int, world: int) -> dict:
    """Every scenario on this rank: NaN on no rank, rank 0, rank 1; gathered and all_reduce rounds."""
    import torch.distributed as dist

    assert hasattr(rounds, "_GATHER_LIMIT"), "the test forces the all_reduce path through _GATHER_LIMIT"
    default_limit = rounds._GATHER_LIMIT
    topology = Topology.from_groups({"dp": dist.group.WORLD})
    comm = TorchCollectives(30.0)
    out = {}
    for path, limit in (("gathered", default_limit), ("all_reduce", 0)):
        rounds._GATHER_LIMIT = limit  # 0: no round fits an all_gather, every bucket is all-reduced
        for nan_rank in (None, 0, 1):
            out[("router", path, nan_rank)] = run_case(rank, router_case(nan_rank), topology, comm, ROUTER_SPECS)
            perturb = SetFirst(math.nan, *([] if nan_rank is None else [{"dp": nan_rank}]))
            out[("drift", path, nan_rank)] = run_case(rank, drift_case(), topology, comm, DRIFT_SPECS, perturb=perturb)
    rounds._GATHER_LIMIT = default_limit
    return out


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    return run_distributed(_gloo_rank, 2, timeout=120)


@pytest.mark.parametrize("path", ["gathered", "all_reduce"])
@pytest.mark.parametrize("nan_rank", [None, 0, 1])
def test_router_nan_on_one_rank_reaches_every_rank(gloo_results, nan_rank, path):
    want = reference(router_case(nan_rank, single=True))
    loss_max = values(want, "layer-router-seq-aux-decomposition")
    logits_max = values(want, "layer-router-logits-max")
    # The reference is not vacuous: NaN exactly in the NaN layer's extremes and roll-ups.
    nan_expected = nan_rank is not None
    assert math.isnan(loss_max[(0, "loss-max")]) == nan_expected
    assert math.isnan(loss_max[(None, "loss-max")]) == nan_expected
    assert math.isnan(logits_max[(0, None)]) == nan_expected
    assert math.isfinite(loss_max[(1, "loss-max")]) and math.isfinite(logits_max[(1, None)])
    assert math.isfinite(values(want, "layer-router-routing-balance")[(0, "actual-imbalance-max")])
    assert math.isfinite(values(want, "layer-router-routing-balance")[(0, "topk-overlap-min")])
    for got in gloo_results:
        assert_results(got[("router", path, nan_rank)], want)


@pytest.mark.parametrize("path", ["gathered", "all_reduce"])
@pytest.mark.parametrize("nan_rank", [None, 0, 1])
def test_drift_nan_on_one_replica_reaches_every_rank(gloo_results, nan_rank, path):
    for got in gloo_results:
        drift = values(got[("drift", path, nan_rank)], "dp-replica-drift")
        if nan_rank is None:
            assert drift == {(None, "tensors-differing"): 1.0, (None, "max-sum-diff"): 0.5,
                             (None, "sampled-max-diff"): 0.5}
        else:
            assert drift[(None, "tensors-differing")] == 2.0  # the NaN's bits differ from the number
            assert math.isnan(drift[(None, "max-sum-diff")]) and math.isnan(drift[(None, "sampled-max-diff")])


# ---- simulated 2x2 meshes with gloo's NaN order ---------------------------------------------


class GlooOrderCollectives(SimCollectives):
    """Simulated collectives whose MAX/MIN fold the ranks in group order as gloo does
    (``std::max(acc, x)``: a NaN is kept only when it is already in the accumulator)."""

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> None:
        if op == "sum":
            super().all_reduce(tensor, op, group)
            return
        values = self._exchange(group, tensor.detach().clone())
        acc = values[0].clone()
        for v in values[1:]:
            acc = torch.where(acc < v, v, acc) if op == "max" else torch.where(v < acc, v, acc)
        tensor.copy_(acc)


def _run_sim(case: Case, specs: list[MetricSpec], perturb: Any = None) -> list[dict]:
    world = SimWorld(4, timeout=20.0)
    results: list[Any] = [None] * 4
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = run_case(rank, case, sim_topology(rank, case.shape, case.names),
                                     GlooOrderCollectives(world, rank), specs, perturb=perturb)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads), "simulated ranks hang"
    if errors:
        raise errors[0]
    return results


def test_order_collectives_drop_a_late_nan_as_gloo_does():
    world = SimWorld(2)
    out: list[torch.Tensor] = []

    def body(rank: int) -> None:
        t = torch.tensor([math.nan if rank == 1 else 1.0, math.nan if rank == 0 else 2.0])
        GlooOrderCollectives(world, rank).all_reduce(t, "max", None)
        out.append(t)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    for t in out:
        assert t[0].item() == 1.0 and math.isnan(t[1].item())


@pytest.mark.parametrize("holder", range(4))
def test_drift_nan_on_one_tp_shard_of_one_replica_reaches_every_rank(holder):
    shape, names = (2, 2), ("dp", "tp")
    coords = dict(zip(names, mesh_coords(holder, shape)))
    for got in _run_sim(drift_case(shape, names), DRIFT_SPECS, perturb=SetFirst(math.nan, coords)):
        drift = values(got, "dp-replica-drift")
        assert drift[(None, "tensors-differing")] == 2.0
        assert math.isnan(drift[(None, "max-sum-diff")]) and math.isnan(drift[(None, "sampled-max-diff")])


def test_drift_identical_nan_on_every_replica_is_not_a_difference_but_hides_the_spread():
    shape, names = (2, 2), ("dp", "tp")
    everywhere = SetFirst(math.nan, *(dict(zip(names, mesh_coords(r, shape))) for r in range(4)))
    for got in _run_sim(drift_case(shape, names), DRIFT_SPECS, perturb=everywhere):
        drift = values(got, "dp-replica-drift")
        assert drift[(None, "tensors-differing")] == 1.0  # only layer 1's 0.5
        assert math.isnan(drift[(None, "max-sum-diff")]) and math.isnan(drift[(None, "sampled-max-diff")])


def test_drift_identical_infinity_on_every_replica_is_no_difference():
    shape, names = (2, 2), ("dp", "tp")
    everywhere = SetFirst(math.inf, *(dict(zip(names, mesh_coords(r, shape))) for r in range(4)))
    for got in _run_sim(drift_case(shape, names), DRIFT_SPECS, perturb=everywhere):
        assert values(got, "dp-replica-drift") == {(None, "tensors-differing"): 1.0, (None, "max-sum-diff"): 0.5,
                                                   (None, "sampled-max-diff"): 0.5}


def test_drift_without_nan_is_unchanged_on_tp_shards():
    shape, names = (2, 2), ("dp", "tp")
    for got in _run_sim(drift_case(shape, names), DRIFT_SPECS, perturb=SetFirst(math.nan)):
        assert values(got, "dp-replica-drift") == {(None, "tensors-differing"): 1.0, (None, "max-sum-diff"): 0.5,
                                                   (None, "sampled-max-diff"): 0.5}


@pytest.mark.parametrize("all_reduce", [False, True])
@pytest.mark.parametrize("holder", range(4))
def test_router_nan_in_a_pipeline_owned_layer_reaches_every_rank(holder, all_reduce, monkeypatch):
    if all_reduce:
        monkeypatch.setattr(rounds, "_GATHER_LIMIT", 0)
    shape, names = (2, 2), ("pp", "dp")
    stage, replica = mesh_coords(holder, shape)
    want = reference(router_case(replica, nan_layer=stage, single=True))
    assert math.isnan(values(want, "layer-router-seq-aux-decomposition")[(stage, "loss-max")])
    for got in _run_sim(router_case(replica, shape=shape, names=names, nan_layer=stage), ROUTER_SPECS):
        assert_results(got, want)
