"""``TensorMetrics(grad_scaler=...)`` with torch's ``GradScaler`` on the CPU.

A step the scaler skips (a gradient forced to inf) writes ``global-grad-l2`` (inf, as
``clip_grad_norm_`` gives) and the ``layer-grad-nonfinite`` counts, and no update record, with a
warning that names the skip. Before, it wrote nothing and said "no parameter had a gradient"
(they were read after ``zero_grad()``). Gradients are read unscaled, also where
``observe_gradients()`` runs before ``scaler.unscale_``: references are float64 copies of the
gradients divided by the scale, and ``clip_grad_norm_``'s own total norm."""

from __future__ import annotations

import logging

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

SCALE = 1024.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    return model


def _loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    return model.layers[1](model.layers[0](x)).pow(2).sum()


def _unscaled_norm(model: torch.nn.Module, scale: float) -> float:
    return sum(float((p.grad.double() / scale).pow(2).sum()) for p in model.parameters()) ** 0.5


def test_a_skipped_step_writes_gradient_records_and_says_so(caplog):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    names = ("global-grad-l2", "layer-grad-nonfinite", "layer-update-ratio")
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], optimizer=optimizer,
                            grad_scaler=scaler)
    got = {}
    for step in (1, 2):
        with caplog.at_level(logging.WARNING, logger="tmetrics"), metrics.step(step):
            scaler.scale(_loss(model)).backward()
            if step == 2:
                model.layers[0].weight.grad[0, 0] = float("inf")
            want = _unscaled_norm(model, scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        got[step] = {(r.metric, r.layer, r.labels.stat): r.value for r in metrics.last_records}
    assert got[1][("global-grad-l2", None, None)] == pytest.approx(_first_norm(), rel=1e-6)
    assert ("layer-update-ratio", 0, None) in got[1]
    assert scaler.get_scale() == SCALE / 2  # the scaler did skip step 2
    assert want == float("inf") and got[2][("global-grad-l2", None, None)] == want
    assert got[2][("layer-grad-nonfinite", 0, "posinf")] == 1.0
    assert got[2][("layer-grad-nonfinite", 0, "total")] == 1.0 and got[2][("layer-grad-nonfinite", 1, "total")] == 0.0
    assert not any(metric == "layer-update-ratio" for metric, _, _ in got[2])
    assert "GradScaler skipped SGD.step() at step 2" in caplog.text
    assert "had a gradient" not in caplog.text
    metrics.close()
    assert "unscale_" not in vars(scaler) and "step" not in vars(scaler)  # its own methods again


def _first_norm() -> float:
    model = _model()
    _loss(model).backward()
    return _unscaled_norm(model, 1.0)


@pytest.mark.parametrize("unscale_first", [True, False])
def test_observe_gradients_reads_unscaled_gradients_before_clipping(unscale_first):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)], optimizer=optimizer,
                            grad_scaler=scaler)
    with metrics.step(1):
        for _ in range(2):  # two micro-batches, read after each
            scaler.scale(_loss(model) / 2).backward()
            if unscale_first:
                continue
            metrics.observe_gradients()  # still scaled: read at the unscale_ below
        want = _unscaled_norm(model, SCALE)
        scaler.unscale_(optimizer)
        if unscale_first:
            metrics.observe_gradients()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(optimizer)
        scaler.update()
    assert float(total) == pytest.approx(want, rel=1e-6) and want > 1.0
    assert [r.value for r in metrics.last_records] == [pytest.approx(want, rel=1e-6)]
    metrics.close()


def test_a_scaler_is_refused_without_an_optimizer_or_with_a_fused_one():
    model = _model()
    with pytest.raises(ConfigError, match="needs optimizer="):
        TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)], grad_scaler=torch.amp.GradScaler("cpu"))
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    assert fused._step_supports_amp_scaling
    with pytest.raises(ConfigError, match="fused=True"):
        TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)], optimizer=fused,
                      grad_scaler=torch.amp.GradScaler("cpu"))
