"""The grid check of named axis groups (:mod:`tmetrics_core.distributed.grid_check`) on real gloo
worlds: a grid passes, groups that are not one fail on every rank with the same clear error,
and the check costs the same collectives at 2 and 4 ranks (it gathered an object from every
rank before: a world-sized exchange)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed
from tmetrics_core.distributed import world
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.distributed.grid_check import check_grid
from tmetrics_core.errors import ConfigError


class _Counting(TorchCollectives):
    """Bounded torch collectives that count the all-reduces and the values they carry."""

    def __init__(self) -> None:
        super().__init__(20.0)
        self.calls = 0
        self.values = 0

    def all_reduce(self, tensor, op, group):
        self.calls += 1
        self.values += tensor.numel()
        super().all_reduce(tensor, op, group)


LAYOUTS = {
    "tp_all": {"tp": [[0, 1, 2, 3]]},
    "tp_pairs_dp_pairs": {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]},
    "dp_across_tp": {"tp": [[0, 1], [2, 3]], "dp": [[0, 3], [1, 2]]},
    "tp_pairs_only": {"tp": [[0, 1], [2, 3]]},
}
"""Axis -> the partition of 4 ranks into its groups (a 2-rank world takes ``tp_all`` as [[0, 1]])."""


def _check(rank: int, size: int, name: str) -> tuple[str, int, int]:
    layout = LAYOUTS[name] if size == 4 else {"tp": [[0, 1]]}
    groups = {"pp": None, **{axis: world.new_subgroups(lists) for axis, lists in layout.items()}}
    counting = _Counting()
    try:
        check_grid(groups, framework="Megatron", collectives=counting)
    except ConfigError as exc:
        return str(exc), counting.calls, counting.values
    return "", counting.calls, counting.values


@pytest.fixture(scope="module")
def results():
    two = run_distributed(_check, 2, "tp_all", timeout=120)
    four = {name: run_distributed(_check, 4, name, timeout=120) for name in LAYOUTS}
    return two, four


def test_a_grid_passes_in_the_same_collectives_at_two_and_four_ranks(results):
    two, four = results
    assert [r[0] for r in two] == ["", ""]
    # tp's (its fingerprint, the pp coordinate), then the world's (the flag, 2 sizes), each as x and -x
    assert {r[1:] for r in two} == {(2, 2 * 2 + 2 * 3)}
    assert {r[1:] for r in four["tp_all"]} == {(2, 2 * 2 + 2 * 3)}  # the same at 4 ranks
    assert [r[0] for r in four["tp_pairs_dp_pairs"]] == [""] * 4
    assert {r[1:] for r in four["tp_pairs_dp_pairs"]} == {(3, 2 * 2 * 3 + 2 * 4)}  # one more axis: one more


def test_groups_that_are_no_grid_fail_on_every_rank_clearly(results):
    _, four = results
    errors = [r[0] for r in four["dp_across_tp"]]
    assert all("not a grid of pp, tp, dp; pass axes={...} yourself" in e for e in errors), errors
    assert any("Megatron's dp group of rank 0 is [0, 3], but its members differ along tp" in e for e in errors)
    assert all(r[1] == 3 for r in four["dp_across_tp"])  # still no more collectives than a grid


def test_groups_that_do_not_cover_the_world_fail_on_every_rank_clearly(results):
    _, four = results
    errors = [r[0] for r in four["tp_pairs_only"]]
    assert all("Megatron's groups {'pp': 1, 'tp': 2} multiply to 2 ranks, not the world size 4" in e
               and "not a grid of pp, tp" in e for e in errors), errors
