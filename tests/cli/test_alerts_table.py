"""`tmetrics alerts RUN_DIR` and the demo's closing note read a run's alerts.jsonl back."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from tmetrics_core.alerts import AlertEngine
from tmetrics_core.cli.main import main
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.demo.instrument import alert_note
from tmetrics_core.records import Labels, MetricRecord


def R(metric: str, step: int, value, **labels) -> MetricRecord:
    return MetricRecord(metric, step, value, Labels(**labels))


def _run_dir(tmp_path, *, inject=None):
    engine = AlertEngine(parse_alerts("default"))
    lines = []
    for step in range(1, 13):
        records = [R("layer-grad-l2", step, 1.0, layer=layer) for layer in range(3)]
        if step == 12:
            records = [R("layer-grad-l2", step, math.nan, layer=2), R("global-grad-l2", step, math.nan)]
        lines += [json.dumps(a.to_json()) for a in engine.observe(records, step)]
    (tmp_path / "alerts.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "metrics.jsonl").write_text("")
    if inject is not None:
        (tmp_path / "demo.json").write_text(json.dumps({"train": {"inject": inject}}))
    return tmp_path


def test_alerts_command_prints_the_table(tmp_path):
    result = CliRunner().invoke(main, ["alerts", str(_run_dir(tmp_path))])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert rows[0] == ["step", "state", "rule", "metric", "where", "value", "baseline", "jump", "first"]
    assert rows[1][:7] == ["12", "open", "nonfinite-gradients", "layer-grad-l2", "layer", "2", "nan"]
    assert rows[1][-1] == "(this)"
    assert rows[2][:5] == ["12", "open", "nonfinite-gradients", "global-grad-l2", "global"]
    assert " ".join(rows[2][-7:]) == "nonfinite-gradients layer-grad-l2 layer 2 at step 12"


def test_alerts_command_on_a_run_without_alerts_and_on_a_missing_dir(tmp_path):
    assert CliRunner().invoke(main, ["alerts", str(tmp_path)]).output == "no alerts\n"
    missing = CliRunner().invoke(main, ["alerts", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "need a run directory" in missing.output


def test_closing_note_names_the_alert_of_the_injected_layer(tmp_path):
    run = _run_dir(tmp_path, inject={"kind": "nan-grad", "layer": 2, "start_step": 12, "expert": 3})
    note = alert_note(run)
    assert note[0].startswith("  alerts:       2 opened;")
    assert note[1] == ("  injected nan-grad at step 12 in layer 2; alert: step 12 OPEN nonfinite-gradients "
                       "layer-grad-l2 layer 2: nan vs baseline 1 (jump inf)")
    assert alert_note(tmp_path / "nowhere") == []
