"""The demo with tmetrics attached, end to end through ``run_demo`` and the jsonl sink:
per-layer norms and cotangent statistics at step 1 are the same on every topology, and each ``--inject`` failure shows
up in the metric that should show it."""

from __future__ import annotations

import functools
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from tmetrics_core.demo.instrument import make_metrics, where
from tmetrics_core.demo.launch import DemoArgs, run_demo

CONFIG = Path(__file__).parents[1] / "data" / "demo_metrics.yaml"
TOPOLOGIES = {
    "single": {},
    "dp2": {"nproc": 2, "dp": 2},
    "tp2": {"nproc": 2, "tp": 2},
    "dp2xtp2": {"nproc": 4, "dp": 2, "tp": 2},
    "ep2": {"nproc": 2, "ep": 2},
    "fsdp4": {"nproc": 4, "fsdp": True},
}


INVARIANT = ("layer-param-l2", "layer-grad-l2", "layer-residual-grad-rms", "layer-backward-gain")
"""Step-1 records equal on every topology (cotangents: of the loss the optimizer applies)."""


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _demo(tmp: Path, name: str, **flags) -> list[dict]:
    args = DemoArgs(run_dir=tmp / name, config=CONFIG, **flags)
    run_demo(args, metrics=functools.partial(make_metrics, args))
    return _records(args.run_dir)


@pytest.fixture(scope="module")
def step1(tmp_path_factory) -> dict[str, dict[tuple, float]]:
    tmp = tmp_path_factory.mktemp("topologies")
    out = {}
    for name, flags in TOPOLOGIES.items():
        records = _demo(tmp, name, steps=1, **flags)
        out[name] = {(r["metric"], r["labels"].get("layer")): r["value"] for r in records
                     if r["metric"] in INVARIANT + ("loss", "lr") and r["step"] == 1}
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("topology", [t for t in TOPOLOGIES if t != "single"])
def test_step1_norms_are_topology_invariant(step1, topology):
    ref = step1["single"]
    got = step1[topology]
    assert len(ref) == 16 + 2  # 4 layers x 4 metrics, and the loop's loss and learning rate (metrics.log)
    assert ref[("loss", None)] == pytest.approx(math.log(256), abs=0.1) and ref[("lr", None)] > 0
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


@pytest.fixture(scope="module")
def injected(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("inject")
    return {kind: _demo(tmp, kind, steps=6, inject=kind, lr=1e-3) for kind in ("lr-spike", "dead-expert", "nan-grad")}


def _by_layer(records, metric, step, stat=None):
    return {r["labels"]["layer"]: r["value"] for r in records
            if r["metric"] == metric and r["step"] == step and r["labels"].get("stat") == stat}


@pytest.mark.timeout(600)
def test_lr_spike_shows_in_update_ratio_of_that_layer(injected):
    # 6 steps: the spike starts at step 2 in layer 2 (x1000 learning rate).
    records = injected["lr-spike"]
    during = _by_layer(records, "layer-update-ratio", 3)
    before = _by_layer(records, "layer-update-ratio", 1)
    assert max(during, key=during.get) == 2
    assert during[2] > 50 * before[2]
    assert all(during[layer] < 5 * before[layer] for layer in during if layer != 2)


@pytest.mark.timeout(600)
def test_dead_expert_shows_in_expert_tokens_and_dead_count(injected):
    records = injected["dead-expert"]  # from step 2, layer 2, expert 3 gets no token
    tokens = {r["step"]: r["value"] for r in records
              if r["metric"] == "layer-expert-tokens" and r["labels"].get("layer") == 2}
    assert tokens[1][3] > 0
    assert all(tokens[step][3] == 0 for step in range(2, 7))
    dead = _by_layer(records, "layer-dead-experts", 4)
    assert dead[2] >= 1


@pytest.mark.timeout(600)
def test_nan_grad_is_counted_in_that_layer_only(injected):
    records = injected["nan-grad"]  # step 2: every element of layers.2.attn.q.weight's grad is NaN
    nan = {(r["step"], r["labels"]["layer"]): r["value"] for r in records
           if r["metric"] == "layer-grad-nonfinite" and r["labels"].get("stat") == "nan"}
    assert nan[(2, 2)] == 128 * 128
    assert all(v == 0 for (step, layer), v in nan.items() if (step, layer) != (2, 2))
    finite = [r["value"] for r in records if r["metric"] == "layer-grad-l2" and r["step"] != 2]
    assert finite and all(math.isfinite(v) for v in finite)


def test_closing_note_names_commands_that_run_without_an_activated_environment(tmp_path, monkeypatch):
    """Where the trackers' commands are not on PATH (a venv not activated), the note gives the
    copies next to this Python, so they can be pasted as printed."""
    (tmp_path / "tb").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    note = where(tmp_path, mlflow_uri="sqlite:///x.db")
    beside = Path(sys.executable).parent
    for tool in ("tensorboard", "mlflow"):
        line = next(line for line in note.splitlines() if f"{tool} " in line)
        command = line.split(":", 1)[1].split()[0]
        assert Path(command).resolve() == (beside / tool).resolve(), line
    assert f"JSONL:        {tmp_path / 'metrics.jsonl'}" in note
