"""Plan mismatch and one-rank failures on real gloo processes: a clear error or a skipped
metric within seconds, never a hang."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.distributed import test_executor as cases
from tests.distributed.harness import run_distributed
from tmetrics_core.topology import Axis, Topology
from tmetrics_core.distributed.collectives import TorchCollectives


def _topology_dp(rank, world):
    group = dist.new_group(list(range(world)))
    return Topology([Axis("dp", world, rank, group, tuple(range(world)))], global_rank=rank, world_size=world)


def _with_real(fn):
    def run(rank, world):
        import tests.simulation as sim

        topo = _topology_dp(rank, world)
        original = sim.sim_topology
        sim.sim_topology = lambda r, shape, names: topo
        cases.sim_topology = sim.sim_topology
        try:
            return fn(rank, world, TorchCollectives(20.0))
        finally:
            sim.sim_topology = original
            cases.sim_topology = original
    return run


def _asymmetric(rank, world):
    return _with_real(cases._asymmetric_rank)(rank, world)


def _failing(rank, world):
    return _with_real(cases._failing_rank)(rank, world)


def _resume_failing(rank, world):
    return _with_real(cases._resume_failing_rank)(rank, world)


def _checks(rank, world):
    return _with_real(cases._checks_rank)(rank, world)


def test_a_device_check_failing_on_one_rank_fails_its_metric_everywhere():
    for results, failures in run_distributed(_checks, 2, timeout=60):
        assert sorted(results) == ["good", "other"] and results["good"] == [pytest.approx(10 ** 0.5)]
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (1,), "tokens dropped")]


def _mixed(rank, world):
    return _with_real(cases._mixed_failures_rank)(rank, world)


def test_checks_and_errors_on_several_of_4_ranks_fail_the_metric_everywhere():
    for results, failures in run_distributed(_mixed, 4, timeout=90):
        assert results == {"good": [pytest.approx(sum(2 * (r + 1) ** 2 for r in range(4)) ** 0.5)]}
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (1, 2, 3), "dropped on 1")]


def test_asymmetric_plan_raises_clear_error_fast():
    start = time.monotonic()
    for metric, axis, ranks, message in run_distributed(_asymmetric, 2, timeout=60):
        assert (metric, axis, ranks) == ("layer-grad-l2", "dp", (1,))
        assert "layers.0.w3" in message
    assert time.monotonic() - start < 30


def test_exception_on_one_rank_all_ranks_continue():
    for results, failures in run_distributed(_failing, 2, timeout=60):
        assert list(results) == ["good"]
        assert results["good"] == [pytest.approx(10 ** 0.5)]
        assert [(f.metric, f.ranks) for f in failures] == [("bad", (1,))]


def test_exception_in_resume_on_one_rank_is_agreed_before_the_next_round():
    start = time.monotonic()
    for results, failures, _ in run_distributed(_resume_failing, 2, timeout=60):
        assert sorted(results) == ["good", "twice"] and results["twice"] == [pytest.approx(12.0)]
        assert [(f.metric, f.ranks) for f in failures] == [("bad", (1,))]
    assert time.monotonic() - start < 20  # no collective timeout (20 s) was waited for
