"""In-process simulation of N ranks: threads that exchange tensors through shared memory.

For wide property sweeps (hypothesis) where spawning real processes per example would be too
slow. ``SimCollectives`` implements the executor's three collectives for one simulated rank;
a call whose peers never arrive raises ``TimeoutError`` (a hang in a real job), and an
all_reduce whose ranks pass different shapes raises ``RuntimeError`` (corruption or a hang on
NCCL/gloo). The real multi-process gloo tests in ``tests/distributed`` remain the reference.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from tmetrics_core.topology import Axis, Topology

__all__ = ["SimCollectives", "SimWorld", "mesh_coords", "run_threaded", "sim_topology"]


class SimWorld:
    """Shared state of one simulated job of ``world_size`` ranks."""

    def __init__(self, world_size: int, timeout: float = 20.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, dict[int, Any]] = {}
        self.readers: dict[tuple, int] = {}


class SimCollectives:
    """The executor's collectives for simulated rank ``rank`` of ``world``; groups are tuples
    of global ranks (None is the whole world)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.counters: dict[tuple[int, ...], int] = {}
        self.calls = 0

    def _exchange(self, group: Sequence[int] | None, payload: Any) -> list[Any]:
        ranks = tuple(group) if group is not None else tuple(range(self.world.world_size))
        seq = self.counters.get(ranks, 0)
        self.counters[ranks] = seq + 1
        key = (ranks, seq)
        self.calls += 1
        w = self.world
        with w.cond:
            w.slots.setdefault(key, {})[self.rank] = payload
            w.cond.notify_all()
            if not w.cond.wait_for(lambda: len(w.slots[key]) == len(ranks), timeout=w.timeout):
                raise TimeoutError(f"rank {self.rank}: peers of group {ranks} never joined collective #{seq}")
            values = [w.slots[key][r] for r in ranks]
            w.readers[key] = w.readers.get(key, 0) + 1
            if w.readers[key] == len(ranks):
                del w.slots[key], w.readers[key]
        return values

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> None:
        values = self._exchange(group, tensor.detach().clone())
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise RuntimeError(f"all_reduce with mismatched shapes {sorted(shapes)} in group {group}")
        stacked = torch.stack(values)
        if op == "sum":
            out = stacked.sum(0)
        elif op == "max":
            out = stacked.max(0).values if stacked.numel() else stacked.sum(0)
        else:
            out = stacked.min(0).values if stacked.numel() else stacked.sum(0)
        tensor.copy_(out)

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        return [v.clone() for v in self._exchange(group, tensor.detach().clone())]

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        return self._exchange(group, obj)


def mesh_coords(rank: int, shape: Sequence[int]) -> list[int]:
    """Row-major coordinates of ``rank`` in a mesh of ``shape``."""
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return list(reversed(coords))


def sim_topology(rank: int, shape: Sequence[int], names: Sequence[str]) -> Topology:
    """The topology simulated rank ``rank`` sees in a row-major mesh (groups = rank tuples)."""
    world = 1
    for s in shape:
        world *= s
    coords = mesh_coords(rank, shape)
    axes = []
    for i, name in enumerate(names):
        ranks = tuple(r for r in range(world)
                      if all(c == o for j, (c, o) in enumerate(zip(mesh_coords(r, shape), coords)) if j != i))
        axes.append(Axis(name, shape[i], coords[i], ranks if shape[i] > 1 else None, ranks))
    ranks = torch.arange(world).reshape(tuple(shape))
    return Topology(axes, global_rank=rank, world_size=world, mesh_ranks=ranks,
                    new_groups=lambda lists: next(tuple(g) for g in lists if rank in g))


def run_threaded(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, SimCollectives, *args)`` on ``world_size`` threads; return
    values by rank; re-raise the first rank's exception; ``TimeoutError`` on a hang."""
    world = SimWorld(world_size, timeout=min(timeout, 20.0))
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world_size, SimCollectives(world, rank), *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated ranks still running after {timeout} s (hang)")
    for err in errors:
        if err is not None:
            raise err
    return results
