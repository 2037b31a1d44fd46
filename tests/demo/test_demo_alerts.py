"""The demo's injections raise the right alert through the real pipeline (demo -> TensorMetrics ->
hub -> jsonl sink -> alerts.jsonl): at the injection step, first among that step's alerts, naming
the injected layer (and expert). Six steps with a one-value warm-up keep it fast; the 300-step
runs with ``alerts: default`` are measured in docs/alerts.md."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tmetrics_core.demo.instrument import alert_note, make_metrics
from tmetrics_core.demo.launch import DemoArgs, run_demo

CONFIG = Path(__file__).parents[1] / "data" / "demo_alerts.yaml"
EXPECTED = {  # injection -> (rule, metric, layer, expert) of the first alert at step 2
    "lr-spike": ("update-ratio-spike", "layer-update-ratio", 2, None),
    "dead-expert": ("dead-expert", "layer-expert-tokens", 2, 3),
    "nan-grad": ("nonfinite-gradients", "layer-grad-l2", 2, None),
}


@pytest.fixture(scope="module")
def alerts(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    tmp = tmp_path_factory.mktemp("alerts")
    out = {}
    for kind in EXPECTED:
        args = DemoArgs(run_dir=tmp / kind, config=CONFIG, steps=6, inject=kind, lr=1e-3)
        run_demo(args, metrics=functools.partial(make_metrics, args))
        path = args.run_dir / "alerts.jsonl"
        out[kind] = (args.run_dir, [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else [])
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_injection_raises_its_alert_first_at_the_injection_step(alerts, kind):
    run_dir, events = alerts[kind]
    opened = [a for a in events if a["state"] == "open"]
    assert opened and opened[0]["step"] == 2, events
    first = opened[0]
    assert (first["rule"], first["metric"], first["labels"].get("layer"), first["labels"].get("expert")) == \
        EXPECTED[kind]
    assert all(a["step"] >= 2 for a in opened)
    assert all(a["first"]["layer"] == 2 for a in opened if a["step"] - 2 <= 10)
    note = alert_note(run_dir)
    assert note[1].startswith(f"  injected {kind} at step 2 in layer 2") and f"OPEN {EXPECTED[kind][0]}" in note[1]
