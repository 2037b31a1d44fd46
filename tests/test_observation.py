"""Observation: no raw activation outlives its observation, checkpoint recomputation is not
observed twice, idle steps install nothing, and the token mask removes padding."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from tmetrics_core.metrics.norms import L2Norm, Rms
from tmetrics_core.observe import _ACTIVE, observe
from tmetrics_core.tensor_metrics import TensorMetrics


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.ModuleDict({"up": torch.nn.Linear(4, 4, bias=False)})

    def forward(self, h):
        return h + self.mlp["up"](h)


class Tiny(torch.nn.Module):
    def __init__(self, checkpointed: bool | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.checkpointed = checkpointed
        self.kept: list[weakref.ref] = []

    def forward(self, x):
        h = x
        for block in self.layers:
            if self.checkpointed is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpointed)
            self.kept.append(weakref.ref(h))
        observe(self, "probe", h * 1.0, kind="activation")
        return h


def _metrics(model, interval=1):
    return TensorMetrics(model, metrics=[
        (Rms(name="layer-residual-accumulator-rms", source_kinds=["residual_accumulator"], scope="layer"), interval),
        (L2Norm(name="global-residual-contribution-l2", source_kinds=["residual_contribution"]), interval),
        (L2Norm(name="global-param-l2", source_kinds=["param"]), interval),
    ])


def test_no_raw_activation_outlives_its_observation():
    model = Tiny()
    metrics = _metrics(model)
    with metrics.step(1):
        model(torch.randn(3, 5, 4)).sum().backward()
    gc.collect()
    assert model.kept and all(ref() is None for ref in model.kept)
    assert metrics.last_records


def test_checkpointed_forward_is_observed_once():
    x = torch.randn(3, 5, 4)
    values = {}
    for mode in (None, False, True):
        model = Tiny(checkpointed=mode)
        torch.manual_seed(0)
        for p, q in zip(model.parameters(), Tiny().parameters()):
            with torch.no_grad():
                p.copy_(torch.full_like(p, 0.1))
        metrics = _metrics(model)
        with metrics.step(1):
            model(x.clone().requires_grad_(True)).sum().backward()
        values[mode] = {(r.metric, r.layer): r.value for r in metrics.last_records}
    assert values[None] == values[False] == values[True]
    h0 = x + x @ torch.full((4, 4), 0.1)
    assert values[None][("layer-residual-accumulator-rms", 0)] == __import__("pytest").approx(
        h0.pow(2).mean().sqrt().item(), rel=1e-6)


def test_idle_steps_install_nothing():
    model = Tiny()
    metrics = _metrics(model, interval=10)
    with metrics.step(1):  # the first step is always due
        assert _ACTIVE.get() is not None
        assert any(len(b._forward_hooks) for b in model.layers)
        model(torch.randn(2, 2, 4))
    with metrics.step(2):
        assert _ACTIVE.get() is None
        assert not any(len(b._forward_hooks) for b in model.layers)
        model(torch.randn(2, 2, 4))
    assert metrics.last_records and all(r.step == 1 for r in metrics.last_records)


def test_token_mask_removes_padding():
    model = Tiny()
    metrics = TensorMetrics(model, metrics=[
        (L2Norm(name="probe-l2", source_kinds=["activation"]), 1)], modules={"probe-l2": ("layers.0",)})
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    with metrics.step(1):
        observe(model, "token_mask", mask, kind="token_mask")
        model(x)
    out = model.layers[0](x)
    want = out[mask].norm().item()
    got = {r.metric: r.value for r in metrics.last_records}
    assert got["probe-l2"] == __import__("pytest").approx(want, rel=1e-6)
