"""The plan check: one host read for every axis, and a mismatch on a later axis named by that
axis (simulated 2 x 2 mesh, and real gloo on 4 processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.errors import PlanMismatchError
from tmetrics_core.metrics.norms import L2Norm
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.placements import Shard
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

_PLAN_CHECK = str(Path(__file__).parents[2] / "tmetrics_core" / "distributed" / "plan_check.py")


def _sites(topology: Topology, extra: bool) -> tuple[list[Site], list[torch.Tensor]]:
    """Two (8, 4) gradients sharded over dp (rows) and tp (columns), plus a third where ``extra``;
    local values: the global element index, so the L2 norm is known exactly."""
    n = 3 if extra else 2
    sites = [Site(name=f"layers.0.w{i}", kind="grad", logical_shape=(8, 4),
                  placements=(("dp", Shard(0)), ("tp", Shard(1))), layer=0) for i in range(n)]
    dp, tp = topology.axes["dp"].rank, topology.axes["tp"].rank
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    return sites, [full[4 * dp:4 * dp + 4, 2 * tp:2 * tp + 2].clone() for _ in sites]


def _run(topology: Topology, comm, extra: bool):
    sites, tensors = _sites(topology, extra)
    executor = Executor(topology, collectives=comm)
    metric = L2Norm(name="global-grad-l2", source_kinds=["grad"])
    results, failures = executor.run(prepare_states([metric], sites, tensors, topology), {s.key: s for s in sites},
                                     check=True)
    return [r.value for r in results["global-grad-l2"]], failures, executor.stats.calls


def _symmetric_rank(rank, world, comm):
    return _run(sim_topology(rank, (2, 2), ("dp", "tp")), comm, extra=False)


def test_a_checking_step_reads_the_host_once_for_every_axis(monkeypatch):
    reads: list[str] = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, _original=original, _name=name):
            if sys._getframe(1).f_code.co_filename == _PLAN_CHECK:
                reads.append(_name)
            return _original(self)

        monkeypatch.setattr(torch.Tensor, name, counted)
    out = run_threaded(_symmetric_rank, 4, timeout=30)
    reference = (2 * (torch.arange(32, dtype=torch.float64) ** 2).sum()).sqrt().item()
    for values, failures, calls in out:
        assert values == [pytest.approx(reference, rel=1e-12)] and failures == []
        # The check: one all_reduce per axis and one over the world; then the round and the agreement.
        assert calls == {"dp": 1, "tp": 1, "world": 2, "dp+tp": 1}
    # Two axes on 4 ranks: one read per rank (it was two .item() per axis: 16).
    assert reads == ["tolist"] * 4


def _tp_mismatch_rank(rank, world, comm):
    topology = sim_topology(rank, (2, 2), ("dp", "tp"))
    with pytest.raises(PlanMismatchError) as info:
        _run(topology, comm, extra=rank == 3)  # dp group (1, 3) differs, and tp group (2, 3)
    return info.value.axis, info.value.ranks


def test_a_mismatch_is_named_on_the_first_axis_where_it_shows():
    assert run_threaded(_tp_mismatch_rank, 4, timeout=30) == [("dp", (3,))] * 4


def _tp_only_mismatch_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from tmetrics_core.distributed.collectives import TorchCollectives

    topology = Topology.from_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    with pytest.raises(PlanMismatchError) as info:
        _run(topology, TorchCollectives(20.0), extra=topology.axes["tp"].rank == 1)
    return info.value.axis, info.value.ranks


def test_a_mismatch_on_the_second_axis_is_found_on_gloo():
    """Ranks 1 and 3 (tp coordinate 1) see a third site: the dp groups (0, 2) and (1, 3) agree,
    the tp groups (0, 1) and (2, 3) do not; the check reduces the second axis's row in place."""
    assert run_distributed(_tp_only_mismatch_rank, 4, timeout=90) == [("tp", (1,))] * 4
