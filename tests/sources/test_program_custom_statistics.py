"""The Snapshot mapping semantics; custom statistics reading other columns alongside
sums-of-squares metrics in the parameter program (against float64)."""
from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.statistics import COUNT, Statistic
from tmetrics_core.sources.snapshot import Snapshot
from tmetrics_core.tensor_metrics import TensorMetrics


def test_snapshot_mapping():
    ts = [torch.randn(3, 4), torch.randn(5).bfloat16(), torch.randn(0)]
    snap = Snapshot(zip("abc", (t.clone() for t in ts)))
    assert set(snap) == {"a", "b", "c"} and len(snap) == 3
    seen = {k: v for k, v in snap.items()}
    assert torch.equal(seen["a"], ts[0]) and torch.equal(seen["b"], ts[1]) and seen["c"].numel() == 0
    snap["a"].add_(1)
    assert torch.equal(snap["a"], ts[0] + 1) and torch.equal(snap["b"], ts[1])
    assert snap.pop("b") is seen["b"] and "b" not in snap and len(snap) == 2
    del snap["c"]
    assert list(snap) == ["a"]
    fresh = Snapshot({"a": ts[0]})
    del fresh["a"]
    assert len(fresh) == 0
    with pytest.raises(KeyError):
        fresh["a"]


class _Peak(Statistic):
    """max of the rows' max column (custom, reads column 2)."""
    name, op, elements = "test-peak", "max", False
    reads = frozenset({"max"})

    def compute(self, tensors, sites, topology, rows):
        return rows[:, 2:3].clone()


PEAK = _Peak()


class UpdatePeak(StatMetric):
    name, scope, statistics = "test-update-peak", "layer", (PEAK, COUNT)
    source_kinds = frozenset({"update"})

    def finalize(self, stats):
        return stats["test-peak"][0]


class ParamPeak(StatMetric):
    name, scope, statistics = "test-param-peak", "layer", (PEAK,)
    source_kinds = frozenset({"param"})

    def finalize(self, stats):
        return stats["test-peak"][0]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])

    def forward(self, x):
        for l in self.layers:
            x = torch.tanh(l(x))
        return x


def _run():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tm = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1), (build_metric("layer-param-l2"), 2),
                                       (UpdatePeak(), 3), (ParamPeak(), 2), (build_metric("layer-grad-l2"), 1)],
                       optimizer=opt)
    out = []
    for step in range(1, 8):
        with tm.step(step):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        assert tm.failures == []
        got = {(r.metric, r.layer): r.value for r in tm.last_records}
        ref = {}
        for i, l in enumerate(model.layers):
            now = [l.weight.detach().double(), l.bias.detach().double()]
            was = [before[f"layers.{i}.weight"].double(), before[f"layers.{i}.bias"].double()]
            if step % 3 == 0 or step == 1:
                ref[("test-update-peak", i)] = max((a - b).max().item() for a, b in zip(now, was))
            if step % 2 == 0 or step == 1:
                ref[("test-param-peak", i)] = max(b.max().item() for b in was)
                ref[("layer-param-l2", i)] = math.sqrt(sum(b.pow(2).sum().item() for b in was))
        out.append((got, ref))
    tm.close()
    return out


def test_custom_columns_with_sumsq_metrics():
    for step, (got, ref) in enumerate(_run(), start=1):
        assert {k for k in got if k[0] != "layer-update-ratio" and k[0] != "layer-grad-l2"} == ref.keys(), step
        for k, v in got.items():
            assert not math.isnan(v), (step, k)
        for k, v in ref.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (step, k, got[k], v)
