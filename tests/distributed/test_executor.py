"""Executor: packing bounds, deduplication, failure agreement and plan checks (simulation)."""

from __future__ import annotations

import pytest
import torch

from tests.simulation import run_threaded, sim_topology
from tmetrics_core.errors import PlanMismatchError
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.distributed.agreement import DeviceCheck
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.base import CollectiveRequest, MetricResult, Round
from tmetrics_core.metrics.norms import AbsMax, L2Norm, Max, Mean, MeanLineL2, Min, Rms, ZeroFraction
from tmetrics_core.placements import Owned, Shard
from tmetrics_core.site import Site

SHAPES = [(8 + i, 4 + (i % 5)) for i in range(20)]


def eight_metrics():
    k = ["grad"]
    return [L2Norm(name="global-grad-l2", source_kinds=k), L2Norm(name="layer-grad-l2", source_kinds=k, scope="layer"),
            AbsMax(name="layer-grad-absmax", source_kinds=k, scope="layer"),
            Rms(name="layer-grad-rms", source_kinds=k, scope="layer"), Max(name="global-grad-max", source_kinds=k),
            Min(name="global-grad-min", source_kinds=k), Mean(name="global-grad-mean", source_kinds=k),
            MeanLineL2(name="global-grad-mean-row-l2", source_kinds=k), ZeroFraction(name="z", source_kinds=k)][:8]


def hundred_sites(topology):
    sites, tensors = [], []
    coords = topology.coords()
    sizes = {n: a.size for n, a in topology.axes.items()}
    for i in range(100):
        shape = SHAPES[i % 20]
        placements = (("dp", Shard(0)), ("tp", Shard(1))) if i % 3 else (("dp", Owned(i % 2)), ("tp", Shard(0)))
        site = Site(name=f"layers.{i // 10}.w{i}", kind="grad", logical_shape=shape, placements=placements,
                    layer=i // 10)
        local = torch.randn(site.local_shape(coords, sizes)) if site.holds(coords) else None
        sites.append(site)
        tensors.append(local)
    return sites, tensors


def _count_rank(rank, world, comm):
    topology = sim_topology(rank, (2, 2), ("dp", "tp"))
    sites, tensors = hundred_sites(topology)
    executor = Executor(topology, collectives=comm)
    prepared = prepare_states(eight_metrics(), sites, tensors, topology)
    executor.run(prepared, {s.key: s for s in sites})
    return executor.stats


def test_collective_calls_do_not_grow_with_tensors_or_metrics():
    for stats in run_threaded(_count_rank, 4):
        # Per round: one call (an all_gather over the axes of the round, every value having one
        # length on all ranks), however many tensors (100), shapes (20) or metrics (8).
        # Round 1: sums and maxima over dp+tp and the row norm's line sums over tp (Shard(1) cuts
        # rows; padded to the largest shard's rows), all in one call; the row norms of the
        # Owned-on-dp tensors split by rows on tp ride along (their line sums need no reduction,
        # so that stage runs locally). Round 2: row norms over dp (Shard(0) splits the rows).
        # Plus the failure agreement.
        assert stats.rounds == 2
        assert stats.calls == {"dp+tp": 1, "dp": 1, "world": 1}


def _asymmetric_rank(rank, world, comm):
    topology = sim_topology(rank, (2,), ("dp",))
    n = 3 if rank == 0 else 4  # rank 1 sees a site rank 0 does not
    sites = [Site(name=f"layers.0.w{i}", kind="grad", logical_shape=(4, 4), placements=(("dp", Shard(0)),), layer=0)
             for i in range(n)]
    tensors = [torch.ones(2, 4) for _ in sites]
    executor = Executor(topology, collectives=comm)
    prepared = prepare_states([L2Norm(name="layer-grad-l2", source_kinds=["grad"], scope="layer")], sites, tensors,
                              topology)
    with pytest.raises(PlanMismatchError) as info:
        executor.run(prepared, {s.key: s for s in sites}, check=True)
    return info.value.metric, info.value.axis, info.value.ranks, str(info.value)


def test_asymmetric_plan_raises_on_every_rank():
    for metric, axis, ranks, message in run_threaded(_asymmetric_rank, 2, timeout=30):
        assert (metric, axis, ranks) == ("layer-grad-l2", "dp", (1,))
        assert "layers.0.w3" in message and "rank 0 has nothing" in message


class _RaisesOnRank1(L2Norm):
    def prepare(self, sites, tensors, topology, memo):
        if topology.global_rank == 1:
            raise ValueError("boom on rank 1")
        return super().prepare(sites, tensors, topology, memo)


def _failing_rank(rank, world, comm):
    topology = sim_topology(rank, (2,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(4,), placements=(("dp", Shard(0)),), layer=0)]
    tensors = [torch.full((2,), float(rank + 1))]
    metrics = [_RaisesOnRank1(name="bad", source_kinds=["grad"]), L2Norm(name="good", source_kinds=["grad"])]
    executor = Executor(topology, collectives=comm)
    results, failures = executor.run(prepare_states(metrics, sites, tensors, topology), {s.key: s for s in sites})
    return {k: [r.value for r in v] for k, v in results.items()}, failures


def test_metric_raising_on_one_rank_is_skipped_on_all():
    for results, failures in run_threaded(_failing_rank, 2, timeout=30):
        assert list(results) == ["good"]
        assert results["good"] == [pytest.approx((2 * 1 + 2 * 4) ** 0.5)]
        assert [(f.metric, f.ranks) for f in failures] == [("bad", (1,))]


def _checks_rank(rank, world, comm):
    """Rank 1 has two device checks (one passes, one fails), rank 0 none: different check
    lists, the same collectives."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    tensors = [torch.full((2,), float(rank + 1))]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked", "other")]
    checks = [DeviceCheck(torch.tensor(True), "fine", frozenset({"other"})),
              DeviceCheck(torch.tensor(False), "tokens dropped", frozenset({"checked"}))] if rank == world - 1 else []
    executor = Executor(topology, collectives=comm)
    prepared = prepare_states(metrics, sites, tensors, topology)
    if world == 1:  # the check's reason replaces an error the metric already had
        prepared = [(m, s, "RuntimeError: hook" if m.name == "checked" else e) for m, s, e in prepared]
    results, failures = executor.run(prepared, {s.key: s for s in sites}, checks=checks)
    return {k: [r.value for r in v] for k, v in results.items()}, failures


@pytest.mark.parametrize("world", [1, 2])
def test_a_failed_device_check_fails_its_metrics_on_every_rank_with_its_reason(world):
    for results, failures in run_threaded(_checks_rank, world, timeout=30):
        assert sorted(results) == ["good", "other"]
        assert results["good"] == [pytest.approx(sum(2 * (r + 1) ** 2 for r in range(world)) ** 0.5)]
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (world - 1,), "tokens dropped")]


class _Recording:
    """The collectives seam, recording (call, group, dtype) of each call."""

    def __init__(self, comm, control):
        self.comm, self.control, self.calls = comm, control, []

    def _name(self, group):
        return "control" if group is self.control else "world" if group is None else "dp"

    def all_reduce(self, tensor, op, group):
        self.calls.append(("all_reduce", self._name(group), tensor.dtype))
        self.comm.all_reduce(tensor, op, group)

    def all_gather(self, tensor, group):
        self.calls.append(("all_gather", self._name(group), tensor.dtype))
        return self.comm.all_gather(tensor, group)

    def all_gather_object(self, obj, group):
        self.calls.append(("all_gather_object", self._name(group), None))
        return self.comm.all_gather_object(obj, group)


def _recorded_checks_rank(rank, world, comm):
    """``_checks_rank`` with a control group of its own, recording every collective."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked", "other")]
    checks = [DeviceCheck(torch.tensor(True), "fine", frozenset({"other"})),
              DeviceCheck(torch.tensor(False), "tokens dropped", frozenset({"checked"}))] if rank == world - 1 else []
    recording = _Recording(comm, control=list(range(world)))  # a group of its own (the same ranks)
    executor = Executor(topology, collectives=recording, control=recording.control)
    prepared = prepare_states(metrics, sites, [torch.full((2,), float(rank + 1))], topology)
    results, failures = executor.run(prepared, {s.key: s for s in sites}, checks=checks)
    return {k: [r.value for r in v] for k, v in results.items()}, failures, recording.calls


def test_device_checks_are_reduced_on_the_device_after_the_rounds_and_agreements_stay_on_the_host():
    """The agreement (which metrics raised, whether any rank has checks) is an int64 vector
    over the control group; the checks, decided on the device, are MAX-reduced over the world
    after the data round (over the control group here, where the collectives run on the CPU;
    over the default group on an accelerator), so the results' copy is the step's only read of
    the device. Only because a check failed are the reasons gathered, over the control group."""
    for results, failures, calls in run_threaded(_recorded_checks_rank, 2, timeout=30):
        assert sorted(results) == ["good", "other"] and results["good"] == [pytest.approx(10 ** 0.5)]
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (1,), "tokens dropped")]
        assert calls == [("all_reduce", "control", torch.int64), ("all_reduce", "dp", torch.float64),
                         ("all_reduce", "control", torch.float64), ("all_gather_object", "control", None)]


def _mixed_failures_rank(rank, world, comm):
    """Checks fail on ranks 1 and 3 with their own reasons; "checked" also raises on rank 2."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked")]
    checks = [DeviceCheck(torch.tensor(rank not in (1, 3)), f"dropped on {rank}", frozenset({"checked"}))]
    executor = Executor(topology, collectives=comm)
    prepared = prepare_states(metrics, sites, [torch.full((2,), float(rank + 1))], topology)
    if rank == 2:
        prepared = [(m, s, "RuntimeError: hook" if m.name == "checked" else e) for m, s, e in prepared]
    results, failures = executor.run(prepared, {s.key: s for s in sites}, checks=checks)
    return {k: [r.value for r in v] for k, v in results.items()}, failures


def test_checks_failing_on_several_ranks_name_them_all_with_the_lowest_ones_reason():
    """A metric that raised on rank 2 and whose check failed on ranks 1 and 3: one failure on
    every rank, naming ranks 1 to 3 and rank 1's reason (a check's reason replaces an error)."""
    for results, failures in run_threaded(_mixed_failures_rank, 4, timeout=30):
        assert results == {"good": [pytest.approx(sum(2 * (r + 1) ** 2 for r in range(4)) ** 0.5)]}
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (1, 2, 3), "dropped on 1")]


def _two_launches_rank(rank, world, comm):
    """Two steps launched before either is collected (``read_results: next-step`` reads a
    step's results after the next one launched): a check fails on the last rank in step 1."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked")]
    executor = Executor(topology, collectives=comm)
    launched = []
    for step in (1, 2):
        checks = [DeviceCheck(torch.tensor(not (step == 1 and rank == world - 1)), f"dropped at {step}",
                              frozenset({"checked"}))]
        prepared = prepare_states(metrics, sites, [torch.full((2,), float(rank + step))], topology)
        launched.append(executor.launch(prepared, {s.key: s for s in sites}, checks=checks))
    out = []
    for pending in launched:
        results, failures = executor.collect(pending)
        out.append(({k: [r.value for r in v] for k, v in results.items()}, failures))
    return out


def test_steps_launched_before_either_is_collected_keep_their_own_results_and_failures():
    for (first, failed_first), (second, failed_second) in run_threaded(_two_launches_rank, 2, timeout=30):
        assert first == {"good": [pytest.approx((2 * 1 + 2 * 4) ** 0.5)]}
        assert [(f.metric, f.ranks, f.error) for f in failed_first] == [("checked", (1,), "dropped at 1")]
        norm = (2 * 4 + 2 * 9) ** 0.5
        assert second == {"good": [pytest.approx(norm)], "checked": [pytest.approx(norm)]} and failed_second == []


def _unfed_and_checked_rank(rank, world, comm):
    """"checked" reads nothing on any rank and its check fails on the last rank."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked")]
    checks = [DeviceCheck(torch.tensor(rank != world - 1), "dropped", frozenset({"checked"}))]
    executor = Executor(topology, collectives=comm)
    prepared = prepare_states(metrics, sites, [torch.full((2,), float(rank + 1))], topology)
    results, failures = executor.run(prepared, {s.key: s for s in sites}, unfed={"checked"}, checks=checks)
    return sorted(results), failures, executor.unfed


@pytest.mark.parametrize("world", [1, 2])
def test_a_metric_fed_nowhere_whose_check_failed_is_one_failure_and_not_unfed(world):
    for results, failures, unfed in run_threaded(_unfed_and_checked_rank, world, timeout=30):
        assert results == ["good"] and unfed == ()
        assert [(f.metric, f.ranks, f.error) for f in failures] == [("checked", (world - 1,), "dropped")]


def test_a_check_flag_is_read_as_a_bool():
    """``fail_unless`` asks for a 0-d bool; another dtype is read as torch reads it as a bool."""
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2,), placements=(), layer=0)]
    topology = sim_topology(0, (1,), ("dp",))
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("int", "float", "zero")]
    checks = [DeviceCheck(torch.tensor(2), "int", frozenset({"int"})),
              DeviceCheck(torch.tensor(1.0), "float", frozenset({"float"})),
              DeviceCheck(torch.tensor(0.0), "zero", frozenset({"zero"}))]
    prepared = prepare_states(metrics, sites, [torch.ones(2)], topology)
    results, failures = Executor(topology).run(prepared, {s.key: s for s in sites}, checks=checks)
    assert sorted(results) == ["float", "int"] and [(f.metric, f.error) for f in failures] == [("zero", "zero")]


def _local_collect_rank(rank, world, comm):
    """A failed check read with ``gather=False`` (a step read a step later): no collective."""
    topology = sim_topology(rank, (world,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(2 * world,), placements=(("dp", Shard(0)),),
                  layer=0)]
    metrics = [L2Norm(name=n, source_kinds=["grad"]) for n in ("good", "checked")]
    checks = [DeviceCheck(torch.tensor(rank < 1), f"dropped on {rank}", frozenset({"checked"}))]
    recording = _Recording(comm, control=None)
    executor = Executor(topology, collectives=recording)
    pending = executor.launch(prepare_states(metrics, sites, [torch.full((2,), float(rank + 1))], topology),
                              {s.key: s for s in sites}, checks=checks)
    calls = len(recording.calls)
    results, failures = executor.collect(pending, gather=False)
    return sorted(results), [(f.metric, f.ranks, f.error) for f in failures], len(recording.calls) - calls


def test_a_failed_check_read_without_gathering_names_the_lowest_failing_rank():
    """Ranks 1 to 3 fail the check: every rank names rank 1, the lowest (carried in the checks'
    all-reduce); rank 1 gives its own reason, the others point to it; nothing is exchanged."""
    for rank, (results, failures, calls) in enumerate(run_threaded(_local_collect_rank, 4, timeout=30)):
        reason = "dropped on 1" if rank == 1 else "a device check failed on rank 1 (its reason is in that rank's failures)"
        assert results == ["good"] and failures == [("checked", (1,), reason)] and calls == 0


class _TwoRounds:
    """A sum over ``dp`` reduced twice (two collective rounds); ``resume`` of the first round
    raises on rank 1 when ``raising``."""

    source_kinds = frozenset({"grad"})

    def __init__(self, name: str, raising: bool) -> None:
        self.name, self.raising = name, raising

    def accepts(self, site):
        return site.kind == "grad"

    def check(self, site, topology):
        pass

    def prepare(self, sites, tensors, topology, memo):
        return {"sum": torch.stack([t.double().sum() for t in tensors]).sum().reshape(1)}

    def merge(self, a, b):
        return {"sum": a["sum"] + b["sum"]}

    def start(self, state, sites, topology):
        return Round([CollectiveRequest((self.name, 0), ("dp",), "sum", state["sum"])], continuation=(0, topology))

    def resume(self, continuation, results):
        index, topology = continuation
        value = results[(self.name, index)]
        if index == 0:
            if self.raising and topology.global_rank == 1:
                raise RuntimeError("resume failed on rank 1")
            return Round([CollectiveRequest((self.name, 1), ("dp",), "sum", value)], continuation=(1, topology),
                         agreed=True)
        return Round(continuation=continuation, done=True, outputs={(self.name, "out"): value})

    def finish(self, continuation, host):
        return [MetricResult(host[(self.name, "out")][0])]


def _resume_failing_rank(rank, world, comm):
    topology = sim_topology(rank, (2,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(4,), placements=(("dp", Shard(0)),), layer=0)]
    tensors = [torch.full((2,), float(rank + 1))]
    metrics = [_TwoRounds("bad", raising=True), L2Norm(name="good", source_kinds=["grad"]),
               _TwoRounds("twice", raising=False)]
    executor = Executor(topology, collectives=comm)
    results, failures = executor.run(prepare_states(metrics, sites, tensors, topology), {s.key: s for s in sites})
    return {k: [r.value for r in v] for k, v in results.items()}, failures, executor.stats.calls


def test_metric_raising_in_resume_on_one_rank_is_dropped_on_all_before_the_next_round():
    for results, failures, calls in run_threaded(_resume_failing_rank, 2, timeout=30):
        assert sorted(results) == ["good", "twice"]
        assert results["good"] == [pytest.approx((2 * 1 + 2 * 4) ** 0.5)]
        assert results["twice"] == [pytest.approx(2 * (2 + 4))]  # the dp sum, summed over dp again
        assert [(f.metric, f.ranks) for f in failures] == [("bad", (1,))]
        assert "resume failed on rank 1" in failures[0].error


def _changed_rank(rank, world, comm):
    topology = sim_topology(rank, (2,), ("dp",))
    sites = [Site(name="layers.0.w", kind="grad", logical_shape=(4,), placements=(("dp", Shard(0)),), layer=0)]
    tensors = [torch.full((2,), float(rank + 1))]
    metrics = [_TwoRounds("bad", raising=True), _TwoRounds("twice", raising=False)]
    executor = Executor(topology, collectives=comm)
    pending = executor.launch(prepare_states(metrics, sites, tensors, topology), {s.key: s for s in sites},
                              changed=rank == 1)
    results, failures = executor.collect(pending)
    return executor.changed, {k: [r.value for r in v] for k, v in results.items()}, [f.metric for f in failures]


def test_a_model_change_on_one_rank_survives_the_agreement_after_a_round():
    """Rank 1's model changed; both metrics' first rounds need an agreement after them (not
    ``Round.agreed``), where one metric raised on rank 1: the change is still known everywhere."""
    for changed, results, failures in run_threaded(_changed_rank, 2, timeout=30):
        assert changed is True
        assert results == {"twice": [pytest.approx(2 * (2 + 4))]} and failures == ["bad"]
