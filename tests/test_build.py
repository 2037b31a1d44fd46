"""A second run into the same run directory is said, once, before anything is written."""

from __future__ import annotations

import json
import logging

import torch

from tmetrics_core.tensor_metrics import TensorMetrics


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _run(run_dir, model) -> None:
    config = {"metrics": ["layer-param-l2"], "sinks": ["jsonl"], "run": {"name": "again"}}
    metrics = TensorMetrics.from_config(config, model=model, run_dir=run_dir)
    with metrics.step(1):
        model(torch.ones(1, 3))
    metrics.close()


def test_second_run_into_a_run_directory_warns_and_keeps_the_first(tmp_path, caplog):
    model = _Blocks()
    with caplog.at_level(logging.WARNING, logger="tmetrics"):
        _run(tmp_path / "run", model)
        assert not [r for r in caplog.records if "already holds a run" in r.getMessage()]
        _run(tmp_path / "run", model)
    warned = [r.getMessage() for r in caplog.records if "already holds a run" in r.getMessage()]
    assert len(warned) == 1 and "--run-dir" in warned[0]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Both runs' records are there (appended, as the warning says): two per run, one per layer.
    assert [r["step"] for r in lines if r.get("metric") == "layer-param-l2"] == [1, 1, 1, 1]
