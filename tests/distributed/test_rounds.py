"""Rounds: a round too large to gather is all-reduced without a float64 copy of its requests;
a small one is gathered in one call; values exact either way (simulated ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.simulation import run_threaded, sim_topology
from tmetrics_core.distributed.rounds import _GATHER_LIMIT, CollectiveStats, Rounds
from tmetrics_core.metrics.base import CollectiveRequest


class _Widened(TorchDispatchMode):
    """Elements copied to float64 on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and (kwargs or {}).get("dtype") == torch.float64:
            self.elements += out.numel()
        return out


def _values(rank: int, n: int) -> dict[str, torch.Tensor]:
    """float32 values of rank ``rank``: exact in float32, distinct per rank."""
    base = torch.arange(n, dtype=torch.float32) % 1000
    return {"sum": base + rank, "max": base * (rank + 1), "min": base - 3 * rank}


def _round_rank(rank, world, comm, n):
    topology = sim_topology(rank, (world,), ("dp",))
    stats = CollectiveStats()
    rounds = Rounds(topology, comm, torch.device("cpu"), stats)
    requests = [CollectiveRequest(op, ("dp",), op, value, uniform=True) for op, value in _values(rank, n).items()]
    with _Widened() as widened:
        out = rounds.reduce(requests)
    return out, widened.elements, dict(stats.calls)


@pytest.mark.parametrize("n", [100, _GATHER_LIMIT // 2])
def test_a_round_is_widened_to_float64_only_when_it_is_gathered(n):
    world = 2
    everyone = [_values(rank, n) for rank in range(world)]
    reference = {"sum": sum(v["sum"].double() for v in everyone),
                 "max": torch.stack([v["max"] for v in everyone]).amax(0).double(),
                 "min": torch.stack([v["min"] for v in everyone]).amin(0).double()}
    gathered = 3 * n * world <= _GATHER_LIMIT
    for out, widened, calls in run_threaded(_round_rank, world, n, timeout=30):
        for op in ("sum", "max", "min"):
            assert torch.equal(out[op].double(), reference[op])
        if gathered:  # one all_gather of the three, packed in float64
            assert calls == {"dp": 1} and widened == 3 * n
        else:  # sum, and max with min negated in it: two all_reduces in float32, nothing widened
            assert calls == {"dp": 2} and widened == 0 and out["sum"].dtype == torch.float32
