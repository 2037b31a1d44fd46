"""Edges of the parameter side's one path, every record against a float64 reference.

Each case trains a small model once and checks every record of every moments metric, on every
step, against the float64 reference of :mod:`tests.sources.param_reference` (the tensors as
tmetrics documents it reads them, reduced in float64); cases also assert record counts,
failures and particular values. The cases: selects that cover only some layers, and update
metrics whose select differs from the parameter metrics' (a partial snapshot), scopes
tensor/family/global, due sets that change over eleven steps, frozen parameters and layers
without gradients on some steps, gradients in ``main_grad``, steps without ``optimizer.step()``
or without an optimizer, ``observe_gradients()`` early, twice or before backward, non-contiguous
parameters and gradients (from the start, or made so by the optimizer), a parameter resized by
the optimizer, parameters replaced between steps (values and dtype), bfloat16 and mixed dtypes,
NaN, infinities, -0.0 and empty tensors under every moments statistic, a large tensor, scopes
and optimizer hooks that raise, two optimizer steps in one scope, two ``TensorMetrics`` on one
model, histograms and Adam state beside moments metrics, a ``StatMetric.kept`` that raises, a
rows statistic reading shapes, and data parallelism on two gloo ranks where one rank reads a
non-contiguous gradient.
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
from tests.sources.param_reference import Capture, assert_matches
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


def _train(make: Callable[[], Net], spec: list[tuple[Callable[[], Any], int]], body: Body, *, steps: int,
           optimizer: Callable[[Net], Any] | None, rel: float = 1e-6) -> tuple[list[Any], int]:
    """Per step, ``(records by key, failures so far)`` or ``"raised"``, every record of a
    moments metric checked against the float64 reference; and how many records were checked."""
    torch.manual_seed(0)
    model = make()
    opt = optimizer(model) if optimizer is not None else None
    metrics = TensorMetrics(model, metrics=[(build(), i) for build, i in spec], optimizer=opt)
    capture = Capture(metrics, opt)
    out: list[Any] = []
    checked = 0
    for step in range(1, steps + 1):
        capture.begin()
        failed = len(metrics.failures)
        try:
            with metrics.step(step):
                body(model, opt, metrics, step)
                capture.end()
        except Expected:
            out.append("raised")
            continue
        records = {(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records}
        checked += assert_matches(records, capture, {f.metric for f in metrics.failures[failed:]}, rel=rel,
                                  where=f"step {step}")
        out.append((records, [(f.metric, f.error) for f in metrics.failures]))
    metrics.close()
    return out, checked


def _adamw(model: Net) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _sgd(model: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _compare(make: Callable[[], Net], spec: list, body: Body, *,
             steps: int = 4, optimizer: Callable[[Net], Any] | None = _adamw, rel: float = 1e-6
             ) -> tuple[list[Any], int]:
    """The run, every moments record checked against the float64 reference; returns it and how
    many records were checked (at least one)."""
    run, checked = _train(make, spec, body, steps=steps, optimizer=optimizer, rel=rel)
    assert checked > 0
    return run, checked


def _metric(name: str, select: str | list[str] | None = None) -> Callable[[], Any]:
    return lambda: build_metric(name, select=select)


ALL = [(_metric(n), 1) for n in ("layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio",
                                 "global-param-l2", "tensor-grad-l2", "family-param-l2", "layer-param-rms",
                                 "layer-grad-zero-fraction", "layer-param-absmax", "layer-grad-rms")]
PARAMS_ONLY = [(b, i) for b, i in ALL if "update" not in b().name]


def _records(run: list[Any]) -> list[int]:
    return [len(step[0]) if step != "raised" else -1 for step in run]


# -- selections, scopes, due sets ----------------------------------------------------------

def test_selects_covering_some_layers_and_a_partial_snapshot():
    spec = [(_metric("layer-update-ratio", "layers.0.*"), 1),
            (_metric("layer-param-l2", ["layers.0.*", "layers.1.*"]), 1),
            (_metric("tensor-param-l2", "layers.0.fc.*"), 1),
            (_metric("global-grad-l2", "layers.2.*"), 1), (_metric("family-param-l2", "layers.*.norm.weight"), 1)]
    fast, _ = _compare(Net, spec, _plain)
    # layers 0 and 1 (param l2), layers.0.fc.{weight,bias}, one global, one family, layer 0's ratio
    assert _records(fast) == [7] * 4


def test_due_sets_changing_over_eleven_steps():
    """Intervals 1, 2, 3 and 5: parameter metrics are read before the step on some steps and
    from the snapshot on others (their select inside the update ratio's)."""
    spec = [(_metric("layer-update-ratio", "layers.*"), 2), (_metric("layer-param-l2", "layers.1.*"), 1),
            (_metric("family-param-l2", "layers.*.fc.weight"), 3), (_metric("layer-param-absmax", "layers.2.*"), 5),
            (_metric("global-param-l2", "*.fc.*"), 1), (_metric("layer-grad-rms"), 2)]
    fast, _ = _compare(Net, spec, _plain, steps=11)
    assert _records(fast) == [10, 8, 3, 8, 3, 9, 2, 8, 3, 9, 2]


def test_frozen_parameters_and_layers_without_gradients():
    def frozen() -> Net:
        model = Net()
        model.layers[1].fc.weight.requires_grad_(False)
        model.embed.weight.requires_grad_(False)
        return model

    def skipping(model, optimizer, metrics, step):
        _loss(model, step, skip=(2,) if step % 2 else ()).backward()  # layer 2: grad None on odd steps
        optimizer.step()
        optimizer.zero_grad()
    fast, _ = _compare(frozen, ALL, skipping)
    # A parameter without a gradient is left out of gradient statistics (a placeholder, never
    # zeros).
    values = fast[0][0]
    assert ("layer-grad-zero-fraction", 2, None, None, None) not in values  # no element to count: no record
    assert values[("layer-grad-l2", 2, None, None, None)] == 0.0


def test_gradients_in_main_grad_for_some_parameters():
    """Megatron-Core's DDP leaves a parameter's gradient in ``main_grad`` (``.grad`` None); a
    ``main_grad`` attribute that is None means ``.grad``. Mixed in one model, the program reads
    each where it is, and the values are those of the tensors read."""
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
    fast, _ = _compare(Net, spec, mixed, steps=2)
    values = fast[-1][0]
    for name in ("layers.0.fc.weight", "layers.1.fc.weight", "layers.2.norm.bias"):
        got = values[("tensor-grad-l2", int(name.split(".")[1]), None, name, None)]
        assert got == pytest.approx(float(seen[name].double().norm()), rel=1e-12), name
    assert values[("layer-grad-absmax", 1, None, None, None)] == pytest.approx(
        max(float(seen[n].abs().max()) for n in seen if n.startswith("layers.1.")), rel=1e-12)


# -- optimizer steps, observe_gradients --------------------------------------------------------

def test_steps_without_optimizer_step_and_without_optimizer():
    def some_steps(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
    fast, _ = _compare(Net, ALL, some_steps)
    assert [f for f, _ in fast[-1][1]] == ["layer-update-ratio"] * 2
    fast, _ = _compare(Net, PARAMS_ONLY, lambda m, o, t, s: _loss(m, s).backward(), optimizer=None)


def test_observe_gradients_twice_before_clipping_and_before_backward():
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
    fast, _ = _compare(Net, ALL, early)
    # Each call before optimizer.step() reads again (2 per step, 3 at step 3); after it, none.
    assert fast[2][0][("layer-grad-l2", 1, None, None, None)] > 0.01  # the call before backward is superseded
    assert fast[1][0][("layer-grad-l2", 1, None, None, None)] > 0.01  # read before clipping


def test_two_optimizer_steps_in_one_scope():
    def twice(model, optimizer, metrics, step):
        _loss(model, step).backward()
        optimizer.step()
        optimizer.step()
        optimizer.zero_grad()
    fast, _ = _compare(Net, ALL, twice, steps=3)
    failures = fast[-1][1]  # every step's (kept across steps): the update read after the first step only
    assert [name for name, _ in failures] == ["layer-update-ratio"] * 3
    assert all("optimizer.step() ran again inside the scope of step" in text for _, text in failures)


def test_scope_and_optimizer_hook_raising():
    def raising(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step == 2:
            raise Expected()
        optimizer.step()
        if step == 3:
            raise Expected()  # after the post phase consumed the snapshot
        optimizer.zero_grad()
    fast, _ = _compare(Net, ALL, raising, steps=5)
    assert _records(fast) == [45, -1, -1, 45, 45]

    def failing_hook(model: Net) -> torch.optim.Optimizer:
        optimizer = _adamw(model)
        optimizer.register_step_post_hook(lambda *_: (_ for _ in ()).throw(Expected()) if failing_hook.step == 2
                                          else None)
        return optimizer

    def body(model, optimizer, metrics, step):
        failing_hook.step = step
        _plain(model, optimizer, metrics, step)
    fast, _ = _compare(Net, ALL, body, optimizer=failing_hook)
    assert _records(fast) == [45, -1, 45, 45]


# -- tensors the kernel refuses, replaced or resized ------------------------------------------

def test_non_contiguous_parameter():
    def transposed() -> Net:
        model = Net()
        weight = model.layers[1].fc.weight
        model.layers[1].fc.weight = torch.nn.Parameter(weight.detach().t().contiguous().t())
        assert not model.layers[1].fc.weight.is_contiguous()
        return model
    _compare(transposed, ALL, _plain)


def test_non_contiguous_gradient_on_one_step():
    def body(model, optimizer, metrics, step):
        _loss(model, step).backward()
        if step == 2:
            weight = model.layers[1].fc.weight
            weight.grad = weight.grad.t().contiguous().t()
        optimizer.step()
        optimizer.zero_grad()
    _compare(Net, ALL, body, steps=3)


class _Sgd(torch.optim.Optimizer):
    """Plain SGD (lr 0.1) on ``params`` that then calls :meth:`after` inside its own ``step`` (so
    torch's step hooks run around all of it), counting its steps."""

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
        self.after()

    def after(self) -> None:
        raise NotImplementedError


class _Transposing(_Sgd):
    """SGD that leaves ``target`` non-contiguous after its step on the steps in ``when``."""

    def __init__(self, params, target: torch.nn.Parameter, when: set[int]) -> None:
        super().__init__(params, target)
        self.when = when

    def after(self) -> None:
        data = self.target.data
        self.target.data = data.t().contiguous().t() if self.count in self.when else data.contiguous()


def test_parameter_made_non_contiguous_by_the_optimizer():
    """The parameter strided after step 2's optimizer step and non-contiguous before step 3's:
    the program reads it with torch ops in every phase (no layout is refused)."""
    _compare(Net, ALL, _plain, optimizer=lambda m: _Transposing(m.parameters(), m.layers[0].fc.weight, {2}))


class _Resizing(_Sgd):
    """SGD that enlarges ``target`` inside its second step."""

    def after(self) -> None:
        if self.count == 2:
            self.target.data = torch.zeros(self.target.shape[0] + 1, *self.target.shape[1:])


class _SlicingNet(Net):
    """Reads only the first WIDTH rows of each block's weight (so a grown weight still fits)."""

    def forward(self, tokens, skip=()):
        h = self.embed(tokens)
        for block in self.layers:
            h = h + torch.tanh(torch.nn.functional.linear(block.norm(h), block.fc.weight[:WIDTH], block.fc.bias))
        return self.head(h)


def test_parameter_resized_by_the_optimizer():
    fast, _ = _compare(_SlicingNet, ALL, _plain,
                       optimizer=lambda m: _Resizing(m.parameters(), m.layers[1].fc.weight))
    assert [f for f, _ in fast[-1][1]] == ["layer-update-ratio"]
    assert "reading the post-step tensors failed" in fast[-1][1][0][1]


def test_parameters_replaced_between_steps():
    def body(model, optimizer, metrics, step):
        if step == 2:
            model.layers[2].fc.bias.data = torch.randn(WIDTH, generator=torch.Generator().manual_seed(5))
        if step == 3:
            model.head.weight.data = model.head.weight.data.to(torch.bfloat16)
        _plain(model, optimizer, metrics, step)
    _compare(Net, ALL, body, optimizer=_sgd)


def test_bfloat16_and_mixed_dtypes():
    def mixed() -> Net:
        model = Net()
        model.layers[0].to(torch.bfloat16)
        return model
    for make in (mixed, lambda: Net().to(torch.bfloat16)):
        _compare(make, ALL, _plain, steps=3)


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
def test_every_moments_statistic_on_nan_infinities_negative_zero_empty_and_large(dtype):
    fast, _ = _compare(lambda: _WithExtras().to(dtype), EVERYTHING, _poison, optimizer=_sgd)
    # The empty parameter gets no gradient: a placeholder for it.
    values = fast[1][0]
    assert math.isnan(values[("e-param", 0, None, "layers.0.fc.weight", "sumsq")])
    assert values[("e-param", 0, None, "layers.0.fc.weight", "absmax")] == 10.0  # neutral 0 + NaN flag
    assert values[("e-param", 2, None, "layers.2.fc.bias", "absmax")] == math.inf
    assert values[("e-param", 1, None, "layers.1.empty", "count")] == 0.0
    assert values[("e-param", 1, None, "layers.1.fc.weight", "zeros")] == WIDTH * WIDTH


# -- other metric shapes ---------------------------------------------------------------------

def test_metrics_of_several_kinds_and_of_updates_alone():
    spec = [(lambda: L2Norm(name="layer-paramgrad-l2", source_kinds=["param", "grad"], scope="layer"), 1),
            (lambda: L2Norm(name="layer-update-l2", source_kinds=["update"], scope="layer", select="layers.[01].*"), 1),
            (lambda: AbsMax(name="tensor-update-absmax", source_kinds=["update"], scope="tensor",
                            select="layers.1.*"), 2),
            (lambda: Rms(name="family-update-rms", source_kinds=["update", "param"], scope="family"), 3),
            (lambda: AbsMax(name="global-param-absmax", source_kinds=["param"], select="layers.0.*"), 1),
            (_metric("layer-update-ratio", "layers.2.*"), 2)]
    fast, _ = _compare(Net, spec, _plain, steps=6)
    assert _records(fast) == [17, 11, 12, 11, 6, 17]


def test_two_tensor_metrics_on_one_model():
    model = Net()
    optimizer = _adamw(model)
    a = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1),
                                      (build_metric("layer-param-l2"), 2)], optimizer=optimizer)
    b = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio", select="layers.1.*"), 2),
                                      (build_metric("layer-grad-l2"), 1), (build_metric("layer-param-l2"), 1)],
                      optimizer=optimizer)
    captures = [Capture(a, optimizer), Capture(b, optimizer)]
    counts = []
    for step in range(1, 5):
        for capture in captures:
            capture.begin()
        with a.step(step), b.step(step):
            _loss(model, step).backward()
            if step == 2:
                b.observe_gradients()
            optimizer.step()
            optimizer.zero_grad()
            for capture in captures:
                capture.end()
        for metrics, capture in zip((a, b), captures):
            records = {(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records}
            assert assert_matches(records, capture, set(), rel=1e-6, where=f"step {step}") == len(records)
        counts.append(len(a.last_records) + len(b.last_records))
    assert a.failures == [] and b.failures == []
    assert counts == [13, 13, 9, 13]
    a.close()
    b.close()


# -- float64 references ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_ratio_and_snapshot_reads_against_float64(dtype):
    """The update ratio equals ||p_after - p_before|| / ||p_after|| per layer and
    layer-param-l2 (read from the snapshot, one rows pass with the updates) ||p_before||, in
    float64."""
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
        assert len(program) == 1 and len(program[0].post.plan.recipes) == 2 and not program[0].pre.metrics
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


def train_data_parallel(rank: int, world: int) -> tuple[list[int], list, list[dict], int]:
    """Three steps of the demo model under DDP on ``dp``; on rank 1 at step 2 one gradient is
    made non-contiguous (same values). Every record is checked against the float64 reference of
    this rank's tensors (replicated: the global tensors); returns the record counts, the failures,
    the records and how many were checked."""
    from tmetrics_core.topology import Topology
    from tmetrics_core.demo.model import ModelConfig
    from tmetrics_core.demo.parallel import parallelize
    from tmetrics_core.demo.degrees import ParallelDegrees as DemoTopology

    torch.manual_seed(0)
    config = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=12, n_experts=4, top_k=2, dense_layers=(1,),
                         seq_len=16)
    parallel = parallelize(config, DemoTopology(dp=world), seed=3, batch_size=8)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-2)
    metrics = TensorMetrics(parallel.model, metrics=[(build_metric(n), i) for n, i in DP_METRICS.items()],
                            optimizer=optimizer, timeout_s=30,
                            topology=Topology.from_mesh(parallel.mesh) if parallel.mesh is not None else None)
    capture = Capture(metrics, optimizer)
    out, counts, checked = [], [], 0
    for step in range(1, 4):
        batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(step))
        capture.begin()
        with metrics.step(step):
            parallel.forward_backward(batch)
            if rank == 1 and step == 2:
                p = next(p for p in parallel.model.parameters() if p.dim() == 2 and p.grad is not None)
                p.grad = p.grad.t().contiguous().t()
            optimizer.step()
            optimizer.zero_grad()
            capture.end()
        records = {(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records}
        checked += assert_matches(records, capture, set(), rel=1e-6, where=f"rank {rank} step {step}")
        counts.append(len(records))
        out.append(records)
    failures = [(f.metric, f.error) for f in metrics.failures]
    metrics.close()
    return counts, failures, out, checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_data_parallel_with_one_rank_reading_a_non_contiguous_gradient(world):
    ranks = run_distributed(train_data_parallel, world, timeout=90, collective_timeout=30)
    for counts, failures, _, checked in ranks:
        assert failures == [] and counts == [42, 41, 40] and checked == sum(counts)
    # replicated: the ranks agree but at step 2, where rank 1 read one gradient non-contiguous
    # (summed in another order)
    assert all(records[0] == ranks[0][2][0] and records[2] == ranks[0][2][2] for _, _, records, _ in ranks)


# -- metrics that prepare themselves, or raise -------------------------------------------------

class _BrokenKept(L2Norm):
    """A metric whose ``kept`` raises: a metric error, reported."""

    def kept(self, sites):
        raise RuntimeError("kept is broken")


def test_a_kept_that_raises_is_reported_not_raised_from_optimizer_step():
    """Planning a due set calls ``kept``; one that raises leaves the metric to its own
    ``prepare`` (under ``prepare_states``' per-metric error handling), which reports it: the
    error never escapes the optimizer's pre-hook, and the other metrics are checked."""
    spec = [(lambda: _BrokenKept(name="bad-grad-l2", source_kinds=["grad"], scope="layer"), 1),
            (_metric("layer-param-l2"), 1)]
    run, checked = _compare(Net, spec, _plain, steps=2)
    assert run[-1][1] == [("bad-grad-l2", "RuntimeError: kept is broken")] * 2
    assert _records(run) == [3, 3] and checked == 6


class _MeanSquare(Statistic):
    """Per tensor ``sum x**2 / numel`` from the rows and the tensor's shape; reads no element
    (``elements`` False), so a same-shaped stand-in serves."""

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


def test_a_moments_statistic_reading_shapes_gets_its_tensors():
    """``Statistic.compute(tensors, sites, topology, rows)`` documents one row per tensor: the
    rows pass hands it the tensors its rows were read from (gradients before the step, updates
    after it), so the peak of ``sum x**2 / numel`` per layer is that of the tensors."""
    spec = [(lambda: _PeakMeanSquare(name="layer-grad-peak-ms", source_kinds=["grad"], scope="layer"), 1),
            (lambda: _PeakMeanSquare(name="layer-update-peak-ms", source_kinds=["update"], scope="layer"), 1)]
    model = Net()
    optimizer = _adamw(model)
    metrics = TensorMetrics(model, metrics=[(build(), i) for build, i in spec], optimizer=optimizer)
    capture = Capture(metrics, optimizer)
    for step in (1, 2):
        capture.begin()
        with metrics.step(step):
            _plain(model, optimizer, metrics, step)
            capture.end()
        values = {(r.metric, r.layer): r.value for r in metrics.last_records}
        assert metrics.failures == [] and len(values) == 6
        for layer in range(3):
            for name, kind in (("layer-grad-peak-ms", "grad"), ("layer-update-peak-ms", "update")):
                tensors = capture.tensors(kind, kind == "update")
                want = max(float(t.square().sum()) / t.numel() for n, t in tensors.items()
                           if n.startswith(f"layers.{layer}.") and t is not None)
                assert values[(name, layer)] == pytest.approx(want, rel=1e-9), (step, name, layer)
    metrics.close()


def test_histograms_and_adam_state_beside_the_moments_metrics():
    """Histograms prepare themselves on the same slots as the moments metrics (one read per
    source and phase); Adam's exp_avg and exp_avg_sq are read after the step in the update's
    rows pass (the state does not exist before the first step: placeholders). Every moments
    record matches the float64 reference."""
    spec = ALL + [(_metric(n), 1) for n in ("layer-param-histogram", "layer-grad-histogram",
                                            "layer-optimizer-state-rms")]
    run, checked = _compare(Net, spec, _plain)
    assert {key[0] for key in run[-1][0]} >= {"layer-param-histogram", "layer-optimizer-state-rms", "layer-grad-l2"}
    assert run[0][0][("layer-optimizer-state-rms", 0, None, None, "exp_avg")] > 0
    model = Net()
    metrics = TensorMetrics(model, metrics=[(build(), i) for build, i in spec], optimizer=_adamw(model))
    with metrics.step(1):
        _loss(model, 1).backward()
    program = next(iter(metrics.params._plans.values())).program
    prepared = {m.name for phase in (program.pre, program.post) for _, ms in phase.others for m in ms}
    assert prepared == {"layer-param-histogram", "layer-grad-histogram"}
    metrics.close()


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
    update_l2 = L2Norm(name="layer-update-l2", source_kinds=["update"], scope="layer", select=["layers.0.*", "layers.2.*"])
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("layer-grad-l2", "layer-update-ratio")]
                            + [(update_l2, 1)], optimizer=optimizer)
    for step in (1, 2):
        with metrics.step(step):
            _plain(model, optimizer, metrics, step)
    program = next(iter(metrics.params._plans.values())).program
    assert program.pre.plan._fills
    fills = {key: [id(at) for _, at in value] for key, value in program.pre.plan._fills.items()}
    with metrics.step(3):
        _plain(model, optimizer, metrics, 3)
    assert {key: [id(at) for _, at in value] for key, value in program.pre.plan._fills.items()} == fills
    plan = program.post.plan
    assert any(type(r.index) is not slice for r in plan.recipes)  # layers 0 and 2's update rows: an index
    rows = torch.zeros(len(program.post.rows_at), 5, device="meta")
    for _ in range(2):
        with _Devices() as seen:
            plan.states(rows, lambda r: torch.zeros(WIDTH, device="meta"))
        assert seen.seen and all(on == "meta" for _, _, on in seen.seen)
    assert {device.type for _, device in plan._on_device} == {"meta"}
    metrics.close()
