"""Residual metrics reading sums of squares, sums and maxima at different intervals, over
several micro-batches, float32 and bf16, against float64 references."""
from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.statistics import MAX, SUM, COUNT, flagged_value
from tmetrics_core.tensor_metrics import TensorMetrics

D = 5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(D, D, bias=False)

    def forward(self, h):
        return h + self.mlp(h)


class Net(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


class ContributionMax(StatMetric):
    name, scope, statistics = "test-contribution-max", "layer", (MAX,)
    source_kinds = frozenset({"residual_contribution"})

    def finalize(self, stats):
        return flagged_value(stats["max"])


class AccumulatorMean(StatMetric):
    name, scope, statistics = "test-accumulator-mean", "layer", (SUM, COUNT)
    source_kinds = frozenset({"residual_accumulator"})

    def finalize(self, stats):
        return stats["sum"][0] / stats["count"][0]


def _metrics():
    return [(build_metric("layer-residual-accumulator-rms"), 1), (build_metric("layer-residual-accumulator-l2"), 2),
            (build_metric("layer-residual-contribution-l2"), 3), (ContributionMax(), 2), (AccumulatorMean(), 3)]


def _run(n, dtype, micro):
    model = Net(n).to(dtype)
    tm = TensorMetrics(model, metrics=_metrics())
    out = []
    for step in range(1, 8):
        seen_h = {i: [] for i in range(n)}
        seen_c = {i: [] for i in range(n)}
        def spy(i):
            def hook(m, a, o):
                seen_h[i].append(o.detach().double().reshape(-1, D))
                seen_c[i].append((o.detach().double() - a[0].detach().double()).reshape(-1, D))
            return hook
        hooks = [b.register_forward_hook(spy(i)) for i, b in enumerate(model.layers)]
        g = torch.Generator().manual_seed(step)
        with tm.step(step):
            for b in range(micro):
                model(torch.randn(b + 1, 3, D, generator=g).to(dtype))
        for h in hooks:
            h.remove()
        assert tm.failures == []
        got = {(r.metric, r.layer): r.value for r in tm.last_records}
        want = {}
        for i in range(n):
            h = torch.cat(seen_h[i]); c = torch.cat(seen_c[i])
            want[("layer-residual-accumulator-rms", i)] = h.pow(2).mean().sqrt().item()
            want[("layer-residual-accumulator-l2", i)] = h.norm().item()
            want[("layer-residual-contribution-l2", i)] = c.norm().item()
            want[("test-contribution-max", i)] = c.max().item()
            want[("test-accumulator-mean", i)] = h.mean().item()
        out.append((step, got, want))
    tm.close()
    return out


@pytest.mark.parametrize("n", [3, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_against_float64(n, dtype):
    micro = 3
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    for step, got, want in _run(n, dtype, micro):
        for key, value in got.items():
            assert not math.isnan(value), (step, key)
            assert value == pytest.approx(want[key], rel=rel, abs=1e-9), (step, key, value, want[key])
