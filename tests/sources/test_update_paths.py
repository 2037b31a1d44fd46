"""The update ratio equals the float64 reference of a real AdamW step, alone (rows of updates,
parameters and snapshots from one rows pass) and beside a metric whose statistic is outside the
rows (it prepares itself on the same updates)."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.row_l2 import RowL2
from tmetrics_core.tensor_metrics import TensorMetrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, seq_len=16)


class UpdateMeanRowL2(StatMetric):
    """Mean row L2 of the update over the 2-D tensors of the model (a statistic the fused
    moments cannot give, so the update must be written)."""

    name = "update-mean-row-l2"
    source_kinds = frozenset({"update"})
    statistics = (RowL2(0),)

    def accepts(self, site):
        return super().accepts(site) and len(site.logical_shape) == 2

    def finalize(self, stats):
        total, rows = stats["update:row_l2"]
        return total / rows


def _run(path: str) -> tuple[dict[tuple[str, int | None], float], list[torch.Tensor], list[torch.Tensor]]:
    model = Transformer(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chosen = [(build_metric("layer-update-ratio"), 1)]
    if path == "written update":
        chosen.append((UpdateMeanRowL2(), 1))
    metrics = TensorMetrics(model, metrics=chosen, optimizer=optimizer)
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    with metrics.step(1):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        before = [p.detach().clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
    values = {(r.metric, r.layer): r.value for r in metrics.last_records}
    metrics.close()
    return values, before, [p.detach() for p in params]


@pytest.mark.parametrize("path", ["program", "written update"])
def test_update_ratio_equals_reference_on_every_path(path: str) -> None:
    values, before, after = _run(path)
    model = Transformer(SMALL, seed=0)
    names = [n for n, _ in model.named_parameters()]
    for layer in range(SMALL.n_layers):
        chosen = [i for i, n in enumerate(names) if n.startswith(f"layers.{layer}.")]
        delta = torch.cat([(after[i] - before[i]).reshape(-1) for i in chosen]).double()
        theta = torch.cat([after[i].reshape(-1) for i in chosen]).double()
        want = (delta.norm() / theta.norm()).item()
        assert values[("layer-update-ratio", layer)] == pytest.approx(want, rel=1e-6)
    if path == "written update":
        rows = [(after[i] - before[i]).double() for i in range(len(names)) if after[i].dim() == 2]
        norms = torch.cat([d.norm(dim=1) for d in rows])
        assert values[("update-mean-row-l2", None)] == pytest.approx(norms.mean().item(), rel=1e-6)
        assert not math.isnan(values[("update-mean-row-l2", None)])


class _Resizing(torch.optim.Optimizer):
    """Plain SGD that then replaces ``target``'s data with a larger tensor, inside ``step`` (its
    own, so torch's step hooks run around all of it: a subclass calling ``super().step()`` would
    run them inside the parent's step, before the resize, once the parent class is patched)."""

    def __init__(self, params, target: torch.nn.Parameter) -> None:
        super().__init__(params, {"lr": 0.1})
        self.target = target

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        self.target.data = torch.zeros(self.target.shape[0] + 1, *self.target.shape[1:])


def test_a_parameter_resized_by_the_optimizer_is_a_reported_failure_not_a_crash() -> None:
    model = Transformer(SMALL, seed=0)
    target = next(p for n, p in model.named_parameters() if n.startswith("layers.0.") and p.dim() == 2)
    optimizer = _Resizing(model.parameters(), target)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1),
                                            (build_metric("global-grad-l2"), 1)], optimizer=optimizer)
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with metrics.step(1):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
    assert [f.metric for f in metrics.failures] == ["layer-update-ratio"]
    assert "reading the post-step tensors failed" in metrics.failures[0].error
    (record,) = metrics.last_records  # the gradient norm, read before the step, is unaffected
    assert record.value == pytest.approx(torch.cat([g.reshape(-1) for g in grads]).double().norm().item(), rel=1e-6)
    metrics.close()


def test_non_finite_counts_of_updates_read_the_updates_themselves() -> None:
    """Exact NaN counts need the update's elements: with such a metric due, updates are written
    (the fused path's snapshot stand-ins would count the old parameter's NaNs instead)."""
    from tmetrics_core.metrics.norms import NonFinite

    param = torch.nn.Parameter(torch.ones(4, 3))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(3, 4, bias=False)])
    model.layers[0].weight = param
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = TensorMetrics(model, metrics=[(NonFinite(name="global-update-nonfinite", source_kinds=["update"]), 1),
                                            (build_metric("layer-update-ratio"), 1)], optimizer=optimizer)
    with metrics.step(1):
        param.grad = torch.zeros(4, 3)
        param.grad[1, :2] = float("nan")
        optimizer.step()
    got = {(r.metric, r.stat): r.value for r in metrics.last_records}
    assert got[("global-update-nonfinite", "nan")] == 2
    assert math.isnan(got[("layer-update-ratio", None)])


@pytest.mark.parametrize("path", ["program", "written update"])
@pytest.mark.parametrize("early", [False, True], ids=["pre-hook", "observe_gradients"])
def test_parameter_metrics_with_an_update_due_measure_the_parameters_before_the_step(path: str, early: bool,
                                                                                      ) -> None:
    """With an update metric due, metrics of parameters alone are prepared after the step from
    the update snapshot: the values are those of the parameters before the step."""
    model = Transformer(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chosen = [(build_metric(name), 1) for name in ("layer-param-l2", "layer-param-absmax", "layer-update-ratio",
                                                     "layer-grad-l2")]
    if path == "written update":
        chosen.append((UpdateMeanRowL2(), 1))
    metrics = TensorMetrics(model, metrics=chosen, optimizer=optimizer)
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in model.named_parameters()]
    with metrics.step(1):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        if early:
            metrics.observe_gradients()
        optimizer.step()
        optimizer.zero_grad()
    values = {(r.metric, r.layer): r.value for r in metrics.last_records}
    metrics.close()
    for layer in range(SMALL.n_layers):
        theta = torch.cat([before[i].reshape(-1) for i, n in enumerate(names) if n.startswith(f"layers.{layer}.")])
        assert values[("layer-param-l2", layer)] == pytest.approx(theta.double().norm().item(), rel=1e-9)
        assert values[("layer-param-absmax", layer)] == theta.abs().max().item()


def test_parameter_metrics_without_an_optimizer_step_in_the_scope_read_the_parameters() -> None:
    """An update metric is due but no optimizer step runs in the scope: the parameter metrics
    deferred to the snapshot read the parameters (unchanged) at the step's end instead."""
    model = Transformer(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-param-l2"), 1), (build_metric("layer-update-ratio"), 1)],
                            optimizer=optimizer)
    with metrics.step(1):
        pass
    values = {(r.metric, r.layer): r.value for r in metrics.last_records}
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    theta = torch.cat([params[i].reshape(-1) for i, n in enumerate(names) if n.startswith("layers.0.")])
    assert values[("layer-param-l2", 0)] == pytest.approx(theta.double().norm().item(), rel=1e-9)
    assert ("layer-update-ratio", 0) not in values
    assert [f.metric for f in metrics.failures] == ["layer-update-ratio"]
    metrics.close()
