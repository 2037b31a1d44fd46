"""``TensorMetrics.from_config`` keyword arguments that the config also sets override its keys
(checked as the config's own values; the run's recorded config shows what was used), and those
the config builds are refused, both before any sink starts."""

from __future__ import annotations

import json

import pytest
import torch

import tmetrics_core as tm
from tmetrics_core.errors import ConfigError


def _config(run_dir) -> dict:
    return {"metrics": [{"name": "global-grad-l2"}], "sinks": {"jsonl": {}}, "run": {"dir": str(run_dir)}}


def _step(metrics: tm.TensorMetrics, model: torch.nn.Module, step: int) -> None:
    with metrics.step(step):
        model(torch.ones(2, 4)).sum().backward()


def test_keyword_arguments_override_their_config_keys(tmp_path) -> None:
    model = torch.nn.Linear(4, 4)
    config = {**_config(tmp_path), "distributed": {"check_plan": "never"}}
    metrics = tm.TensorMetrics.from_config(config, model=model, read_results="next-step", check_plan="always",
                                           verify_replicas="never", timeout_s=7, log_rank=0)
    assert (metrics.read_results, metrics.check_plan) == ("next-step", "always")
    recorded = metrics.run.config
    assert recorded["run"]["read_results"] == "next-step"
    assert recorded["distributed"] == {"check_plan": "always", "verify_replicas": "never",
                                       "collective_timeout_s": 7.0, "log_rank": 0}
    _step(metrics, model, 1)
    expected = float(torch.cat([model.weight.grad.reshape(-1), model.bias.grad]).double().norm())
    assert metrics.last_records == []  # next-step: read at the next scope's end
    _step(metrics, model, 2)
    assert [(r.step, r.value) for r in metrics.last_records] == [(1, pytest.approx(expected, rel=1e-12))]
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line.get("metric") == "global-grad-l2"] == [1, 2]


@pytest.mark.parametrize("given, says", [
    ({"read_results": "later"}, "run.read_results: got 'later' (a string); need one of now, next-step "
                                "(given to from_config as read_results='later')"),
    ({"timeout_s": -1}, "distributed.collective_timeout_s: got -1"),
    ({"log_rank": 5}, "distributed.log_rank: log_rank 5 is not a rank of this job, whose world has 1 rank(s)"),
    ({"hub": None, "run": None}, "from_config(..., hub=, run=) given: from_config builds hub, run"),
    ({"check_plna": "first"}, "from_config() got an unknown keyword argument 'check_plna' (did you mean 'check_plan'?)"),
])
def test_bad_or_built_keyword_arguments_are_refused_before_any_sink_starts(tmp_path, given, says) -> None:
    with pytest.raises(ConfigError) as caught:
        tm.TensorMetrics.from_config(_config(tmp_path), model=torch.nn.Linear(4, 4), **given)
    assert says in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no manifest, no sink file
