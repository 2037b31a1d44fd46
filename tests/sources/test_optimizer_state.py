"""``layer-optimizer-state-rms`` finds the state by its meaning: the first moment is Adam's
``exp_avg`` or the ``momentum_buffer`` of SGD and Muon, the second Adam's ``exp_avg_sq`` or
RMSprop's ``square_avg``; in a chain (Muon + AdamW) each parameter's from its own optimizer.
An optimizer that keeps no per-element state of a meaning the metric reads (Adafactor's factored
second moment, Adagrad's sum, SGD without momentum, an unknown class) is refused at start-up
naming it. References: float64 RMS of the optimizer's own state tensors."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    return model


def _rms(tensors: list[torch.Tensor]) -> float:
    return (sum(float(t.double().pow(2).sum()) for t in tensors) / sum(t.numel() for t in tensors)) ** 0.5


def _run(model: torch.nn.Module, optimizer, moments) -> dict[tuple[int, str], float]:
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-optimizer-state-rms", moments=moments), 1)],
                            optimizer=optimizer)
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        with metrics.step(step):
            model.layers[1](model.layers[0](x)).pow(2).sum().backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    got = {(r.layer, r.labels.stat): r.value for r in metrics.last_records}
    metrics.close()
    return got


def _state(optimizers, layer: torch.nn.Module, key_of) -> list[torch.Tensor]:
    out = []
    for p in layer.parameters():
        for o in optimizers:
            if p in o.state:
                out.append(o.state[p][key_of(o)])
    return out


@pytest.mark.parametrize("make, moments, keys", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2), None, {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), ["exp_avg"], {"exp_avg": "momentum_buffer"}),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), ["exp_avg_sq"], {"exp_avg_sq": "square_avg"}),
], ids=["adamw", "sgd-momentum", "rmsprop"])
def test_state_found_by_meaning(make, moments, keys):
    model = _model()
    optimizer = make(model.parameters())
    got = _run(model, optimizer, moments)
    want = {(i, kind): _rms(_state([optimizer], model.layers[i], lambda o: key)) for i in range(2)
            for kind, key in keys.items()}
    assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}


def test_muon_and_adamw_each_parameters_first_moment_from_its_optimizer():
    model = _model()
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-2)
    got = _run(model, [muon, adamw], ["exp_avg"])
    key = {id(muon): "momentum_buffer", id(adamw): "exp_avg"}
    want = {(i, "exp_avg"): _rms(_state([muon, adamw], model.layers[i], lambda o: key[id(o)])) for i in range(2)}
    assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want.items()}


class _Custom(torch.optim.SGD):
    pass


@pytest.mark.parametrize("make, moments, words", [
    (lambda ps: torch.optim.Adafactor(ps), ["exp_avg_sq"], "Adafactor keeps the second moment of a matrix factored"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), ["exp_avg"], "SGD has momentum 0"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None, "SGD keeps no second moment"),
    (lambda ps: torch.optim.Adagrad(ps), ["exp_avg_sq"], "Adagrad keeps a sum of squared gradients"),
    (lambda ps: _Custom(ps, lr=0.1, momentum=0.9), ["exp_avg"], "_Custom is not an optimizer whose state"),
    (lambda ps: [torch.optim.Muon([p for p in ps if p.ndim == 2]), torch.optim.AdamW([p for p in ps if p.ndim != 2])],
     None, "Muon keeps no second moment"),
], ids=["adafactor", "sgd", "sgd-second", "adagrad", "unknown", "muon-second"])
def test_state_without_that_meaning_is_refused_at_start_up(make, moments, words):
    model = _model()
    with pytest.raises(ConfigError, match=words):
        TensorMetrics(model, metrics=[(build_metric("layer-optimizer-state-rms", moments=moments), 1)],
                      optimizer=make(list(model.parameters())))


def test_moments_option_from_a_config(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = {"run": {"name": "m", "dir": str(tmp_path)},
              "metrics": [{"name": "layer-optimizer-state-rms", "moments": ["exp_avg"]}], "sinks": {}}
    metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer)
    assert metrics.metrics[0][0].source_kinds == frozenset({"exp_avg"})
    metrics.close()
    with pytest.raises(ConfigError, match="moments"):
        TensorMetrics.from_config({**config, "metrics": [{"name": "layer-optimizer-state-rms", "moments": ["v"]}]},
                                  model=model, optimizer=optimizer)
