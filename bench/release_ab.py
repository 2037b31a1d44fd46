"""This tree's every-step cost next to an earlier release's, measured in turn in one run.

    python -m bench.release_ab REV [--runs 2] [--pairs 300]

On a shared CPU machine the same code's every-step overhead moves by more than a percent within
an hour (docs/performance.md, Table 1), so a figure measured on another day says little about a
change. This checks out ``REV`` (a commit of this repository whose ``bench.step_overhead`` has
``--pairs``, from 30 November 2026 on) into a temporary git worktree and runs each tree's own
``python -m bench.step_overhead --rounds 2 --pairs PAIRS --no-ddp --no-memory --no-alternatives``
in turn, ``--runs`` times (the order swapped every run), with this interpreter and each tree on
``PYTHONPATH``. It prints, per run and tree, the bundle's every-step cost in paired single steps
(mean difference +- standard error), the bare step, the directly timed tmetrics code of a due
step (and its passes over tensor elements), and the torch ops a due step issues; then the mean
over runs per tree. The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ReleaseRun", "main", "parse"]

ROOT = Path(__file__).resolve().parents[1]

_PAIRED = re.compile(r"every step \((\d+) pairs.*?bare step ([\d.]+) ms\): every 1 ([+-][\d.]+)% \+- ([\d.]+)%")
_CODE = re.compile(r"due step, timed directly.*?: ([\d.]+) ms of tmetrics code.*?, ([\d.]+) ms of it in passes")
_OPS = re.compile(r"due step: torch ops issued by tmetrics: (\d+)")


@dataclass(frozen=True)
class ReleaseRun:
    """One ``bench.step_overhead`` run of one tree: every-step overhead in paired single steps
    (percent of a bare step, with its standard error), the bare step (ms), the tmetrics code of a
    due step timed directly and its passes (ms), and the torch ops of a due step."""

    overhead_pct: float
    error_pct: float
    bare_ms: float
    code_ms: float
    passes_ms: float
    ops: int


def parse(output: str) -> ReleaseRun:
    """The figures of one ``bench.step_overhead`` output.

    Raises:
        ValueError: a figure is missing (a tree whose bench predates ``--pairs``), with the
            output's last lines.
    """
    paired, code, ops = _PAIRED.search(output), _CODE.search(output), _OPS.search(output)
    if paired is None or code is None or ops is None:
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise ValueError(f"bench.step_overhead printed no paired single-step, due-step or op-count line "
                         f"(a release before 30 November 2026 has no --pairs); its output ended:\n{tail}")
    return ReleaseRun(float(paired.group(3)), float(paired.group(4)), float(paired.group(2)),
                      float(code.group(1)), float(code.group(2)), int(ops.group(1)))


def _measure(tree: Path, pairs: int) -> ReleaseRun:
    command = [sys.executable, "-m", "bench.step_overhead", "--rounds", "2", "--pairs", str(pairs),
               "--no-ddp", "--no-memory", "--no-alternatives"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"bench.step_overhead failed in {tree} (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return parse(done.stdout)


def _line(label: str, r: ReleaseRun) -> str:
    return (f"{label:<24} {r.overhead_pct:+7.2f}% +- {r.error_pct:4.2f}% {r.bare_ms:9.1f} {r.code_ms:9.2f} "
            f"{r.passes_ms:8.2f} {r.ops:5d}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the earlier release: a commit, tag or branch of this repository")
    parser.add_argument("--runs", type=int, default=2, help="runs of each tree, in turn (default 2)")
    parser.add_argument("--pairs", type=int, default=300, help="single-step pairs per run (default 300)")
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="tmetrics-release-") as tmp:
        other = Path(tmp) / "tree"
        added = subprocess.run(["git", "worktree", "add", "--detach", str(other), args.rev], cwd=ROOT,
                               capture_output=True, text=True, check=False)
        if added.returncode:
            raise SystemExit(f"cannot check out {args.rev!r}: {added.stderr.strip()}")
        trees = {f"this tree ({head})": ROOT, args.rev: other}
        runs: dict[str, list[ReleaseRun]] = {label: [] for label in trees}
        print(f"{'run, tree':<24} {'every 1 (paired)':>18} {'bare ms':>9} {'code ms':>9} {'passes':>8} {'ops':>5}")
        try:
            for i in range(args.runs):
                order = list(trees.items())
                for label, tree in order if i % 2 == 0 else order[::-1]:
                    runs[label].append(_measure(tree, args.pairs))
                    print(_line(f"{i + 1} {label}", runs[label][-1]), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
    for label, rs in runs.items():
        if rs:
            print(f"mean over {len(rs)} runs, {label}: every 1 {statistics.fmean(r.overhead_pct for r in rs):+.2f}%, "
                  f"tmetrics code {statistics.fmean(r.code_ms for r in rs):.2f} ms per due step")


if __name__ == "__main__":
    main()
