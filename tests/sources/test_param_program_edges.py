"""Edges of the parameter-side program: where it runs, its states equal the general path's.

Each case trains a small model twice from the same seed, once as shipped and once with
``TensorMetrics._plan_program`` returning None (every phase takes the general path), and
compares every record and every reported failure of every step exactly; it also asserts how
many phases the program itself prepared, so a case meant to exercise the program cannot
silently fall back (and a case meant to fall back cannot silently run it). The cases: selects
that cover only some layers, and update metrics whose select differs from the parameter
metrics' (a partial snapshot), scopes tensor/family/global, due sets that change over eleven
steps, frozen parameters and layers without gradients on some steps, steps without
``optimizer.step()`` or without an optimizer, ``observe_gradients()`` early, twice or before
backward, non-contiguous parameters and gradients (from the start, or made so by the optimizer),
a parameter resized by the optimizer, parameters replaced between steps (values and dtype),
bfloat16 and mixed dtypes, NaN, infinities, -0.0 and empty tensors under every moments
statistic, a large tensor, scopes and optimizer hooks that raise, two optimizer steps in one
scope, two ``TensorMetrics`` on one model, and data parallelism on two gloo ranks where one
rank reads a non-contiguous gradient. Float64 references check the update ratio and the parameter
metrics read from the snapshot.

Two tests show where the program and the general path part (both fail as of d78ae02):
a ``StatMetric.kept`` that raises (the general path reports the metric; the program's planning
raises out of ``optimizer.step()``), and a rows statistic whose ``compute`` reads the tensors'
shapes beside the rows (the program hands it no tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.norms import AbsMax, L2Norm, Rms
from tmetrics_core.metrics.statistics import (
    ABSMAX,
    COUNT,
    MAX,
    MIN,
    SUM,
    SUMSQ,
    ZEROS,
    Statistic,
)
from tmetrics_core.sources.param_general import GeneralPath
from tmetrics_core.sources.param_program import ParamProgram
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.tensor_metrics import TensorMetrics

VOCAB, WIDTH = 16, 8

Body = Callable[[torch.nn.Module, Any, TensorMetrics, int], None]


class Net(torch.nn.Module):
    """Embedding, three residual blocks ``layers.N.{norm,fc}`` and a head; ``skip`` leaves
    blocks out of the forward (their parameters then get no gradient)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList()
        for _ in range(3):
            block = torch.nn.Module()
            block.norm = torch.nn.LayerNorm(WIDTH)
            block.fc = torch.nn.Linear(WIDTH, WIDTH)
            self.layers.append(block)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, tokens: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        h = self.embed(tokens)
        for i, block in enumerate(self.layers):
            if i not in skip:
                dtype = block.fc.weight.dtype
                h = h + torch.tanh(block.fc(block.norm(h.to(dtype)))).to(h.dtype)
        return torch.nn.functional.linear(h.to(self.head.weight.dtype), self.head.weight)


class Everything(StatMetric):
    """Every statistic the moments rows give, one record each."""

    statistics = (SUMSQ, SUM, MAX, MIN, ABSMAX, ZEROS, COUNT)

    def finalize(self, stats):
        return {k: v[0] if len(v) == 1 else v[0] + 10.0 * v[1] for k, v in stats.items() if ":" not in k}


class Expected(Exception):
    """Raised on purpose inside a step scope."""


def _loss(model: Net, step: int, skip: tuple[int, ...] = ()) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(step))
    return torch.nn.functional.cross_entropy(model(tokens, skip).reshape(-1, VOCAB).float(), tokens.reshape(-1))


def _plain(model: Net, optimizer: Any, metrics: TensorMetrics, step: int) -> None:
    _loss(model, step).backward()
    optimizer.step()
    optimizer.zero_grad()


def _train(make: Callable[[], Net], spec: list[tuple[Callable[[], Any], int]], body: Body, *, program: bool,
           steps: int, optimizer: Callable[[Net], Any] | None, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[list[Any], tuple[int, int]]:
    """Per step, ``(records by key, failures so far)`` or ``"raised"``; and how many pre and
    post phases the program prepared."""
    ran = [0, 0]
    with monkeypatch.context() as patch:
        if not program:
            patch.setattr(ParamObserver, "_plan_program", lambda self, *args: None)
        for index, name in enumerate(("read_pre", "read_post")):
            original = getattr(ParamProgram, name)

            def counted(self, *args, _original=original, _index=index, **kwargs):
                states = _original(self, *args, **kwargs)
                ran[_index] += states is not None
                return states
            patch.setattr(ParamProgram, name, counted)
        torch.manual_seed(0)
        model = make()
        opt = optimizer(model) if optimizer is not None else None
        metrics = TensorMetrics(model, metrics=[(build(), i) for build, i in spec], optimizer=opt)
        out: list[Any] = []
        for step in range(1, steps + 1):
            try:
                with metrics.step(step):
                    body(model, opt, metrics, step)
            except Expected:
                out.append("raised")
                continue
            out.append(({(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records},
                        [(f.metric, f.error) for f in metrics.failures]))
        metrics.close()
    return out, (ran[0], ran[1])


def _adamw(model: Net) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _sgd(model: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def _compare(make: Callable[[], Net], spec: list, body: Body, monkeypatch: pytest.MonkeyPatch, *, steps: int = 4,
             optimizer: Callable[[Net], Any] | None = _adamw) -> tuple[list[Any], tuple[int, int]]:
    """Both runs; asserts equal records and failures on every step; returns the program's run."""
    fast, ran = _train(make, spec, body, program=True, steps=steps, optimizer=optimizer, monkeypatch=monkeypatch)
    general, none = _train(make, spec, body, program=False, steps=steps, optimizer=optimizer,
                           monkeypatch=monkeypatch)
    assert none == (0, 0)
    for step, (a, b) in enumerate(zip(fast, general, strict=True), start=1):
        if a == "raised" or b == "raised":
            assert a == b, step
            continue
        assert a[0].keys() == b[0].keys(), (step, set(a[0]) ^ set(b[0]))
        bad = {k: (a[0][k], b[0][k]) for k in a[0] if not _same(a[0][k], b[0][k])}
        assert not bad, f"step {step}: {bad}"
        assert a[1] == b[1], step
    return fast, ran


def _metric(name: str, select: str | list[str] | None = None) -> Callable[[], Any]:
    return lambda: build_metric(name, select=select)


ALL = [(_metric(n), 1) for n in ("layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio",
                                 "global-param-l2", "tensor-grad-l2", "family-param-l2", "layer-param-rms",
                                 "layer-grad-zero-fraction", "layer-param-absmax", "layer-grad-rms")]
PARAMS_ONLY = [(b, i) for b, i in ALL if "update" not in b().name]


def _records(run: list[Any]) -> list[int]:
    return [len(step[0]) if step != "raised" else -1 for step in run]


# -- selections, scopes, due sets ----------------------------------------------------------

def test_selects_covering_some_layers_and_a_partial_snapshot(monkeypatch):
    spec = [(_metric("layer-update-ratio", "layers.0.*"), 1),
            (_metric("layer-param-l2", ["layers.0.*", "layers.1.*"]), 1),
            (_metric("tensor-param-l2", "layers.0.fc.*"), 1),
            (_metric("global-grad-l2", "layers.2.*"), 1), (_metric("family-param-l2", "layers.*.norm.weight"), 1)]
    fast, ran = _compare(Net, spec, _plain, monkeypatch)
    assert ran == (4, 4)
    # layers 0 and 1 (param l2), layers.0.fc.{weight,bias}, one global, one family, layer 0's ratio
    assert _records(fast) == [7] * 4


def test_due_sets_changing_over_eleven_steps(monkeypatch):
    """Intervals 1, 2, 3 and 5: parameter metrics are read before the step on some steps and
    from the snapshot on others (their select inside the update ratio's)."""
    spec = [(_metric("layer-update-ratio", "layers.*"), 2), (_metric("layer-param-l2", "layers.1.*"), 1),
            (_metric("family-param-l2", "layers.*.fc.weight"), 3), (_metric("layer-param-absmax", "layers.2.*"), 5),
            (_metric("global-param-l2", "*.fc.*"), 1), (_metric("layer-grad-rms"), 2)]
    fast, ran = _compare(Net, spec, _plain, monkeypatch, steps=11)
    assert ran[0] >= 5 and ran[1] == 6  # a post phase on every step the ratio is due (1, 2, 4, ..., 10)
    assert _records(fast) == [10, 8, 3, 8, 3, 9, 2, 8, 3, 9, 2]


def test_frozen_parameters_and_layers_without_gradients(monkeypatch):
    def frozen() -> Net:
        model = Net()
        model.layers[1].fc.weight.requires_grad_(False)
        model.embed.weight.requires_grad_(False)
        return model

    def skipping(model, optimizer, metrics, step):
        _loss(model, step, skip=(2,) if step % 2 else ()).backward()  # layer 2: grad None on odd steps
        optimizer.step()
        optimizer.zero_grad()
    fast, ran = _compare(frozen, ALL, skipping, monkeypatch)
    # A parameter without a gradient is left out of gradient statistics (a placeholder, never
    # zeros), by the program as by the general path: the program runs every step.
    assert ran == (4, 4)
    values = fast[0][0]
    assert ("layer-grad-zero-fraction", 2, None, None, None) not in values  # no element to count: no record
    assert values[("layer-grad-l2", 2, None, None, None)] == 0.0


def test_gradients_in_main_grad_for_some_parameters(monkeypatch):
    """Megatron-Core's DDP leaves a parameter's gradient in ``main_grad`` (``.grad`` None); a
    ``main_grad`` attribute that is None means ``.grad``. Mixed in one model, the program reads
    each where it is, as the general path does, and the values are those of the tensors read."""
    seen: dict[str, torch.Tensor] = {}

    def mixed(model, optimizer, metrics, step):
        _loss(model, step).backward()
        for name, p in model.named_parameters():
            if name.startswith("layers.1."):
                p.main_grad, p.grad = p.grad * 3, None
            elif name.startswith("layers.2."):
                p.main_grad = None
            seen[name] = p.grad if getattr(p, "main_grad", None) is None else p.main_grad
        metrics.observe_gradients()
        optimizer.step()
        optimizer.zero_grad()
    spec = [(_metric("tensor-grad-l2"), 1), (_metric("layer-grad-absmax"), 1)]
    fast, ran = _compare(Net, spec, mixed, monkeypatch, steps=2)
    assert ran == (2, 0)
    values = fast[-1][0]
    for name in ("layers.0.fc.weight", "layers.1.fc.weight", "layers.2.norm.bias"):
        got = values[("tensor-grad-l2", int(name.split(".")[1]), None, name, None)]
        assert got == pytest.approx(float(seen[name].double().norm()), rel=1e-12), name
    assert values[("layer-grad-absmax", 1, None, None, None)] == pytest.approx(
        max(float(seen[n].abs().max()) for n in seen if n.startswith("layers.1.")), rel=1e-12)


# -- optimizer steps, observe_gradients --------------------------------------------------------

def test_steps_without_optimizer_step_and_without_optimizer(monkeypatch):
    def some_steps(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
    fast, ran = _compare(Net, ALL, some_steps, monkeypatch)
    assert ran == (4, 2)
    assert [f for f, _ in fast[-1][1]] == ["layer-update-ratio"] * 2
    fast, ran = _compare(Net, PARAMS_ONLY, lambda m, o, t, s: _loss(m, s).backward(), monkeypatch, optimizer=None)
    assert ran == (4, 0) and _records(fast) == [42] * 4


def test_observe_gradients_twice_before_clipping_and_before_backward(monkeypatch):
    def early(model, optimizer, metrics, step):
        if step == 3:
            metrics.observe_gradients()  # before backward: no gradients (placeholders only)
        _loss(model, step).backward()
        metrics.observe_gradients()
        metrics.observe_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        metrics.observe_gradients()
        optimizer.zero_grad()
    fast, ran = _compare(Net, ALL, early, monkeypatch)
    # Each call before optimizer.step() reads again (2 per step, 3 at step 3); after it, none.
    assert ran == (9, 4)
    assert fast[2][0][("layer-grad-l2", 1, None, None, None)] > 0.01  # the call before backward is superseded
    assert fast[1][0][("layer-grad-l2", 1, None, None, None)] > 0.01  # read before clipping


def test_two_optimizer_steps_in_one_scope(monkeypatch):
    def twice(model, optimizer, metrics, step):
        _loss(model, step).backward()
        optimizer.step()
        optimizer.step()
        optimizer.zero_grad()
    fast, ran = _compare(Net, ALL, twice, monkeypatch, steps=3)
    assert ran == (3, 3)
    failures = fast[-1][1]  # every step's (kept across steps): the update read after the first step only
    assert [name for name, _ in failures] == ["layer-update-ratio"] * 3
    assert all("optimizer.step() ran again inside the scope of step" in text for _, text in failures)


def test_scope_and_optimizer_hook_raising(monkeypatch):
    def raising(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step == 2:
            raise Expected()
        optimizer.step()
        if step == 3:
            raise Expected()  # after the post phase consumed the snapshot
        optimizer.zero_grad()
    fast, _ = _compare(Net, ALL, raising, monkeypatch, steps=5)
    assert _records(fast) == [45, -1, -1, 45, 45]

    def failing_hook(model: Net) -> torch.optim.Optimizer:
        optimizer = _adamw(model)
        optimizer.register_step_post_hook(lambda *_: (_ for _ in ()).throw(Expected()) if failing_hook.step == 2
                                          else None)
        return optimizer

    def body(model, optimizer, metrics, step):
        failing_hook.step = step
        _plain(model, optimizer, metrics, step)
    fast, ran = _compare(Net, ALL, body, monkeypatch, optimizer=failing_hook)
    assert _records(fast) == [45, -1, 45, 45]
    assert ran == (4, 3)  # the failing hook runs first: no post phase on step 2


# -- tensors the kernel refuses, replaced or resized ------------------------------------------

def test_non_contiguous_parameter_takes_the_program_with_torch_ops(monkeypatch):
    def transposed() -> Net:
        model = Net()
        weight = model.layers[1].fc.weight
        model.layers[1].fc.weight = torch.nn.Parameter(weight.detach().t().contiguous().t())
        assert not model.layers[1].fc.weight.is_contiguous()
        return model
    _, ran = _compare(transposed, ALL, _plain, monkeypatch)
    assert ran == (4, 4)  # the kernel reads the others, batched torch ops the transposed one


def test_non_contiguous_gradient_on_one_step_keeps_the_program(monkeypatch):
    def body(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step == 2:
            weight = model.layers[1].fc.weight
            weight.grad = weight.grad.t().contiguous().t()
        optimizer.step()
        optimizer.zero_grad()
    _, ran = _compare(Net, ALL, body, monkeypatch, steps=3)
    assert ran == (3, 3)


class _Transposing(torch.optim.Optimizer):
    """SGD that leaves ``target`` non-contiguous after its step on the steps in ``when``."""

    def __init__(self, params, target: torch.nn.Parameter, when: set[int]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.target, self.when, self.count = target, when, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
        data = self.target.data
        self.target.data = data.t().contiguous().t() if self.count in self.when else data.contiguous()


def test_parameter_made_non_contiguous_by_the_optimizer(monkeypatch):
    """The parameter strided after step 2's optimizer step and non-contiguous before step 3's:
    the program reads it with torch ops in every phase (no layout is refused)."""
    _, ran = _compare(Net, ALL, _plain, monkeypatch,
                      optimizer=lambda m: _Transposing(m.parameters(), m.layers[0].fc.weight, {2}))
    assert ran == (4, 4)


class _Resizing(torch.optim.Optimizer):
    """SGD that enlarges ``target`` inside its second step."""

    def __init__(self, params, target: torch.nn.Parameter) -> None:
        super().__init__(params, {"lr": 0.1})
        self.target, self.count = target, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
        if self.count == 2:
            self.target.data = torch.zeros(self.target.shape[0] + 1, *self.target.shape[1:])


class _SlicingNet(Net):
    """Reads only the first WIDTH rows of each block's weight (so a grown weight still fits)."""

    def forward(self, tokens, skip=()):
        h = self.embed(tokens)
        for block in self.layers:
            h = h + torch.tanh(torch.nn.functional.linear(block.norm(h), block.fc.weight[:WIDTH], block.fc.bias))
        return self.head(h)


def test_parameter_resized_by_the_optimizer(monkeypatch):
    fast, ran = _compare(_SlicingNet, ALL, _plain, monkeypatch,
                         optimizer=lambda m: _Resizing(m.parameters(), m.layers[1].fc.weight))
    assert ran == (4, 3)
    assert [f for f, _ in fast[-1][1]] == ["layer-update-ratio"]
    assert "reading the post-step tensors failed" in fast[-1][1][0][1]


def test_parameters_replaced_between_steps(monkeypatch):
    def body(model, optimizer, metrics, step):
        if step == 2:
            model.layers[2].fc.bias.data = torch.randn(WIDTH, generator=torch.Generator().manual_seed(5))
        if step == 3:
            model.head.weight.data = model.head.weight.data.to(torch.bfloat16)
        _plain(model, optimizer, metrics, step)
    _, ran = _compare(Net, ALL, body, monkeypatch, optimizer=_sgd)
    assert ran == (4, 4)


def test_bfloat16_and_mixed_dtypes(monkeypatch):
    def mixed() -> Net:
        model = Net()
        model.layers[0].to(torch.bfloat16)
        return model
    for make in (mixed, lambda: Net().to(torch.bfloat16)):
        _, ran = _compare(make, ALL, _plain, monkeypatch, steps=3)
        assert ran == (3, 3)


class _WithExtras(Net):
    """Also an empty parameter and one of 280 000 elements (the threaded kernel path)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1].empty = torch.nn.Parameter(torch.zeros(0, WIDTH))
        self.layers[0].big = torch.nn.Parameter(torch.randn(400, 700, generator=torch.Generator().manual_seed(1)))

    def forward(self, tokens, skip=()):
        return super().forward(tokens, skip) + 1e-3 * self.layers[0].big.square().mean()


def _everything(name: str, kinds: list[str], scope: str, select: str | None = None) -> Callable[[], Everything]:
    return lambda: Everything(name=name, source_kinds=kinds, scope=scope, select=select)


EVERYTHING = [(_everything("e-param", ["param"], "tensor"), 1), (_everything("e-grad", ["grad"], "layer"), 1),
              (_everything("e-update", ["update", "param"], "tensor", "layers.*"), 2),
              (_everything("e-before", ["param"], "global", "layers.1.*"), 1)]


def _poison(model, optimizer, metrics, step):
    _loss(model, step).backward()
    with torch.no_grad():
        if step == 2:
            model.layers[0].fc.weight[0, 0] = float("nan")
            model.layers[1].fc.weight.zero_()
            model.layers[1].fc.weight[0, 0] = -0.0
            model.layers[2].fc.bias.fill_(float("inf"))
            model.layers[2].fc.bias[0] = -float("inf")
            model.layers[1].norm.weight.grad.fill_(float("nan"))
        if step == 3:
            model.layers[2].fc.bias.fill_(-0.0)
            model.layers[1].norm.weight.grad.fill_(-0.0)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_moments_statistic_on_nan_infinities_negative_zero_empty_and_large(dtype, monkeypatch):
    fast, ran = _compare(lambda: _WithExtras().to(dtype), EVERYTHING, _poison, monkeypatch, optimizer=_sgd)
    # The empty parameter gets no gradient: a placeholder for it, in the program as in the
    # general path; no post phase on step 3 (e-update is due every other step).
    assert ran == (4, 3)
    values = fast[1][0]
    assert math.isnan(values[("e-param", 0, None, "layers.0.fc.weight", "sumsq")])
    assert values[("e-param", 0, None, "layers.0.fc.weight", "absmax")] == 10.0  # neutral 0 + NaN flag
    assert values[("e-param", 2, None, "layers.2.fc.bias", "absmax")] == math.inf
    assert values[("e-param", 1, None, "layers.1.empty", "count")] == 0.0
    assert values[("e-param", 1, None, "layers.1.fc.weight", "zeros")] == WIDTH * WIDTH


# -- other metric shapes ---------------------------------------------------------------------

def test_metrics_of_several_kinds_and_of_updates_alone(monkeypatch):
    spec = [(lambda: L2Norm(name="layer-paramgrad-l2", source_kinds=["param", "grad"], scope="layer"), 1),
            (lambda: L2Norm(name="layer-update-l2", source_kinds=["update"], scope="layer", select="layers.[01].*"), 1),
            (lambda: AbsMax(name="tensor-update-absmax", source_kinds=["update"], scope="tensor",
                            select="layers.1.*"), 2),
            (lambda: Rms(name="family-update-rms", source_kinds=["update", "param"], scope="family"), 3),
            (lambda: AbsMax(name="global-param-absmax", source_kinds=["param"], select="layers.0.*"), 1),
            (_metric("layer-update-ratio", "layers.2.*"), 2)]
    fast, ran = _compare(Net, spec, _plain, monkeypatch, steps=6)
    assert ran == (6, 6)
    assert _records(fast) == [17, 11, 12, 11, 6, 17]


def test_two_tensor_metrics_on_one_model(monkeypatch):
    def run(program: bool) -> list:
        with monkeypatch.context() as patch:
            if not program:
                patch.setattr(ParamObserver, "_plan_program", lambda self, *args: None)
            model = Net()
            optimizer = _adamw(model)
            a = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1),
                                              (build_metric("layer-param-l2"), 2)], optimizer=optimizer)
            b = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio", select="layers.1.*"), 2),
                                              (build_metric("layer-grad-l2"), 1), (build_metric("layer-param-l2"), 1)],
                              optimizer=optimizer)
            out = []
            for step in range(1, 5):
                with a.step(step), b.step(step):
                    _loss(model, step).backward()
                    if step == 2:
                        b.observe_gradients()
                    optimizer.step()
                    optimizer.zero_grad()
                out.append(sorted((r.metric, r.layer, r.value) for r in [*a.last_records, *b.last_records]))
            assert a.failures == [] and b.failures == []
            planned = [plan.program is not None for m in (a, b) for plan in m.params._plans.values()]
            assert planned and all(planned) == program
            a.close()
            b.close()
            return out
    fast, general = run(True), run(False)
    assert fast == general
    assert [len(step) for step in fast] == [13, 13, 9, 13]


# -- float64 references ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_ratio_and_snapshot_reads_against_float64(dtype):
    """Through the program (asserted), the update ratio equals ||p_after - p_before|| /
    ||p_after|| per layer and layer-param-l2 (read from the snapshot) ||p_before||, in float64."""
    model = Net().to(dtype)
    optimizer = _adamw(model)
    metrics = TensorMetrics(model, optimizer=optimizer, metrics=[(build_metric("layer-update-ratio"), 1),
                                                                 (build_metric("layer-param-l2"), 1)])
    assert metrics.params._plans == {}
    for step in range(1, 3):
        with metrics.step(step):
            _loss(model, step).backward()
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            optimizer.step()
            after = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            optimizer.zero_grad()
        program = [plan.program for plan in metrics.params._plans.values()]
        assert len(program) == 1 and program[0] is not None and len(program[0].post.recipes) == 2
        values = {(r.metric, r.layer): r.value for r in metrics.last_records}
        for layer in range(3):
            names = [n for n in before if n.startswith(f"layers.{layer}.")]
            update = math.sqrt(sum((after[n] - before[n]).pow(2).sum().item() for n in names))
            param_after = math.sqrt(sum(after[n].pow(2).sum().item() for n in names))
            param_before = math.sqrt(sum(before[n].pow(2).sum().item() for n in names))
            assert values[("layer-update-ratio", layer)] == pytest.approx(update / param_after, rel=1e-9)
            assert values[("layer-param-l2", layer)] == pytest.approx(param_before, rel=1e-12)
    metrics.close()


# -- data parallel, one rank reading a non-contiguous gradient ------------------------------

DP_METRICS = {"layer-param-l2": 1, "layer-grad-l2": 1, "layer-grad-absmax": 1, "layer-update-ratio": 2,
              "tensor-grad-l2": 1, "global-param-l2": 3, "layer-grad-rms": 1}


def train_data_parallel(rank: int, world: int, program: bool) -> tuple[list[dict], list, tuple[int, int]]:
    """Three steps of the demo model under DDP on ``dp``; on rank 1 at step 2 one gradient is
    made non-contiguous (same values), read by torch ops within the program on that rank."""
    from tmetrics_core.topology import Topology
    from tmetrics_core.demo.model import ModelConfig
    from tmetrics_core.demo.parallel import parallelize
    from tmetrics_core.demo.degrees import ParallelDegrees as DemoTopology

    if not program:
        ParamObserver._plan_program = lambda self, *args: None
    ran = [0, 0]
    for index, name in enumerate(("read_pre", "read_post")):
        original = getattr(ParamProgram, name)

        def counted(self, *args, _original=original, _index=index, **kwargs):
            states = _original(self, *args, **kwargs)
            ran[_index] += states is not None
            return states
        setattr(ParamProgram, name, counted)
    torch.manual_seed(0)
    config = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=12, n_experts=4, top_k=2, dense_layers=(1,),
                         seq_len=16)
    parallel = parallelize(config, DemoTopology(dp=2), seed=3, batch_size=8)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-2)
    metrics = TensorMetrics(parallel.model, metrics=[(build_metric(n), i) for n, i in DP_METRICS.items()],
                            optimizer=optimizer, topology=Topology.from_mesh(parallel.mesh), timeout_s=30)
    out = []
    for step in range(1, 4):
        batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
        with metrics.step(step):
            parallel.forward_backward(batch)
            if rank == 1 and step == 2:
                p = next(p for p in parallel.model.parameters() if p.dim() == 2 and p.grad is not None)
                p.grad = p.grad.t().contiguous().t()
            optimizer.step()
            optimizer.zero_grad()
        out.append({(r.metric, r.layer, r.tensor, r.stat): r.value for r in metrics.last_records})
    failures = [(f.metric, f.error) for f in metrics.failures]
    metrics.close()
    return out, failures, (ran[0], ran[1])


@pytest.mark.timeout(120)
def test_data_parallel_with_one_rank_reading_a_non_contiguous_gradient():
    fast = run_distributed(train_data_parallel, 2, True, timeout=90, collective_timeout=30)
    general = run_distributed(train_data_parallel, 2, False, timeout=90, collective_timeout=30)
    for rank in range(2):
        records, failures, ran = fast[rank]
        assert failures == [] and general[rank][1] == []
        assert ran == (3, 2) and general[rank][2] == (0, 0)
        assert [len(r) for r in records] == [42, 41, 40]
        assert records == general[rank][0], rank
    # replicated: the ranks agree but at step 2, where rank 1 read one gradient with torch kernels
    assert fast[0][0][0] == fast[1][0][0] and fast[0][0][2] == fast[1][0][2]


# -- where the program and the general path part (failing as of d78ae02) ---------------------

class _BrokenKept(L2Norm):
    """A metric whose ``kept`` raises: a metric error, which the general path reports."""

    def kept(self, sites):
        raise RuntimeError("kept is broken")


def test_a_kept_that_raises_is_reported_not_raised_from_optimizer_step(monkeypatch):
    """The general path calls ``kept`` inside ``prepare`` (under ``prepare_states``' per-metric
    error handling); the program calls it while planning, in ``_programmed`` outside any try,
    so the error escapes the optimizer's pre-hook and ends the training step (on every due step:
    the plan is never cached)."""
    spec = [(lambda: _BrokenKept(name="bad-grad-l2", source_kinds=["grad"], scope="layer"), 1),
            (_metric("layer-param-l2"), 1)]
    general, _ = _train(Net, spec, _plain, program=False, steps=2, optimizer=_adamw, monkeypatch=monkeypatch)
    assert general[-1][1] == [("bad-grad-l2", "RuntimeError: kept is broken")] * 2
    assert _records(general) == [3, 3]
    _compare(Net, spec, _plain, monkeypatch, steps=2)


class _MeanSquare(Statistic):
    """Per tensor ``sum x**2 / numel`` from the rows and the tensor's shape; reads no element
    (``elements`` False), so a same-shaped stand-in serves (``_eligible`` in sources/param_program.py)."""

    name = "mean_square"
    op = "max"
    elements = False
    reads = frozenset({"sumsq"})

    def compute(self, tensors, sites, topology, rows):
        counts = torch.tensor([[float(max(t.numel(), 1))] for t in tensors], dtype=torch.float64)
        return rows[:, 0:1] / counts


class _PeakMeanSquare(StatMetric):
    statistics = (_MeanSquare(),)

    def finalize(self, stats):
        return stats["mean_square"][0]


def test_a_moments_statistic_reading_shapes_gets_its_tensors(monkeypatch):
    """``Statistic.compute(tensors, sites, topology, rows)`` documents one row per tensor; the program
    passes the tensors only to metrics with a ``shape_only`` statistic, so this metric gets
    ``[]`` (an empty matrix, then ``IndexError`` in finalize) where the general path reports it."""
    spec = [(lambda: _PeakMeanSquare(name="layer-grad-peak-ms", source_kinds=["grad"], scope="layer"), 1),
            (lambda: _PeakMeanSquare(name="layer-update-peak-ms", source_kinds=["update"], scope="layer"), 1)]
    general, _ = _train(Net, spec, _plain, program=False, steps=1, optimizer=_adamw, monkeypatch=monkeypatch)
    assert general[0][1] == [] and _records(general) == [6]
    _compare(Net, spec, _plain, monkeypatch, steps=2)


def test_metrics_the_program_does_not_plan_take_the_general_path_beside_it(monkeypatch):
    """Histograms and Adam-state metrics are prepared by the general path in the same step as the
    program's metrics: every record equals an all-general run, and the program ran each phase."""
    spec = ALL + [(_metric(n), 1) for n in ("layer-param-histogram", "layer-grad-histogram",
                                            "layer-optimizer-state-rms")]
    fast, ran = _compare(Net, spec, _plain, monkeypatch)
    assert ran == (4, 4)
    assert {key[0] for key in fast[-1][0]} >= {"layer-param-histogram", "layer-optimizer-state-rms", "layer-grad-l2"}


def test_adam_state_metrics_take_the_program(monkeypatch):
    """Adam's exp_avg and exp_avg_sq are read after the step by one moments pass beside the
    parts pass (the state does not exist before the first step: placeholders, as the general
    path gives); only the histogram is left to the general path."""
    general: dict[int, set[str]] = {}
    original = GeneralPath.prepare_from

    def recorded(self, metrics, *args, **kwargs):
        general.setdefault(id(self), set()).update(m.name for m in metrics)
        return original(self, metrics, *args, **kwargs)

    monkeypatch.setattr(GeneralPath, "prepare_from", recorded)
    spec = [(_metric(n), 1) for n in ("layer-optimizer-state-rms", "layer-update-ratio", "layer-grad-l2",
                                      "layer-param-histogram")]
    fast, ran = _compare(Net, spec, _plain, monkeypatch)
    assert ran == (4, 4)
    # The program's run comes first in _compare: there only the histogram took the general path.
    assert list(general.values())[0] == {"layer-param-histogram"}
    assert fast[0][0][("layer-optimizer-state-rms", 0, None, None, "exp_avg")] > 0


class _Devices(torch.utils._python_dispatch.TorchDispatchMode):
    """The devices of the index each ``index_select`` and ``index_fill`` reads, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_select.default, torch.ops.aten.index_fill.int_Scalar):
            self.seen.append((func.__name__, args[0].device.type, args[2].device.type))
        return func(*args, **(kwargs or {}))


def test_row_indices_follow_the_rows_device_and_placeholders_are_made_once_per_pattern():
    """On an accelerator the moments rows live on the device: a recipe's row index is copied
    there once (not read from the host on every due step, nor refused), and a frozen weight's
    placeholder rows reuse the index made on the first due step. The meta device stands in."""
    model = Net()
    model.layers[1].fc.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("layer-grad-l2", "layer-update-ratio")],
                            optimizer=optimizer)
    for step in (1, 2):
        with metrics.step(step):
            _plain(model, optimizer, metrics, step)
    program = next(plan.program for plan in metrics.params._plans.values() if plan.program is not None)
    assert program.pre._fills
    fills = {key: [id(at) for _, at in value] for key, value in program.pre._fills.items()}
    with metrics.step(3):
        _plain(model, optimizer, metrics, 3)
    assert {key: [id(at) for _, at in value] for key, value in program.pre._fills.items()} == fills
    plan = program.post
    assert any(type(r.index) is not slice for r in plan.recipes)  # the update ratio's rows: an index
    rows = torch.zeros(3 * len(program.names) + len(program.state_reads), 5, device="meta")
    for _ in range(2):
        with _Devices() as seen:
            plan.states(rows, lambda r: torch.zeros(WIDTH, device="meta"))
        assert seen.seen and all(on == "meta" for _, _, on in seen.seen)
    assert {device.type for _, device in plan._on_device} == {"meta"}
    metrics.close()
