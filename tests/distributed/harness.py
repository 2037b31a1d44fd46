"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

``run_distributed(fn, world_size, *args, timeout=...)`` runs ``fn(rank, world_size, *args)`` on
``world_size`` processes that joined ``init_process_group("gloo")`` (collective timeout bounded
too), and returns the per-rank return values in rank order. A rank that raises fails the call
with every rank's traceback; a hang fails it after ``timeout`` seconds and kills the ranks, so a
broken collective schedule fails a test instead of hanging CI.
``fn`` and its arguments must be picklable (module-level functions).

Worlds are kept between calls, as PyTorch's ``MultiProcContinuousTest`` keeps one world per test
class: one world per (world size, backend, collective timeout) serves every call from one test
module, so each rank imports torch and the frameworks once per module instead of once per call
(about 1.6 to 1.9 s a world). A world is retired when a call from another module arrives, when a
call fails or hangs, or when ``fn`` destroyed the default group. A call that fails in a world
that already served other calls is run once more in a fresh world, so state a previous call left
behind (a framework's global parallel state, compile caches) can never fail a test: only a
failure in a fresh world is reported. ``TMETRICS_TEST_FRESH_WORLDS=1`` spawns a world per call.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import queue
import socket
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["RankFailure", "run_distributed"]


class RankFailure(RuntimeError):
    """One or more ranks raised or did not finish; the message holds their tracebacks."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, collective_timeout: float, backend: str,
           tasks: Any, results: Any) -> None:
    """One rank of a kept world: join the group once, then run calls until told to stop."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
        )
        while True:
            task = tasks.get()
            if task is None:
                break
            call_id, fn, args = task
            try:
                value = fn(rank, world_size, *args)
                results.put((call_id, rank, True, pickle.dumps(value), dist.is_initialized()))
            except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
                results.put((call_id, rank, False, traceback.format_exc(), dist.is_initialized()))
            if not dist.is_initialized():
                break
    except BaseException:  # noqa: BLE001 - the group could not be joined: report to every call
        results.put((-1, rank, False, traceback.format_exc(), False))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _World:
    """``world_size`` kept ranks; ``served`` counts the calls they completed."""

    def __init__(self, world_size: int, backend: str, collective_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_serve, daemon=True,
                        args=(rank, world_size, port, collective_timeout, backend, self.tasks[rank],
                              self.results))
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.served = 0

    def call(self, call_id: int, fn: Callable[..., Any], args: tuple[Any, ...],
             timeout: float) -> tuple[dict[int, tuple[bool, Any]], bool]:
        """Run one call; return each rank's (ok, payload) and whether the world can serve again."""
        for q in self.tasks:
            q.put((call_id, fn, args))
        outcome: dict[int, tuple[bool, Any]] = {}
        reusable = True
        deadline = time.monotonic() + timeout
        while len(outcome) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                got_id, rank, ok, payload, initialized = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in self.procs) and self.results.empty():
                    break
                continue
            if got_id not in (call_id, -1):
                continue
            outcome[rank] = (ok, payload)
            reusable = reusable and ok and initialized
            if not ok:
                # One rank failed; give the others a moment to report, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
        if len(outcome) < self.world_size:
            reusable = False
        self.served += 1
        return outcome, reusable

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


_worlds: dict[tuple[str, int, str, float], _World] = {}
_call_ids = itertools.count()


def _retire(key: tuple[str, int, str, float]) -> None:
    world = _worlds.pop(key, None)
    if world is not None:
        world.close()


def _retire_all() -> None:
    for key in list(_worlds):
        _retire(key)


atexit.register(_retire_all)


def _failure(outcome: dict[int, tuple[bool, Any]], world_size: int, timeout: float) -> str | None:
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if not failures and not missing:
        return None
    return "\n".join(failures + ([f"ranks {missing} gave no result within {timeout:.0f} s (hang or crash)"]
                                 if missing else []))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    collective_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return values by rank.
    ``backend`` is the default group's (``"cuda:gloo"``: a default group that carries no CPU
    tensor, as under ``init_process_group("nccl")``).

    Raises :class:`RankFailure` when a rank raises, exits without a result, or the call exceeds
    ``timeout`` seconds (all ranks are then killed), in a fresh world.
    """
    module = getattr(fn, "__module__", "")
    for key in [k for k in _worlds if k[0] != module]:
        _retire(key)
    key = (module, world_size, backend, float(collective_timeout))
    fresh_only = os.environ.get("TMETRICS_TEST_FRESH_WORLDS") == "1"
    while True:
        world = _worlds.get(key)
        if world is None:
            world = _World(world_size, backend, collective_timeout)
            _worlds[key] = world
        kept = world.served > 0
        outcome, reusable = world.call(next(_call_ids), fn, args, timeout)
        if not reusable or fresh_only:
            _retire(key)
        message = _failure(outcome, world_size, timeout)
        if message is None:
            return [pickle.loads(outcome[r][1]) for r in range(world_size)]
        if not kept:
            raise RankFailure(message)
        warnings.warn(f"{module}.{getattr(fn, '__qualname__', fn)} failed in a world kept from an earlier "
                      "call; run again in a fresh world", RuntimeWarning, stacklevel=2)
