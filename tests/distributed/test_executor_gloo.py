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


def _checks_without_cpu_default(rank, world):
    """``_checks_rank`` where the default group carries no CPU tensor (``cuda:gloo``, as
    NCCL's) and the data axis is a gloo group: the device checks are reduced on the CPU, so
    over the control group tmetrics makes."""
    import tests.simulation as sim
    from tmetrics_core.distributed.backends import control_group

    group = dist.new_group(backend="gloo")
    topo = Topology([Axis("dp", world, rank, group, tuple(range(world)))], global_rank=rank, world_size=world)
    original = cases.sim_topology
    cases.sim_topology = lambda r, shape, names: topo
    control = control_group()
    real = cases.Executor
    cases.Executor = lambda topology, collectives: real(topology, collectives=collectives, control=control)
    try:
        return cases._checks_rank(rank, world, TorchCollectives(20.0))
    finally:
        cases.sim_topology, cases.Executor = original, real
        assert sim.sim_topology is original


def test_device_checks_run_when_the_default_group_carries_no_cpu_tensor():
    for results, failures in run_distributed(_checks_without_cpu_default, 2, timeout=60, backend="cuda:gloo"):
        assert sorted(results) == ["good", "other"] and results["good"] == [pytest.approx(10 ** 0.5)]
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (1,), "tokens dropped")]


def _refused(rank, world):
    import torch

    from tmetrics_core.errors import TMetricsError

    with pytest.raises(TMetricsError) as info:
        TorchCollectives(5.0).all_reduce(torch.ones(1), "max", None)
    return str(info.value)


def test_a_collective_the_backend_refuses_is_a_clear_error():
    for message in run_distributed(_refused, 2, timeout=60, backend="cuda:gloo"):
        assert "all_reduce(max) of a cpu tensor could not start" in message and "'cuda:gloo'" in message


def _one_rank_alone(rank, world):
    """Rank 0 alone builds a one-process TensorMetrics; then the job makes a group of its own."""
    import datetime

    import torch

    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    if rank == 0:
        model = torch.nn.Linear(4, 4)
        metrics = TensorMetrics(model, metrics=[(build_metric("global-param-l2"), 1)])
        with metrics.step(1):
            pass
        metrics.close()
    group = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=group, async_op=True).wait(datetime.timedelta(seconds=15))
    return t.item()


def test_a_one_process_tensor_metrics_on_one_rank_makes_no_group():
    """A control group is made (collectively) only for a topology of several ranks: one made
    here on rank 0 alone would pair with the job's next new_group and hang it."""
    assert run_distributed(_one_rank_alone, 2, timeout=60, collective_timeout=30, backend="cuda:gloo") == [2.0, 2.0]


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


def _changed(rank, world):
    return _with_real(cases._changed_rank)(rank, world)


def test_a_model_change_on_one_rank_survives_the_agreement_after_a_round_on_gloo():
    for changed, results, failures in run_distributed(_changed, 2, timeout=60):
        assert changed is True
        assert results == {"twice": [pytest.approx(12.0)]} and failures == ["bad"]
