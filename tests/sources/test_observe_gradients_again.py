"""``observe_gradients()`` called after each micro-batch's backward reads the gradients again:
the step's values are those of the last call before ``optimizer.step()``, the accumulated
gradients ``clip_grad_norm_`` sees (the first call's were kept: 0.94 for 2.56). A parameter
without a gradient at the first call but with one at the last is measured and not reported
missing."""

from __future__ import annotations

import logging

import pytest
import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

NAMES = ("global-grad-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio", "layer-param-l2")


def test_the_last_call_before_the_optimizer_step_is_the_steps(caplog):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], optimizer=optimizer)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="tmetrics"), metrics.step(1):
        model.layers[0](x).pow(2).mean().backward()  # layer 1 has no gradient yet
        metrics.observe_gradients()
        model.layers[1](model.layers[0](2 * x)).pow(2).mean().backward()
        metrics.observe_gradients()
        grads = {i: [p.grad.detach().double().clone() for p in layer.parameters()]
                 for i, layer in enumerate(model.layers)}
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
        optimizer.step()
        metrics.observe_gradients()  # after the step: changes nothing
    got = {(r.metric, r.layer): r.value for r in metrics.last_records}
    assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
    for i, gs in grads.items():
        assert got[("layer-grad-l2", i)] == pytest.approx(sum(float(g.pow(2).sum()) for g in gs) ** 0.5, rel=1e-6)
        assert got[("layer-grad-absmax", i)] == pytest.approx(max(float(g.abs().max()) for g in gs), rel=1e-6)
        assert got[("layer-update-ratio", i)] > 0
    assert "had no gradient" not in caplog.text
    metrics.close()
