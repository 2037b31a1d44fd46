"""Metrics of parameters alone, due together with an update metric, are prepared after the
optimizer step from the update snapshot: they must still report the parameters as they were
before ``optimizer.step()``. Every case here compares against float64 references on the
parameters cloned just before the step, and against the same metrics run on a deep copy of the
model taken then (no update metric due, so nothing is deferred): selections the update metric
does not cover, changing due sets, ``observe_gradients()``, a parameter resized by the
optimizer, bfloat16 parameters, element-reading metrics (histograms,
non-finite counts) with the update written in place or not, and consecutive due steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch

# A plain SGD that then enlarges one parameter; an update statistic outside the rows
# (so the update is written in place into the snapshot, after the deferred metrics read it).
from tests.sources.test_update_paths import UpdateMeanRowL2, _Resizing
from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.norms import NonFinite
from tmetrics_core.tensor_metrics import TensorMetrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, seq_len=16)
NAN_PARAM = "layers.1.attn.q.weight"


def _values(metrics: TensorMetrics) -> dict[tuple, object]:
    return {(r.metric, r.layer, r.tensor, r.stat): r.value for r in metrics.last_records}


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _reference(model: torch.nn.Module, names: list[str], builders: dict) -> dict[tuple, object]:
    """The named metrics on a copy of ``model`` now, read in the pre phase (nothing deferred)."""
    twin = copy.deepcopy(model)
    metrics = TensorMetrics(twin, metrics=[(builders[n](), 1) for n in names])
    with metrics.step(1):
        pass
    assert metrics.failures == []
    out = _values(metrics)
    metrics.close()
    return out


def _loss(model: Transformer, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))


def _params_by_name(metrics: TensorMetrics) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in metrics.manifest.local.items()}


def _run(builders: dict, intervals: dict[str, int], steps: int, *, optimizer=None, dtype=torch.float32,
         early: bool = False, before_step=None):
    """Train ``steps`` steps; per step, the records, the parameters just before the step and
    the pre-phase reference of every due parameter-only metric on a copy taken then."""
    model = Transformer(SMALL, seed=0).to(dtype)
    optimizer = optimizer(model) if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = TensorMetrics(model, metrics=[(builders[n](), intervals[n]) for n in builders], optimizer=optimizer)
    params_only = [n for n in builders if set(builders[n]().source_kinds) == {"param"}]
    out = []
    for step in range(1, steps + 1):
        with metrics.step(step):
            _loss(model, step).backward()
            if before_step is not None:
                before_step(model, step)
            due = [n for n in params_only if step % intervals[n] == 0 or step == 1]
            reference = _reference(model, due, builders) if due else {}
            before = _params_by_name(metrics)
            if early:
                metrics.observe_gradients()
            optimizer.step()
            optimizer.zero_grad()
        assert metrics.failures == [], metrics.failures
        out.append((_values(metrics), before, reference, _params_by_name(metrics)))
    metrics.close()
    return out


def _layer_l2(params: dict[str, torch.Tensor], layer: int, select: str = "*") -> float:
    from fnmatch import fnmatchcase

    chosen = [t for n, t in params.items() if n.startswith(f"layers.{layer}.") and fnmatchcase(n, select)]
    return torch.cat([t.reshape(-1).double() for t in chosen]).norm().item()


def _assert_reference(values: dict, reference: dict) -> None:
    assert reference
    for key, want in reference.items():
        assert key in values, key
        assert _same(values[key], want), (key, values[key], want)


BASE = {
    "layer-param-l2": lambda: build_metric("layer-param-l2"),
    "layer-param-absmax": lambda: build_metric("layer-param-absmax"),
    "global-param-l2": lambda: build_metric("global-param-l2"),
    "tensor-param-l2": lambda: build_metric("tensor-param-l2", select="layers.1.attn.*"),
    "layer-update-ratio": lambda: build_metric("layer-update-ratio", select="layers.*.attn.*"),
}


@pytest.mark.parametrize("early", [False, True], ids=["pre-hook", "observe_gradients"])
def test_param_metrics_wider_or_narrower_than_the_update_metric_report_the_parameters_before_the_step(
        early: bool) -> None:
    """The update ratio selects the attention weights only: ``layer-param-l2``,
    ``layer-param-absmax`` and ``global-param-l2`` read more (not deferred),
    ``tensor-param-l2`` of ``layers.1.attn.*`` reads a subset (deferred); all report the
    parameters before the step."""
    ((values, before, reference, after),) = _run(BASE, dict.fromkeys(BASE, 1), 1, early=early)
    _assert_reference(values, reference)
    rel = 1e-6
    for layer in range(SMALL.n_layers):
        assert values[("layer-param-l2", layer, None, None)] == pytest.approx(_layer_l2(before, layer), rel=rel)
        assert values[("layer-param-absmax", layer, None, None)] == max(
            t.abs().max().item() for n, t in before.items() if n.startswith(f"layers.{layer}."))
        ratio = math.sqrt(sum((after[n].double() - before[n].double()).pow(2).sum().item() for n in before
                              if n.startswith(f"layers.{layer}.attn.")))
        assert values[("layer-update-ratio", layer, None, None)] == pytest.approx(
            ratio / _layer_l2(after, layer, "*.attn.*"), rel=1e-6)
    everything = torch.cat([t.reshape(-1).double() for t in before.values()]).norm().item()
    assert values[("global-param-l2", None, None, None)] == pytest.approx(everything, rel=rel)
    for name in [n for n in before if n.startswith("layers.1.attn.")]:
        assert values[("tensor-param-l2", 1, name, None)] == pytest.approx(before[name].double().norm().item(), rel=rel)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the step moved the parameters


def test_changing_due_sets_over_six_steps() -> None:
    """Parameter metrics every 2 steps, the update ratio every 3 (and both at step 1): the due
    set differs from step to step, and each parameter metric reports the parameters before its
    step whether the update ratio is due with it (steps 1 and 6) or not (2 and 4)."""
    intervals = {"layer-param-l2": 2, "layer-param-absmax": 2, "global-param-l2": 1, "tensor-param-l2": 2,
                 "layer-update-ratio": 3}
    builders = dict(BASE, **{"layer-update-ratio": lambda: build_metric("layer-update-ratio")})
    runs = _run(builders, intervals, 6)
    for step, (values, before, reference, _) in enumerate(runs, start=1):
        _assert_reference(values, reference)
        assert (("layer-update-ratio", 0, None, None) in values) == (step in (1, 3, 6))
        assert (("layer-param-l2", 0, None, None) in values) == (step in (1, 2, 4, 6))
        everything = torch.cat([t.reshape(-1).double() for t in before.values()]).norm().item()
        assert values[("global-param-l2", None, None, None)] == pytest.approx(everything, rel=1e-9)


def test_consecutive_due_steps_each_report_their_own_parameters_before_the_step() -> None:
    builders = {"layer-param-l2": BASE["layer-param-l2"], "layer-update-ratio": lambda: build_metric("layer-update-ratio")}
    runs = _run(builders, dict.fromkeys(builders, 1), 3)
    seen = []
    for values, before, reference, _ in runs:
        _assert_reference(values, reference)
        seen.append(values[("layer-param-l2", 0, None, None)])
        assert seen[-1] == pytest.approx(_layer_l2(before, 0), rel=1e-9)
    assert len(set(seen)) == 3


def test_bf16_parameters() -> None:
    builders = {n: BASE[n] for n in ("layer-param-l2", "layer-param-absmax", "tensor-param-l2")}
    builders["layer-update-ratio"] = lambda: build_metric("layer-update-ratio")
    ((values, before, reference, after),) = _run(builders, dict.fromkeys(builders, 1), 1, dtype=torch.bfloat16,
                                                 optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    _assert_reference(values, reference)
    for layer in range(SMALL.n_layers):
        assert values[("layer-param-l2", layer, None, None)] == pytest.approx(_layer_l2(before, layer),
                                                                              rel=1e-12)
        # The program widens p - prev to float32: the update is exact, not rounded to bfloat16.
        diff = (lambda n: after[n].double() - before[n].double())
        delta = math.sqrt(sum(diff(n).pow(2).sum().item() for n in before if n.startswith(f"layers.{layer}.")))
        assert delta > 0
        assert values[("layer-update-ratio", layer, None, None)] == pytest.approx(
            delta / _layer_l2(after, layer), rel=1e-6)


ELEMENTS = {
    "layer-param-histogram": lambda: build_metric("layer-param-histogram"),
    "layer-param-nonfinite": lambda: NonFinite(name="layer-param-nonfinite", source_kinds=["param"], scope="layer"),
    "global-param-mean-row-l2": lambda: build_metric("global-param-mean-row-l2", select="layers.*"),
    "layer-update-ratio": lambda: build_metric("layer-update-ratio"),
}


class _Cleaning(torch.optim.Optimizer):
    """Plain SGD whose step then replaces non-finite parameter elements by 0 (so after the step
    the parameters are finite; before it one is NaN and one +inf), inside its own ``step``."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                p.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _poison(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        weight = dict(model.named_parameters())[NAN_PARAM]
        weight[0, 0], weight[2, 3] = float("nan"), float("inf")


@pytest.mark.parametrize("written", [False, True], ids=["program", "written update"])
def test_element_reading_param_metrics_read_the_snapshot_not_the_update(written: bool) -> None:
    """Histograms, non-finite counts and row norms of the parameters read elements: with the
    update ratio due they read the snapshot, which the written-update path then overwrites in
    place with the update; the records are still those of the parameters before the step, NaN
    and inf that the step removed included."""
    builders = dict(ELEMENTS)
    if written:
        builders["update-mean-row-l2"] = UpdateMeanRowL2
    runs = _run(builders, dict.fromkeys(builders, 1), 2, before_step=_poison,
                optimizer=lambda m: _Cleaning(m.parameters(), lr=0.1))
    for values, before, reference, after in runs:
        _assert_reference(values, reference)
        assert values[("layer-param-nonfinite", 1, None, "nan")] == 1
        assert values[("layer-param-nonfinite", 1, None, "posinf")] == 1
        assert values[("layer-param-nonfinite", 0, None, "total")] == 0
        assert all(torch.isfinite(t).all() for t in after.values())
        assert math.isnan(values[("layer-update-ratio", 1, None, None)])


def test_a_parameter_resized_by_the_optimizer_leaves_the_param_metrics_on_the_parameters_before_the_step(
) -> None:
    """The update ratio fails (reported); the parameter metrics deferred to the snapshot still
    report the parameters before the step, the resized one at its old size and values."""
    model = Transformer(SMALL, seed=0)
    target = dict(model.named_parameters())["layers.0.attn.q.weight"]
    optimizer = _Resizing(model.parameters(), target)
    chosen = [(build_metric("layer-param-l2"), 1), (build_metric("tensor-param-l2", select="layers.0.attn.q.weight"), 1),
              (build_metric("layer-update-ratio"), 1)]
    metrics = TensorMetrics(model, metrics=chosen, optimizer=optimizer)
    with metrics.step(1):
        _loss(model, 1).backward()
        before = _params_by_name(metrics)
        optimizer.step()
    assert [f.metric for f in metrics.failures] == ["layer-update-ratio"]
    values = _values(metrics)
    metrics.close()
    assert target.shape[0] == SMALL.d_model + 1
    rel = 1e-6
    for layer in range(SMALL.n_layers):
        assert values[("layer-param-l2", layer, None, None)] == pytest.approx(_layer_l2(before, layer), rel=rel)
    assert values[("tensor-param-l2", 0, "layers.0.attn.q.weight", None)] == pytest.approx(
        before["layers.0.attn.q.weight"].double().norm().item(), rel=rel)


def test_two_optimizer_steps_in_one_scope_report_the_parameters_before_the_first() -> None:
    """Parameter metrics read in the first step's pre-hook before this change; deferred to the
    snapshot, they still see the parameters before the first step. The update ratio, read after
    the first step only, fails that step on every rank with the reason (it reported the first
    step's update as the step's)."""
    model = Transformer(SMALL, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-param-l2"), 1), (build_metric("layer-update-ratio"), 1)],
                            optimizer=optimizer)
    with metrics.step(1):
        _loss(model, 1).backward()
        before = _params_by_name(metrics)
        optimizer.step()
        optimizer.step()
    values = _values(metrics)
    metrics.close()
    assert [f.metric for f in metrics.failures] == ["layer-update-ratio"]
    assert "optimizer.step() ran again inside the scope of step 1" in metrics.failures[0].error
    assert not any(k[0] == "layer-update-ratio" for k in values)
    for layer in range(SMALL.n_layers):
        assert values[("layer-param-l2", layer, None, None)] == pytest.approx(_layer_l2(before, layer), rel=1e-9)
