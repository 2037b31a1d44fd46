"""Several optimizers on one model, passed as a list: torch's Muon for the matrices and AdamW for
the rest (as Moonlight and Kimi train), stepped in either order. Each parameter's update is its
own optimizer's, so ``layer-update-ratio`` equals the float64 ratio of the whole step. Before,
only one optimizer could be passed, and the ratio read 0.0236 (Muon's hooks, the biases' update
missed) or 0.0172 (AdamW's, stepped second: the matrices' update missed) for 0.0293."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.optimizers import OptimizerChain, unwrap_optimizer
from tmetrics_core.tensor_metrics import TensorMetrics


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
    return model


def _ratios(model: torch.nn.Module, before: list[list[torch.Tensor]]) -> dict[int, float]:
    out = {}
    for i, old in enumerate(before):
        new = [p.detach().double() for p in model.layers[i].parameters()]
        update = sum(float((a - b).pow(2).sum()) for a, b in zip(new, old))
        out[i] = (update / sum(float(a.pow(2).sum()) for a in new)) ** 0.5
    return out


@pytest.mark.parametrize("muon_first", [True, False])
def test_each_parameter_updated_by_its_own_optimizer(muon_first):
    model = _model()
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=0.01)
    order = [muon, adamw] if muon_first else [adamw, muon]
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1)], optimizer=[muon, adamw])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        with metrics.step(step):
            model.layers[1](model.layers[0](x)).pow(2).sum().backward()
            before = [[p.detach().double().clone() for p in layer.parameters()] for layer in model.layers]
            for optimizer in order:
                optimizer.step()
            for optimizer in order:
                optimizer.zero_grad()
        want = _ratios(model, before)
        assert want[0] > 0.01
        assert {r.layer: r.value for r in metrics.last_records} == {
            i: pytest.approx(v, rel=1e-6) for i, v in want.items()}
    metrics.close()


def test_an_optimizer_that_does_not_step_leaves_its_updates_zero():
    model = _model()
    first = torch.optim.SGD(model.layers[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model.layers[1].parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1)], optimizer=(first, second))
    with metrics.step(1):
        model.layers[1](model.layers[0](torch.ones(2, 16))).sum().backward()
        before = [[p.detach().double().clone() for p in layer.parameters()] for layer in model.layers]
        first.step()  # the second optimizer skips this step (e.g. it steps every other step)
    want = _ratios(model, before)
    assert want[1] == 0.0
    assert {r.layer: r.value for r in metrics.last_records} == {0: pytest.approx(want[0], rel=1e-6), 1: 0.0}
    metrics.close()


def test_a_list_becomes_one_chain_and_a_repeat_is_refused():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a, b = torch.optim.SGD([p], lr=0.1), torch.optim.AdamW([q])
    chain = unwrap_optimizer([a, b])
    assert isinstance(chain, OptimizerChain) and chain.optimizers == (a, b)
    assert unwrap_optimizer([a]) is a
    with pytest.raises(ConfigError, match="lists one torch optimizer twice"):
        unwrap_optimizer([a, a])
    with pytest.raises(ConfigError, match="empty list"):
        unwrap_optimizer([])
