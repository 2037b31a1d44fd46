"""One block object at three depths (ALBERT-style sharing: ``ModuleList([block] * 3)``): one
residual record per depth, each equal to the float64 reference of that depth alone."""
from __future__ import annotations

import copy

import pytest
import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

D = 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mlp(h))


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = Block()
        self.layers = torch.nn.ModuleList([block] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_one_block_at_three_depths_gets_one_record_per_depth():
    model = Shared()
    reference = copy.deepcopy(model.layers[0]).double()
    names = ("layer-residual-accumulator-l2", "layer-residual-contribution-rms")
    tm = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names])
    g = torch.Generator().manual_seed(3)
    for step in (1, 2):
        xs = [torch.randn(2, 5, D, generator=g) for _ in range(2)]
        with tm.step(step):
            for x in xs:  # two micro-batches: depths are counted per forward
                model(x).sum().backward()
        got = {(r.metric, r.layer): r.value for r in tm.last_records}
        outs: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
        parts: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
        with torch.no_grad():
            for x in xs:
                h = x.double()
                for depth in range(3):
                    out = reference(h)
                    outs[depth].append(out.reshape(-1, D))
                    parts[depth].append((out - h).reshape(-1, D))
                    h = out
        want = {}
        for depth in range(3):
            want[(names[0], depth)] = torch.cat(outs[depth]).norm().item()
            want[(names[1], depth)] = torch.cat(parts[depth]).pow(2).mean().sqrt().item()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key
        assert got[(names[0], 0)] < got[(names[0], 2)]  # no depth summed into layer 0
    tm.close()


class Looped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):  # layer 1 runs twice per forward: one layer, its calls pooled
            x = self.layers[1](self.layers[0](x) if _ == 0 else x)
        return x


def test_a_block_run_twice_at_one_position_is_pooled_with_a_word(caplog):
    model = Looped()
    tm = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-l2"), 1)])
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4))
    with caplog.at_level("WARNING", logger="tmetrics"):
        for step in (1, 2):
            with tm.step(step):
                model(x).sum().backward()
    got = {r.layer: r.value for r in tm.last_records}
    tm.close()
    with torch.no_grad():
        h0 = model.layers[0](x)
        h1 = model.layers[1](h0)
        h2 = model.layers[1](h1)
    assert got[0] == pytest.approx(h0.double().norm().item(), rel=1e-6)
    assert got[1] == pytest.approx(torch.cat([h1, h2]).double().norm().item(), rel=1e-6)
    said = [r.message for r in caplog.records if "ran more than once in one forward" in r.message]
    assert len(said) == 1 and "block layers.1 " in said[0]
