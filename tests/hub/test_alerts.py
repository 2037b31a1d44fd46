"""Alerts through the hub: end to end from a config, failure isolation, sinks without alerts."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from tmetrics_core.alerts import Alert, AlertEngine
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.hub.replay import replay
from tmetrics_core.hub.sink_hub import SinkHub
from tmetrics_core.hub.spool import SpoolReader
from tmetrics_core.records import Labels, MetricRecord, RunInfo
from tmetrics_core.sinks.keys import PLAIN_RULES
from tmetrics_core.tensor_metrics import TensorMetrics


class _Blocks(nn.Module):  # two blocks under layers.N, so layer-grad-l2 has layers 0 and 1
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_config_to_alerts_jsonl_names_the_layer_with_nan_gradients(tmp_path):
    torch.manual_seed(0)
    model = _Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"metrics": ["layer-grad-l2"], "sinks": ["jsonl"], "alerts": "default"}
    metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=tmp_path / "run")
    for step in (1, 2, 3):
        with metrics.step(step):
            model(torch.ones(2, 3)).sum().backward()
            if step == 2:
                model.layers[1].weight.grad.fill_(math.nan)
            metrics.observe_gradients()
            if step != 2:  # the update with NaN gradients is skipped, as loss scalers do
                optimizer.step()
            optimizer.zero_grad()
    metrics.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert [(a["step"], a["state"], a["rule"], a["labels"], a["value"]) for a in lines] == [
        (2, "open", "nonfinite-gradients", {"layer": 1}, "NaN"),
        (3, "closed", "nonfinite-gradients", {"layer": 1}, lines[1]["value"]),
    ]
    assert math.isfinite(lines[1]["value"]) and lines[0]["baseline"] == lines[1]["baseline"]


class _Sink:
    key_rules: ClassVar = PLAIN_RULES
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps: list[int] = []
        self.alerts: list[Alert] = []

    def open(self, run: RunInfo) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        self.steps.append(step)

    def flush(self) -> None: ...

    def close(self, status: str) -> None: ...


class _AlertSink(_Sink):
    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        self.alerts += alerts


class _BrokenAlertSink(_Sink):
    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        raise OSError("alert backend down")


def test_a_sink_failing_on_alerts_keeps_its_records_and_spools_the_alerts(tmp_path):
    plain, showing, broken = _Sink("plain"), _AlertSink("showing"), _BrokenAlertSink("broken")
    engine = AlertEngine(parse_alerts({"rules": [{"kind": "threshold", "metric": "m", "above": 1}]}))
    hub = SinkHub([plain, showing, broken], spool_dir=tmp_path / "spool", alerts=engine, retries=1, backoff=0.0)
    hub.open(RunInfo(name="r", dir=str(tmp_path)))
    for step, value in ((1, 0.5), (2, 2.0), (3, 3.0), (4, 0.5)):
        hub.submit([MetricRecord("m", step, value, labels=Labels(layer=0))], step)
    report = hub.close()
    assert plain.steps == showing.steps == broken.steps == [1, 2, 3, 4]
    assert [(a.step, a.state) for a in showing.alerts] == [(2, "open"), (4, "closed")]
    spooled = [e for e in SpoolReader(tmp_path / "spool" / "broken.jsonl") if isinstance(e, Alert)]
    assert [a.to_json() for a in spooled] == [a.to_json() for a in showing.alerts]
    counts = {s.sink: (s.written, s.spooled, s.dropped) for s in report.sinks}
    assert counts == {"plain": (4, 0, 0), "showing": (4, 0, 0), "broken": (4, 0, 0)}
    assert not (tmp_path / "spool" / "plain.jsonl").exists()
    later = _AlertSink("later")
    assert replay(tmp_path / "spool" / "broken.jsonl", later) == 0  # no record was spooled, only alerts
    assert [a.to_json() for a in later.alerts] == [a.to_json() for a in showing.alerts]


def test_rules_that_raise_are_turned_off_and_the_records_still_flow(tmp_path, caplog):
    class Broken(AlertEngine):
        def observe(self, records, step):
            raise ZeroDivisionError("bug in a rule")

    sink = _AlertSink("showing")
    hub = SinkHub([sink], spool_dir=tmp_path / "spool", alerts=Broken(parse_alerts("default")))
    hub.open(RunInfo(name="r", dir=str(tmp_path)))
    for step in (1, 2):
        hub.submit([MetricRecord("m", step, 1.0)], step)
    hub.close()
    assert sink.steps == [1, 2] and sink.alerts == [] and hub.alerts is None
    assert sum("alert rules failed at step 1" in r.getMessage() for r in caplog.records) == 1
