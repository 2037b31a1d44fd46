"""The process's exit and signal handlers (tmetrics_core.hub.exits), each in a fresh interpreter.

The exit hook closes what is still open, last registered first, and not what closed by itself;
after Ctrl-C it freezes the collector, after a normal exit it does not. SIGTERM closes, then
reaches the handler that was installed before. The README's loop under Ctrl-C, with three real
trackers, is tests/reliability/test_interrupt.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

EXIT_JOB = """
import atexit, gc, sys
from tmetrics_core.hub import exits
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))  # runs after the exit hook
closers = {name: lambda name=name: print("closed", name, flush=True) for name in ("first", "second", "released")}
for closer in closers.values():
    exits.close_at_exit(closer)
exits.release(closers["released"])
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=50, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("end", ["normal", "interrupt"])
def test_the_exit_hook_closes_what_is_open_last_first_and_freezes_the_collector_after_ctrl_c(end):
    job = run(EXIT_JOB, end)
    assert job.returncode == (0 if end == "normal" else -signal.SIGINT), job.stderr
    assert job.stdout.splitlines() == ["closed second", "closed first", f"frozen {end == 'interrupt'}"]


def test_sigterm_closes_then_reaches_the_handler_installed_before():
    job = run("""
        import os, signal
        from tmetrics_core.hub import exits
        signal.signal(signal.SIGTERM, lambda signum, frame: print("previous handler", signum == signal.SIGTERM))
        exits.on_sigterm(lambda: print("closed"))
        os.kill(os.getpid(), signal.SIGTERM)
        print("handler now the previous one:", signal.getsignal(signal.SIGTERM).__name__ == "<lambda>")
        """)
    assert job.returncode == 0, job.stderr
    assert job.stdout.splitlines() == ["closed", "previous handler True", "handler now the previous one: True"]


def test_sigterm_with_the_default_handler_closes_then_ends_the_process():
    job = run("""
        import os, signal, time
        from tmetrics_core.hub import exits
        exits.on_sigterm(lambda: print("closed", flush=True))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("still alive")
        """)
    assert job.returncode == -signal.SIGTERM
    assert job.stdout.splitlines() == ["closed"]
