import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import RankFailure, run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_values(world_size):
    expected = float(sum(range(world_size)))
    assert run_distributed(_sum_ranks, world_size) == [expected] * world_size


def test_hang_fails_fast():
    with pytest.raises(RankFailure):
        run_distributed(_hang_on_rank0, 2, timeout=30, collective_timeout=3)
