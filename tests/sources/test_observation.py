"""Observation: no raw activation outlives its observation, checkpoint recomputation is not
observed twice, hooks stay installed and idle steps observe nothing, two metrics objects on one
model do not feed each other, the token mask removes padding, and residual metrics equal those
of the full tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tmetrics_core.metrics.norms import L2Norm, NonFinite, Rms
from tmetrics_core.observe import observe
from tmetrics_core.observer import _ACTIVE
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


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "torch.compile"])
def test_a_wrapped_block_is_one_block_observed_once(wrap):
    """A block wrapped in place (torch's checkpoint_wrapper, as torchtitan's activation
    checkpointing does; torch.compile per block) and the module inside it share one path: one
    block is hooked, and a ``modules:`` glob hooks one module, so L2 norms and token counts are
    those of the unwrapped model (hooking both gave every residual twice: L2 x sqrt(2))."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tmetrics_core.metrics.catalogue import build_metric

    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    names = ("layer-residual-accumulator-l2", "layer-residual-contribution-l2")
    activation = L2Norm(name="layer-activation-l2", source_kinds=["activation"], scope="layer")
    values = {}
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = Tiny()
        if wrapped:
            for i, block in enumerate(model.layers):
                model.layers[i] = (checkpoint_wrapper(block) if wrap == "checkpoint_wrapper"
                                   else torch.compile(block, backend="eager"))
        metrics = TensorMetrics(model, metrics=[*((build_metric(n), 1) for n in names), (activation, 1)],
                                modules={"layer-activation-l2": ("layers.?",)})
        assert [p for p, _, _ in metrics.index.blocks] == ["layers.0", "layers.1"]
        with metrics.step(1):
            model(x.clone().requires_grad_(True)).sum().backward()
        values[wrapped] = {(r.metric, r.layer): r.value for r in metrics.last_records}
        metrics.close()
    assert values[True] == pytest.approx(values[False], rel=1e-6)
    torch.manual_seed(0)
    weight = Tiny().layers[0].mlp["up"].weight.detach().double()
    h0 = x.double() + x.double() @ weight.t()
    assert len(values[False]) == 6
    assert values[True][("layer-residual-accumulator-l2", 0)] == pytest.approx(h0.norm().item(), rel=1e-6)
    assert values[True][("layer-activation-l2", 0)] == pytest.approx(h0.norm().item(), rel=1e-6)
    assert values[True][("layer-residual-contribution-l2", 0)] == pytest.approx((h0 - x.double()).norm().item(),
                                                                              rel=1e-6)


def test_idle_steps_observe_nothing_and_keep_the_hooks():
    """Hooks are installed once (a compiled model would recompile on each hook added or
    removed); on an idle step there is no observer, so nothing is read."""
    model = Tiny()
    metrics = _metrics(model, interval=10)
    hooks = [dict(b._forward_hooks) for b in model.layers]
    assert all(hooks)
    with metrics.step(1):  # the first step is always due
        assert _ACTIVE.get() is not None
        model(torch.randn(2, 2, 4))
    with metrics.step(2):
        assert _ACTIVE.get() is None
        model(torch.randn(2, 2, 4))
    assert [dict(b._forward_hooks) for b in model.layers] == hooks
    assert metrics.last_records and all(r.step == 1 for r in metrics.last_records)
    metrics.close()
    assert not any(b._forward_hooks for b in model.layers)


def test_two_metrics_objects_on_one_model_each_take_only_their_own_hooks_calls():
    """Hooks stay installed: during one object's step the other's hooks must not feed it too."""
    model = Tiny()
    x = torch.randn(3, 5, 4)
    alone = _metrics(model)
    with alone.step(1):
        model(x)
    want = {(r.metric, r.layer): r.value for r in alone.last_records}
    alone.close()
    first, second = _metrics(model), _metrics(model)
    for metrics in (first, second):
        with metrics.step(1):
            model(x)
        assert {(r.metric, r.layer): r.value for r in metrics.last_records} == want
    first.close()
    second.close()


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


class _ValueDependent(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops whose output depends on tensor values on the host: a host sync each on
    an accelerator (``nonzero``, a boolean index, ``item()``/``bool()``)."""

    SYNCING = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.masked_select.default}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING or (func is torch.ops.aten.index.Tensor
                                    and any(i is not None and i.dtype == torch.bool for i in args[1])):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padded", [False, True], ids=["all-tokens", "padded"])
def test_the_token_mask_syncs_once_per_micro_batch_not_per_observation(padded: bool) -> None:
    """The kept rows are found once per mask (one ``nonzero``: a host sync where the mask is on
    an accelerator) and taken from every observation with ``index_select``; the values are
    those of the boolean-indexed tensors."""
    model = Tiny()
    metrics = TensorMetrics(model, metrics=[
        (L2Norm(name="probe-l2", source_kinds=["activation"]), 1),
        (Rms(name="layer-residual-accumulator-rms", source_kinds=["residual_accumulator"], scope="layer"), 1)])
    torch.manual_seed(3)
    xs = [torch.randn(2, 3, 4), torch.randn(3, 3, 4)]
    masks = [torch.rand(2, 3) > 0.4, torch.rand(3, 3) > 0.4] if padded else [torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)]
    with torch.no_grad():
        for step in (1, 2):  # the second due step follows the routes of the first
            counter = _ValueDependent()
            with metrics.step(step), counter:
                for x, mask in zip(xs, masks):
                    observe(model, "token_mask", mask, kind="token_mask")
                    model(x)
            assert counter.calls == ["aten.nonzero.default"] * 2
    with torch.no_grad():
        probes = torch.cat([model.layers[1](model.layers[0](x))[m] for x, m in zip(xs, masks)])
    got = {r.metric: r.value for r in metrics.last_records if r.metric == "probe-l2"}
    assert got["probe-l2"] == pytest.approx(probes.norm().item(), rel=1e-6)
    metrics.close()


@pytest.mark.parametrize("padded", [False, True], ids=["all-tokens", "padded"])
def test_residual_metrics_equal_the_full_tensors_over_micro_batches(padded: bool) -> None:
    """Stream and contribution against the same norms of the concatenated full tensors."""
    model = Tiny()
    metrics = _metrics(model)
    torch.manual_seed(5)
    xs = [torch.randn(3, 5, 4), torch.randn(2, 5, 4)]
    masks = [torch.rand(3, 5) > 0.3, torch.rand(2, 5) > 0.3] if padded else [None, None]
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            if mask is not None:
                observe(model, "token_mask", mask, kind="token_mask")
            model(x).sum().backward()
    streams: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    contributions = []
    with torch.no_grad():
        for x, mask in zip(xs, masks):
            h = x
            for i, block in enumerate(model.layers):
                out = block(h)
                rows = (lambda t: t[mask]) if mask is not None else (lambda t: t.reshape(-1, 4))
                streams[i].append(rows(out))
                contributions.append(rows(out - h))
                h = out
    got = {(r.metric, r.layer): r.value for r in metrics.last_records}
    for i, parts in streams.items():
        want = torch.cat(parts).double().pow(2).mean().sqrt().item()
        assert got[("layer-residual-accumulator-rms", i)] == pytest.approx(want, rel=1e-6)
    want = torch.cat(contributions).double().norm().item()
    assert got[("global-residual-contribution-l2", None)] == pytest.approx(want, rel=1e-6)


def test_a_metric_that_counts_non_finite_values_reads_the_observation_itself() -> None:
    """Exact NaN counts need the elements: the observation itself is read."""
    model = Tiny()
    metrics = TensorMetrics(model, metrics=[
        (NonFinite(name="global-residual-contribution-nonfinite", source_kinds=["residual_contribution"]), 1),
        (Rms(name="layer-residual-contribution-rms", source_kinds=["residual_contribution"], scope="layer"), 1)])
    with torch.no_grad():
        model.layers[1].mlp["up"].weight[2, 0] = float("nan")
    x = torch.randn(3, 5, 4)
    with metrics.step(1):
        model(x)
    got = {(r.metric, r.stat): r.value for r in metrics.last_records}
    assert got[("global-residual-contribution-nonfinite", "nan")] == 15  # output column 2 of layer 1
    assert got[("global-residual-contribution-nonfinite", "total")] == 15
