"""Demo flags and the three ways to start it: in this process, ``--nproc`` through torch's
launcher, and ``torchrun`` running the module; multi-rank runs reproduce the one-process losses."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tmetrics_core.demo.data import stdlib_files
from tmetrics_core.demo.launch import DemoArgs, demo_options, parse, run_demo
from tmetrics_core.errors import ConfigError

STEPS = 3


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "stdlib-head.py"
    path.write_bytes(b"".join(f.read_bytes() for f in stdlib_files()[:10]))
    return path


@pytest.fixture(scope="module")
def single_losses(text: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("single")
    run_demo(DemoArgs(steps=STEPS, seed=1, run_dir=run_dir, data=text))
    return json.loads((run_dir / "demo.json").read_text())["losses"]


def test_flags_parse_into_demo_args() -> None:
    args = parse(["--steps", "7", "--seed", "2", "--run-dir", "out", "--sink", "tensorboard, mlflow",
                  "--nproc", "4", "--dp", "2", "--tp", "2", "--fsdp", "--lr", "0.01", "--inject", "nan-grad"])
    assert args == DemoArgs(steps=7, seed=2, run_dir=Path("out"), sink=("tensorboard", "mlflow"), nproc=4,
                            dp=2, tp=2, fsdp=True, lr=0.01, inject="nan-grad")
    assert parse([]) == DemoArgs()
    with pytest.raises(click.BadParameter):
        parse(["--inject", "explode"])


def test_every_flag_is_a_demo_args_field() -> None:
    command = click.command()(demo_options(lambda **kwargs: None))
    assert [p.name for p in command.params] == [f.name for f in dataclasses.fields(DemoArgs)]
    assert {opt for p in command.params for opt in p.opts} == {
        "--steps", "--seed", "--run-dir", "--config", "--sink", "--nproc", "--dp", "--tp", "--ep", "--fsdp",
        "--pp", "--lr", "--inject", "--data"}


def test_single_process_run_writes_its_record(text: Path, tmp_path: Path, single_losses: list[float],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_demo(DemoArgs(steps=STEPS, seed=1, run_dir=tmp_path, data=text))
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["losses"] == single_losses and len(single_losses) == STEPS
    assert record["model"]["d_model"] == 128 and record["data"] == str(text)
    assert (summary.steps, summary.world_size, summary.topology) == (STEPS, 1, "single process")
    assert summary.final_loss == single_losses[-1] and summary.tokens_per_second > 0
    assert str(tmp_path / "demo.json") in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_nproc_launches_ranks_that_reproduce_one_process(text: Path, tmp_path: Path,
                                                         single_losses: list[float]) -> None:
    summary = run_demo(DemoArgs(steps=STEPS, seed=1, run_dir=tmp_path, data=text, nproc=2, ep=2))
    assert (summary.world_size, summary.topology) == (2, "ep=2")
    losses = json.loads((tmp_path / "demo.json").read_text())["losses"]
    assert losses == pytest.approx(single_losses, rel=1e-5)


@pytest.mark.timeout(240)
def test_torchrun_runs_the_module(text: Path, tmp_path: Path, single_losses: list[float]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "tmetrics_core.demo.launch", "--steps", str(STEPS), "--seed", "1", "--tp", "2",
               "--run-dir", str(tmp_path), "--data", str(text)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["summary"]["topology"] == "tp=2"
    assert record["losses"] == pytest.approx(single_losses, rel=1e-5)


def test_degrees_must_fit_the_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a multiple") as err:
        run_demo(DemoArgs(steps=1, run_dir=tmp_path, tp=2))
    assert err.value.path == "--nproc"
    with pytest.raises(ConfigError, match="1\\*2\\*1\\*2\\*1 = 4, but the world size is 2"):
        run_demo(DemoArgs(steps=1, run_dir=tmp_path, nproc=2, dp=2, tp=2))
    with pytest.raises(ConfigError, match="combines with --pp only") as err:
        run_demo(DemoArgs(steps=1, run_dir=tmp_path, nproc=4, dp=2, ep=2))
    assert err.value.path == "--ep"
