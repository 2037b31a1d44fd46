"""The demo's autograd-aware all-gather and reduce-scatter on real gloo ranks: values and
gradients against the same computation on the full tensors in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.demo.expert_collectives import all_gather, reduce_scatter

ROWS, COLS = 3, 4


def _full(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's input rows [world * ROWS, COLS] and a weight [world * ROWS, COLS] per rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world_size * ROWS, COLS, generator=g, dtype=torch.float64)
    w = torch.randn(world_size, world_size * ROWS, COLS, generator=g, dtype=torch.float64)
    return x, w


def _ranked(rank: int, world_size: int) -> list:
    """loss_r = sum(w_r * reduce_scatter(all_gather(x_r) * w_r)), summed over ranks by autograd."""
    x_full, w = _full(world_size)
    group = dist.group.WORLD
    x = x_full[rank * ROWS:(rank + 1) * ROWS].clone().requires_grad_(True)
    gathered = all_gather(x, group)
    ids = all_gather(torch.arange(ROWS) + rank * ROWS, group)  # integer rows: no gradient
    scattered = reduce_scatter(gathered * w[rank], group)
    (scattered * w[rank][rank * ROWS:(rank + 1) * ROWS]).sum().backward()
    return [gathered.detach().tolist(), ids.tolist(), scattered.detach().tolist(), x.grad.tolist()]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gather_and_scatter_match_the_full_computation(world_size: int) -> None:
    x_full, w = _full(world_size)
    x = x_full.clone().requires_grad_(True)
    summed = sum(x * w[r] for r in range(world_size))
    loss = sum((summed[r * ROWS:(r + 1) * ROWS] * w[r][r * ROWS:(r + 1) * ROWS]).sum() for r in range(world_size))
    loss.backward()
    for rank, (gathered, ids, scattered, grad) in enumerate(run_distributed(_ranked, world_size)):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        assert gathered == x_full.tolist()
        assert ids == list(range(world_size * ROWS))
        torch.testing.assert_close(torch.tensor(scattered, dtype=torch.float64), summed[rows].detach(),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), x.grad[rows], rtol=1e-12, atol=1e-12)
