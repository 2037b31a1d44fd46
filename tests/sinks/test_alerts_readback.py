"""Each sink's alert output, read back from its files or store."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.sinks.conftest import make_records
from tests.sinks.readback_mlflow import artifact_json, run_by_id
from tests.sinks.readback_tensorboard import read_log
from tests.sinks.readback_wandb import find_run_file, read_run
from tmetrics_core.alerts import Alert, AlertEngine
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.records import Labels, MetricRecord, RunInfo
from tmetrics_core.sinks.console import ConsoleSink
from tmetrics_core.sinks.jsonl import JsonlSink
from tmetrics_mlflow import MlflowSink
from tmetrics_tb.sink import TensorBoardSink
from tmetrics_wandb import WandbSink
from tmetrics_wandb.sink import ALERTS_KEY


def _steps() -> list[tuple[int, list[MetricRecord], list[Alert]]]:
    """Three steps of the sink test records through one threshold rule: layer 2's grad norm
    trips at step 2 (layer 1 too, by less) and recovers at step 3; a NaN trips at step 2."""
    engine = AlertEngine(parse_alerts([{"kind": "threshold", "metric": "layer-grad-l2", "above": 2.05}]))
    out = []
    for step in (1, 2, 3):
        records = make_records(step)
        if step == 3:
            records = [MetricRecord(r.metric, r.step, 1.0, labels=Labels(layer=r.layer)) if r.metric == "layer-grad-l2" else r
                       for r in records]
        out.append((step, records, engine.observe(records, step)))
    return out


def _drive(sink, run_info: RunInfo) -> list[Alert]:
    sink.open(run_info)
    sent = []
    for step, records, alerts in _steps():
        sink.write(records, step)
        if alerts:
            sink.write_alerts(alerts, step)
            sent += alerts
    sink.flush()
    sink.close("finished")
    return sent


def test_the_stream_raises_what_the_sinks_are_checked_for() -> None:
    by_step = {s: [(a.state, a.rule, a.labels.layer) for a in alerts] for s, _, alerts in _steps()}
    # output-entropy is NaN at step 2, but it is not a gradient metric: only the threshold trips
    assert by_step == {1: [],
                       2: [("open", "layer-grad-l2-threshold", 2), ("open", "layer-grad-l2-threshold", 1)],
                       3: [("closed", "layer-grad-l2-threshold", 1), ("closed", "layer-grad-l2-threshold", 2)]}


def test_jsonl_writes_alerts_jsonl(run_info: RunInfo) -> None:
    sent = _drive(JsonlSink(), run_info)
    lines = (Path(run_info.dir) / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [a.to_json() for a in sent]
    first = json.loads(lines[0])
    assert (first["step"], first["state"], first["labels"], first["value"], first["baseline"]) == \
        (2, "open", {"layer": 2}, 2.2, 2.05)
    assert first["first"] == {"step": 2, "rule": "layer-grad-l2-threshold", "metric": "layer-grad-l2", "layer": 2}


def test_console_prints_one_warning_line_per_alert(run_info: RunInfo, capsys: pytest.CaptureFixture[str]) -> None:
    _drive(ConsoleSink(every=1000), run_info)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tmetrics ALERT")]
    assert lines == [
        "tmetrics ALERT step 2 OPEN layer-grad-l2-threshold layer-grad-l2 layer 2: 2.2 vs baseline 2.05 (1.07x)",
        "tmetrics ALERT step 2 OPEN layer-grad-l2-threshold layer-grad-l2 layer 1: 2.1 vs baseline 2.05 (1.02x); "
        "first: layer-grad-l2-threshold layer-grad-l2 layer 2 at step 2",
        "tmetrics ALERT step 3 CLOSED layer-grad-l2-threshold layer-grad-l2 layer 1: 1 vs baseline 2.05 (2.05x); "
        "first: layer-grad-l2-threshold layer-grad-l2 layer 2 at step 2",
        "tmetrics ALERT step 3 CLOSED layer-grad-l2-threshold layer-grad-l2 layer 2: 1 vs baseline 2.05 (2.05x)",
    ]


def test_tensorboard_text_summary_per_step(run_info: RunInfo) -> None:
    sent = _drive(TensorBoardSink(), run_info)
    log = read_log(Path(run_info.dir) / "tb")
    events = log._acc.Tensors("tmetrics/alerts")
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events}
    assert sorted(texts) == [2, 3]
    assert texts[2] == "\n".join("    " + a.describe() for a in sent if a.step == 2)


def test_wandb_offline_alerts_and_table(run_info: RunInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sent = _drive(WandbSink(mode="offline", dir=str(tmp_path / "wb")), run_info)
    path = find_run_file(tmp_path / "wb")
    run = read_run(path)
    assert [(a.title, a.level) for a in run.alerts] == [
        ("tmetrics: layer-grad-l2-threshold layer 2", "WARN"), ("tmetrics: layer-grad-l2-threshold layer 1", "WARN")]
    assert run.alerts[0].text == sent[0].describe()
    tables = run.column(ALERTS_KEY)
    assert [step for step, _ in tables] == [2, 3]
    table_file = path.parent / "files" / tables[-1][1]["path"]
    table = json.loads(table_file.read_text())
    assert table["columns"][:5] == ["step", "state", "rule", "kind", "metric"]
    assert [(row[0], row[1], row[5]) for row in table["data"]] == [(2, "open", 2), (2, "open", 1), (3, "closed", 1),
                                                                  (3, "closed", 2)]


def test_wandb_nan_alert_is_an_error_and_a_table_row(run_info: RunInfo, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    engine = AlertEngine(parse_alerts({"rules": []}))
    nan_alerts = engine.observe([MetricRecord("layer-grad-l2", 1, 0.5, labels=Labels(layer=0))], 1) + engine.observe(
        [MetricRecord("layer-grad-l2", 2, math.nan, labels=Labels(layer=0))], 2)
    sink = WandbSink(mode="offline", dir=str(tmp_path / "wb"))
    sink.open(run_info)
    sink.write([MetricRecord("layer-grad-l2", 2, math.nan, labels=Labels(layer=0))], 2)
    sink.write_alerts(nan_alerts, 2)
    sink.close("finished")
    path = find_run_file(tmp_path / "wb")
    run = read_run(path)
    assert [(a.title, a.level) for a in run.alerts] == [("tmetrics: nonfinite-gradients layer 0", "ERROR")]
    table = json.loads((path.parent / "files" / run.column(ALERTS_KEY)[-1][1]["path"]).read_text())
    assert [(row[0], row[2], row[5], row[9], row[10], row[11]) for row in table["data"]] == [
        (2, "nonfinite-gradients", 0, "nan", 0.5, "inf")]


def test_mlflow_tags_and_alerts_artifact(run_info: RunInfo, mlflow_uri: str) -> None:
    sink = MlflowSink(tracking_uri=mlflow_uri, experiment="alerts")
    sent = _drive(sink, run_info)
    client, run = run_by_id(mlflow_uri, sink.run_id)
    tags = run.data.tags
    assert tags["tmetrics.alerts"] == "2"
    assert tags["tmetrics.alert.first"] == sent[0].describe()
    assert artifact_json(client, sink.run_id, "tmetrics/alerts.json") == [a.to_json() for a in sent]
    assert run.info.status == "FINISHED"


def test_nan_values_survive_every_format() -> None:
    engine = AlertEngine(parse_alerts({"rules": []}))
    alert = engine.observe([MetricRecord("layer-grad-l2", 7, math.nan, labels=Labels(layer=1))], 7)[0]
    assert alert.to_json()["value"] == "NaN" and alert.row()[9] != alert.row()[9]
