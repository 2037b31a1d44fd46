"""The manifest exchange: the union of every rank's holdings, exchanged only over the axes whose
ranks list different tensors, through the collectives seam; per-rank bytes of start-up and of a
due step do not grow with the world size (recording seam of ``bench.recording``)."""

import pytest

from bench.recording import SymmetricWorld
from bench.scaling import world_rank
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.manifest_exchange import share_holdings
from tmetrics_core.manifest.holdings import Holdings


def _row(name, shape=(4,), dtype="float32"):
    return (name, name, None, None, "w", "w", shape, dtype, (), ())


def _stages(rank, world, comm, split_on_dp):
    """pp2 x dp2: stage s holds ``s.w``; with ``split_on_dp`` the dp ranks hold ``x`` in two shapes."""
    topology = sim_topology(rank, (2, 2), ("pp", "dp"))
    coords = topology.coords()
    rows = [_row(f"{coords['pp']}.w")]
    if split_on_dp:
        rows.append(_row("x", shape=(2 + coords["dp"],)))
    executor = Executor(topology, collectives=comm)
    shared = share_holdings(Holdings.local(rows, coords, rank, 0), executor)
    return shared, dict(executor.stats.calls)


def test_stages_are_gathered_over_pp_only_and_replicas_spread_over_dp():
    for rank, (shared, calls) in enumerate(run_threaded(_stages, 4, False, timeout=30)):
        dp = rank % 2  # the holder named is the one of this rank's pp group (rank = 2 pp + dp)
        assert shared.rows == {"0.w": {_row("0.w"): dp}, "1.w": {_row("1.w"): 2 + dp}}
        assert shared.held == {"0.w": {"pp": {0}, "dp": {0, 1}}, "1.w": {"pp": {1}, "dp": {0, 1}}}
        # per axis: the fingerprint's max and min, the agreement; pp (differing) adds one gather
        assert calls == {"pp": 3, "dp": 2}


def test_rows_that_differ_on_a_replica_axis_are_gathered_there_and_kept_apart():
    for shared, calls in run_threaded(_stages, 4, True, timeout=30):
        assert shared.rows["x"] == {_row("x", shape=(2,)): 0, _row("x", shape=(3,)): 1}
        assert calls == {"pp": 2, "dp": 2, "pp+dp": 1}


def _bytes(shape):
    world = SymmetricWorld(shape, ("pp", "dp", "ep", "tp"), class_axes=("pp", "ep"))
    by_rank = world.run(lambda rank, seam: world_rank(rank, seam, world, layers=2, experts=2))
    return {k: max(r[k] for r in by_rank.values()) for k in ("start-up", "first due step", "due step", "world gather")}


@pytest.mark.timeout(120)
def test_per_rank_bytes_do_not_grow_from_world_8_to_64():
    small, large = _bytes((2, 2, 2, 1)), _bytes((2, 16, 2, 1))
    for phase in ("start-up", "first due step", "due step"):
        assert large[phase] == small[phase], phase  # (calls, bytes): equal
    assert large["world gather"] == pytest.approx(8 * small["world gather"], rel=0.02)  # the design before


NAMES = ("pp", "dp", "ep", "tp")


def _by_class(coords):
    """Rows that depend on the pp and ep coordinates only, as in the symmetric world."""
    pp, _, ep, _ = coords
    return [_row(f"{pp}.{ep}.w"), _row(f"{pp}.attn"), _row("embed")]


def _full(rank, world, comm, shape):
    topology = sim_topology(rank, shape, NAMES)
    coords = topology.coords()
    mine = Holdings.local(_by_class([coords[a] for a in NAMES]), coords, rank, 0)
    return share_holdings(mine, Executor(topology, collectives=comm))


def test_the_symmetric_world_answers_as_every_rank_would():
    shape = (2, 2, 2, 2)
    full = run_threaded(_full, 16, shape, timeout=60)
    world = SymmetricWorld(shape, NAMES, class_axes=("pp", "ep"))

    def rep(rank, seam):
        topology = world.topology(rank)
        mine = Holdings.local(_by_class(world.coords(rank)), topology.coords(), rank, 0)
        return share_holdings(mine, Executor(topology, collectives=seam))

    simulated = world.run(rep)
    assert sorted(simulated) == world.representatives() == [0, 2, 8, 10]
    for rank, shared in simulated.items():
        assert shared == full[rank]
        assert shared.held["0.1.w"] == {"pp": {0}, "dp": {0, 1}, "ep": {1}, "tp": {0, 1}}
