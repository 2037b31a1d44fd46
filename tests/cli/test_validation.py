"""``tmetrics validate`` lists every problem of a config, not only the first (issue 32, item 7),
and a config without sinks is said to log nowhere, by ``validate`` and by ``from_config``."""

from __future__ import annotations

import logging

import torch
from click.testing import CliRunner

from tmetrics_core.cli.main import main
from tmetrics_core.tensor_metrics import TensorMetrics

BAD = """\
run: {name: "a/b", close_timeout_s: -1}
metrics:
  - layer-grad-l2:0
  - {name: layer-grad-l3}
  - {name: layer-grad-l2, interval: 0, select: 3}
sinks: {jsonl: 3, tensorbord: {}, mlflow: {foo: 1}}
distributed: {log_rank: -1}
"""
PATHS = ["run.name", "run.close_timeout_s", "distributed.log_rank", "metrics[0].interval", "metrics[2].interval",
         "metrics[2].select", "sinks.jsonl", "metrics[1].name", "sinks.tensorbord", "sinks.mlflow.foo"]


def test_validate_lists_every_problem_with_its_path(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD)
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert lines[0] == f"tmetrics: error: {len(PATHS)} problems in {tmp_path / 'bad.yaml'}:"
    assert sorted(line.strip().split(": ")[0] for line in lines[1:]) == sorted(PATHS)
    assert "did you mean 'tensorboard'" in result.output and "layer-grad-l2" in lines[PATHS.index("metrics[1].name") + 1]


def test_a_config_without_sinks_is_valid_but_said_to_log_nowhere(tmp_path, caplog):
    (tmp_path / "plain.yaml").write_text("metrics: [global-grad-l2]\n")
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "plain.yaml")])
    assert result.exit_code == 0, result.output
    assert "sinks none" in result.output and "names no sinks: the records go nowhere" in result.output

    caplog.set_level(logging.WARNING, logger="tmetrics")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    TensorMetrics.from_config(tmp_path / "plain.yaml", model=model, run_dir=tmp_path / "run").close()
    assert [r.getMessage() for r in caplog.records if "names no sinks" in r.getMessage()] == [
        "tmetrics: the config names no sinks: the records go nowhere but TensorMetrics.last_records; add one, e.g. "
        "sinks: {jsonl: {}} (a file in the run directory) or sinks: [tensorboard]"]
