"""Batches: local stages need no round, the cut is kept while the sites stay, regrouping past
the first stage follows state order, and merged outputs equal a per-site merge."""

from __future__ import annotations

import math

import pytest
import torch

from tests.simulation import run_threaded, sim_topology
from tmetrics_core.topology import Topology
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.batches import Batch, BatchPlan, canonical
from tmetrics_core.metrics.norms import AbsMax, L2Norm, MeanLineL2, Rms
from tmetrics_core.metrics.statistics import SUMSQ, Stage
from tmetrics_core.placements import Owned, Shard
from tmetrics_core.site import Site


def _sites(n: int, layers: int = 3) -> tuple[list[Site], list[torch.Tensor]]:
    torch.manual_seed(0)
    sites = [Site(name=f"layers.{i % layers}.w{i}", kind="grad", logical_shape=(4 + i % 3, 3), layer=i % layers)
             for i in range(n)]
    return sites, [torch.randn(s.logical_shape) for s in sites]


def test_one_process_needs_no_collective_round():
    sites, tensors = _sites(12)
    topology = Topology.single_process()
    metrics = [L2Norm(name="layer-grad-l2", source_kinds=["grad"], scope="layer"),
               AbsMax(name="layer-grad-absmax", source_kinds=["grad"], scope="layer"),
               MeanLineL2(name="global-grad-mean-row-l2", source_kinds=["grad"])]
    executor = Executor(topology)
    results, failures = executor.run(prepare_states(metrics, sites, tensors, topology), {s.key: s for s in sites})
    assert failures == [] and executor.stats.rounds == 0
    for layer in range(3):
        mine = [t for s, t in zip(sites, tensors) if s.layer == layer]
        l2 = next(r.value for r in results["layer-grad-l2"] if r.layer == layer)
        assert l2 == pytest.approx(math.sqrt(sum(float(t.double().pow(2).sum()) for t in mine)), rel=1e-6)
        peak = next(r.value for r in results["layer-grad-absmax"] if r.layer == layer)
        assert peak == max(float(t.abs().max()) for t in mine)
    rows = torch.cat([t.double().norm(dim=1) for t in tensors])
    (mean_row,) = results["global-grad-mean-row-l2"]
    assert mean_row.value == pytest.approx(float(rows.mean()), rel=1e-6)


def test_plan_is_cut_once_while_sites_and_lengths_stay():
    sites, tensors = _sites(6)
    topology = Topology.single_process()
    metric = Rms(name="layer-grad-rms", source_kinds=["grad"], scope="layer")
    by_key = {s.key: s for s in sites}
    plan = BatchPlan(metric.statistics, metric._group)
    plan.batches(metric.prepare(sites, tensors, topology, {}), by_key, topology)
    first = plan._cached
    plan.batches(metric.prepare(sites, [t * 2 for t in tensors], topology, {}), by_key, topology)
    assert plan._cached is first  # new values, same sites: same cut
    fewer = {k: v for k, v in metric.prepare(sites, tensors, topology, {}).items() if k != sites[0].key}
    batches = plan.batches(fewer, by_key, topology)
    assert plan._cached is not first
    assert sum(len(b.sites) for b in batches) == 2 * 5  # sumsq and count rows of the 5 sites


def test_rows_past_the_first_stage_regroup_in_state_order():
    sites, _ = _sites(4)
    stages = (Stage(("tp",), "sum", 3), Stage(("dp",), "sum", 2))

    def batch(members: list[int]) -> Batch:
        rows = torch.tensor([[float(i), 10.0 * i] for i in members], dtype=torch.float64)
        chosen = tuple(sites[i] for i in members)
        return Batch(SUMSQ, chosen, stages, 1, rows, tuple(s.key for s in chosen), tuple(members))

    # Two ranks of the dp reduction may come out of stage 0 with rows batched differently.
    a = canonical([batch([2, 0]), batch([3, 1])])
    b = canonical([batch([1]), batch([0, 3, 2])])
    for merged in (a, b):
        (one,) = merged
        assert one.positions == (0, 1, 2, 3) and one.key == (SUMSQ.name, 1, tuple(s.key for s in sites))
        assert one.rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def _owned_rank(rank, world, comm):
    topology = sim_topology(rank, (2, 2), ("dp", "tp"))
    coords = topology.coords()
    sizes = {n: a.size for n, a in topology.axes.items()}
    sites, tensors = [], []
    for i in range(8):
        placements = (("dp", Owned(i % 2)), ("tp", Shard(0))) if i % 2 else (("dp", Shard(1)), ("tp", Shard(0)))
        site = Site(name=f"layers.{i % 2}.w{i}", kind="grad", logical_shape=(5 + i, 4), placements=placements,
                    layer=i % 2)
        sites.append(site)
        full = torch.arange(float(site.logical_shape[0] * 4)).reshape(site.logical_shape) / (i + 1)
        local = None
        if site.holds(coords):
            rows = torch.tensor_split(full, 2, dim=0)[coords["tp"]]
            local = torch.tensor_split(rows, 2, dim=1)[coords["dp"]] if i % 2 == 0 else rows
        tensors.append(local)
    metric = MeanLineL2(name="layer-grad-mean-row-l2", source_kinds=["grad"], scope="layer")
    executor = Executor(topology, collectives=comm)
    results, _ = executor.run(prepare_states([metric], sites, tensors, topology), {s.key: s for s in sites},
                              check=True)
    return {r.layer: r.value for r in results[metric.name]}


def test_multi_stage_batches_agree_across_ranks_and_match_the_reference():
    want = {}
    for layer in (0, 1):
        norms = [(torch.arange(float((5 + i) * 4)).reshape(5 + i, 4) / (i + 1)).double().norm(dim=1)
                 for i in range(8) if i % 2 == layer]
        want[layer] = float(torch.cat(norms).mean())
    for got in run_threaded(_owned_rank, 4):
        assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}
