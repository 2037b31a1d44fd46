"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

``run_distributed(fn, world_size, *args, timeout=...)`` spawns ``world_size`` processes, each
calling ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` (collective
timeout bounded too), and returns the per-rank return values in rank order. A rank that raises
fails the call with every rank's traceback; a hang fails it after ``timeout`` seconds and kills
the ranks, so a broken collective schedule fails a test instead of hanging CI.
``fn`` and its arguments must be picklable (module-level functions).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
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


def _entry(rank: int, world_size: int, port: int, collective_timeout: float, backend: str,
           fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
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
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    collective_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return values by rank.
    ``backend`` is the default group's (``"cuda:gloo"``: a default group that carries no CPU
    tensor, as under ``init_process_group("nccl")``).

    Raises :class:`RankFailure` when a rank raises, exits without a result, or the whole run
    exceeds ``timeout`` seconds (all ranks are then killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, collective_timeout, backend, fn, args, results),
                    daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcome[rank] = (ok, payload)
            if not ok:
                # One rank failed; give the others a moment to report, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(outcome.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcome]
    if failures or missing:
        parts = failures + ([f"ranks {missing} gave no result within {timeout:.0f} s (hang or crash)"]
                            if missing else [])
        raise RankFailure("\n".join(parts))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
