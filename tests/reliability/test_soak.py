"""Soak (issue 8, done-when): a 2,000-step run on 2 gloo ranks whose sink fails 30% of its calls
at random (seeded), killed with SIGTERM at step 1,500 while it trains.

Afterwards every completed step is in the backend or the spool, each record exactly once with the
value the step produced, and ``replay`` of the spool completes the backend.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import rows
from tmetrics_core.sinks.jsonl import JsonlSink
from tmetrics_core.records import MetricRecord
from tmetrics_core.hub.replay import replay
from tmetrics_core.hub.spool import SpoolReader, spool_path

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_AT = 2000, 1500


def _records(path: Path) -> list[MetricRecord]:
    return [e for e in SpoolReader(path) if isinstance(e, MetricRecord)] if path.exists() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_step(progress: Path) -> int:
    text = progress.read_text() if progress.exists() else ""
    lines = text.split("\n")
    complete = lines[:-1] if not text.endswith("\n") else lines  # a line being written is not a step yet
    return max((int(line) for line in complete if line), default=0)


def test_two_ranks_flaky_sink_killed_at_1500_lose_nothing_and_replay_completes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = _free_port()
    command = [sys.executable, "-m", "tests.reliability.soak_job", str(tmp_path), "RANK", "2", str(port), str(STEPS)]
    rank0 = subprocess.Popen([*command[:4], "0", *command[5:]], cwd=tmp_path, env=env, process_group=0,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rank1 = subprocess.Popen([*command[:4], "1", *command[5:]], cwd=tmp_path, env=env, process_group=rank0.pid,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    progress = tmp_path / "progress"
    started = time.monotonic()
    try:
        while _last_step(progress) < KILL_AT:
            assert rank0.poll() is None, rank0.stdout.read().decode()[-3000:]
            assert time.monotonic() - started < 150, f"step {_last_step(progress)} after 150 s"
            time.sleep(0.002)
        os.killpg(rank0.pid, signal.SIGTERM)  # the whole job, while it trains
        output = rank0.communicate(timeout=60)[0].decode()
        rank1.wait(timeout=60)
    finally:
        for job in (rank0, rank1):
            if job.poll() is None:
                job.kill()
    assert rank0.returncode == -signal.SIGTERM, output[-3000:]

    last = _last_step(progress)
    assert KILL_AT <= last < STEPS  # killed while training, not after it finished
    produced = [r for r in _records(tmp_path / "produced.jsonl") if r.step <= last]
    assert {r.step for r in produced} == set(range(1, last + 1))
    backend_path = tmp_path / "backend.jsonl"
    spool = spool_path(tmp_path / "spool", "flaky")
    backend = [r for r in _records(backend_path) if r.step <= last]
    spooled = [r for r in _records(spool) if r.step <= last]
    # Both paths were taken, and together they hold every record of every step once, same values.
    assert backend and spooled, (len(backend), len(spooled))
    assert {r.step for r in backend} | {r.step for r in spooled} == set(range(1, last + 1))
    assert sorted(rows(backend + spooled)) == sorted(rows(produced))

    replayed = replay(spool, JsonlSink(path=str(backend_path)))
    assert replayed == len(_records(spool))
    complete = [r for r in _records(backend_path) if r.step <= last]
    assert sorted(rows(complete)) == sorted(rows(produced))
    print(f"\nsoak: killed after step {last} in {time.monotonic() - started:.1f} s; "
          f"{len(produced)} records, {len(spooled)} from the spool")
