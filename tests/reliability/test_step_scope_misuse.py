"""Step scopes used wrongly get a clear error before any work, and what was logged stays: a
step number that is not an int (a float was written to the sinks as ``6.0``; a str raised a
bare comparison ``TypeError``), and a scope entered inside another (the outer step's records
were labelled with the inner step)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.reliability.test_closed_metrics import _metrics, _train, _written_steps
from tmetrics_core.errors import TMetricsError


@pytest.mark.parametrize("step", [6.0, "5", True])
def test_a_step_number_that_is_not_an_int_is_refused(tmp_path, step):
    metrics, model, optimizer = _metrics(tmp_path)
    _train(metrics, model, optimizer, 1)
    with pytest.raises(TypeError, match=r"step must be an int, the number of the optimizer step; got"):
        with metrics.step(step):
            pass
    _train(metrics, model, optimizer, 2)  # the object is as it was
    metrics.close()
    assert _written_steps(tmp_path) == {1, 2}
    with open(tmp_path / "metrics.jsonl") as f:
        assert all(type(json.loads(line)["step"]) is int for line in f if line.strip())


def test_a_scope_inside_another_is_refused(tmp_path):
    metrics, model, optimizer = _metrics(tmp_path)
    _train(metrics, model, optimizer, 1)
    with pytest.raises(TMetricsError, match=r"step\(3\) entered inside the scope of step 2: step scopes do not nest"):
        with metrics.step(2):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            with metrics.step(3):
                pass
    optimizer.zero_grad()
    _train(metrics, model, optimizer, 4)
    metrics.close()
    assert _written_steps(tmp_path) == {1, 4}  # step 2's body raised: not measured


def test_observe_gradients_outside_a_step_scope_is_refused(tmp_path):
    """It read nothing and said nothing; the data already logged stays."""
    metrics, model, optimizer = _metrics(tmp_path)
    _train(metrics, model, optimizer, 1)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    with pytest.raises(TMetricsError, match=r"observe_gradients\(\) called outside a step scope"):
        metrics.observe_gradients()
    optimizer.zero_grad()
    _train(metrics, model, optimizer, 2)
    metrics.close()
    assert _written_steps(tmp_path) == {1, 2}
