"""Deferred token observation (router outputs kept to the step's end) against formulas on the
full tensors each observation saw: micro-batches with and without padding, checkpointing, bf16,
awkward block outputs, empty batches, forward-only steps, select/modules patterns, interval mixes
with changing sequence lengths, families reading different sites of a layer, and a model that
changes an observed router tensor in place."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.deferred_model import D, Model, Observed, replay, row_entropy, token_rows
from tmetrics_core.topology import Topology
from tmetrics_core.metrics.preparation import SiteChoices, prepare_states
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.observe import observe
from tmetrics_core.site import Site
from tmetrics_core.tensor_metrics import TensorMetrics

ROUTER = ["layer-expert-tokens", "layer-expert-load-imbalance", "layer-dead-experts", "layer-router-decision-entropy",
          "layer-router-z-loss", "layer-router-logits-l2", "layer-router-logits-max"]
RESIDUAL = ["layer-residual-accumulator-rms", "layer-residual-accumulator-l2", "layer-residual-contribution-l2",
            "layer-residual-contribution-rms"]
FAMILIES = ["layer-router-health", "layer-router-routing-balance", "layer-router-seq-aux-decomposition"]


def _records(metrics: TensorMetrics) -> dict[tuple, object]:
    return {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}


def _batches(sizes: list[tuple[int, int]], padding: list[bool], seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, t, D, generator=g).to(dtype) for b, t in sizes]
    masks = [(torch.rand(b, t, generator=g) > 0.4) if pad else None for (b, t), pad in zip(sizes, padding)]
    return xs, masks


def _expected(seen: Observed, layer: int, experts: int = 4) -> dict[tuple, float | tuple]:
    """The router and residual metrics of ``layer`` from the full tensors (float64)."""
    logits, topk = seen.cat(seen.logits, layer), seen.cat(seen.topk, layer)
    stream, contribution = seen.cat(seen.stream, layer), seen.cat(seen.contribution, layer)
    counts = torch.bincount(topk.reshape(-1), minlength=experts).double()
    mean = counts.mean()
    return {
        ("layer-expert-tokens", layer, None): tuple(counts.tolist()),
        ("layer-expert-load-imbalance", layer, "max-over-mean"): (counts.max() / mean).item(),
        ("layer-expert-load-imbalance", layer, "cv"): (counts.std(correction=0) / mean).item(),
        ("layer-dead-experts", layer, None): float((counts == 0).sum()),
        ("layer-router-decision-entropy", layer, None): row_entropy(logits).mean().item(),
        ("layer-router-z-loss", layer, None): logits.logsumexp(-1).pow(2).mean().item(),
        ("layer-router-logits-l2", layer, None): logits.norm().item(),
        ("layer-router-logits-max", layer, None): logits.max().item(),
        ("layer-residual-accumulator-rms", layer, None): stream.pow(2).mean().sqrt().item(),
        ("layer-residual-accumulator-l2", layer, None): stream.norm().item(),
        ("layer-residual-contribution-l2", layer, None): contribution.norm().item(),
        ("layer-residual-contribution-rms", layer, None): contribution.pow(2).mean().sqrt().item(),
    }


def _assert_expected(got: dict, seen: Observed, layers: tuple[int, ...] = (0, 1), rel: float = 1e-6) -> None:
    """Every metric in ``got`` that :func:`_expected` knows, on ``layers``."""
    present = {k[0] for k in got}
    for layer in layers:
        for key, want in _expected(seen, layer).items():
            if key[0] in present:
                assert got[key] == pytest.approx(want, rel=rel, abs=1e-12), key


def _direct_families(model: Model, seen: Observed, names: list[str]) -> dict[tuple, float]:
    """The families prepared the direct way (the catalogue's tested path), one micro-batch at a
    time on the full logits and top-k choices, states merged, then run."""
    topology = Topology.single_process()
    metrics = [build_metric(n) for n in names]
    states: dict[str, dict] = {}
    for k in range(len(seen.logits[0])):
        sites, tensors = [], []
        for layer in range(len(model.layers)):
            for kind, name, width, part in (("router_logits", "router_logits", 4, seen.logits),
                                            ("router_topk", "expert_indices", 2, seen.topk)):
                sites.append(Site(name=f"layers.{layer}.moe.{name}", kind=kind, logical_shape=(-1, width),
                                  dtype="float32", layer=layer, family=f"layers.*.moe.{name}", num_experts=4))
                tensors.append(part[layer][k].float() if kind == "router_logits" else part[layer][k])
        for metric, state, error in prepare_states(metrics, sites, tensors, topology):
            assert error is None
            states[metric.name] = state if metric.name not in states else metric.merge(states[metric.name], state)
    results, failures = Executor(topology).run([(m, states[m.name], None) for m in metrics],
                                               {s.key: s for s in sites})
    assert failures == []
    return {(n, r.layer, r.stat): r.value for n, rs in results.items() for r in rs}


def _assert_same(got: dict, want: dict, rel: float = 1e-9) -> None:
    assert want and set(want) <= set(got), set(want) - set(got)
    for key, value in want.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-12), key


@pytest.mark.parametrize("padding", [[False] * 3, [True] * 3, [True, False, True]], ids=["unpadded", "padded", "mixed"])
def test_micro_batches_over_consecutive_steps_equal_the_full_tensors(padding: list[bool]) -> None:
    """Three micro-batches per step, then two with other sequence lengths: every router and
    residual metric and the families (sharing the router sites in one step) match."""
    model = Model()
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL + FAMILIES])
    for step, (sizes, pads) in enumerate([([(2, 5), (3, 5), (1, 5)], padding), ([(2, 3), (2, 7)], padding[1:])], 1):
        xs, masks = _batches(sizes, pads, seed=step)
        with metrics.step(step):
            for x, mask in zip(xs, masks):
                model(x, mask).sum().backward()
        assert metrics.failures == []
        got = _records(metrics)
        seen = replay(model, xs, masks)
        _assert_expected(got, seen)
        _assert_same(got, _direct_families(model, seen, FAMILIES))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_layers_are_observed_once(reentrant: bool) -> None:
    """Recomputation in backward is not observed again: the kept router tensors and moments rows
    are those of the forward alone (two micro-batches, one padded)."""
    model = Model()
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL + ["layer-router-health"]])
    xs, masks = _batches([(2, 5), (1, 4)], [True, False])
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            if mask is not None:
                observe(model, "token_mask", mask, kind="token_mask")
            h = x.requires_grad_()
            for layer in model.layers:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            h.sum().backward()
    assert metrics.failures == []
    got = _records(metrics)
    seen = replay(model, xs, masks)
    _assert_expected(got, seen)
    _assert_same(got, _direct_families(model, seen, ["layer-router-health"]))


def test_bf16_model_equals_its_own_tensors_in_float64() -> None:
    """bf16 logits and residuals: statistics in float64 of the bf16 values; the contribution
    is the exact difference of the bf16 stream values (the kernel widens before subtracting)."""
    model = Model().to(torch.bfloat16)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL])
    xs, masks = _batches([(2, 5), (3, 4)], [False, False], dtype=torch.bfloat16)
    with metrics.step(1):
        for x in xs:
            model(x)
    assert metrics.failures == []
    _assert_expected(_records(metrics), replay(model, xs, masks))


def test_padded_bf16_micro_batches_differ_from_the_exact_contribution_by_bf16_rounding_only() -> None:
    """A padded micro-batch takes the immediate path (h - x written in bf16): the contribution
    is then within bf16 rounding of the exact one; every other metric is exact."""
    model = Model().to(torch.bfloat16)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL])
    xs, masks = _batches([(2, 5), (3, 4)], [True, False], dtype=torch.bfloat16)
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            model(x, mask)
    got = _records(metrics)
    seen = replay(model, xs, masks)
    for layer in range(2):
        for key, want in _expected(seen, layer).items():
            rel = 2 ** -8 if key[0].startswith("layer-residual-contribution") else 1e-6
            assert got[key] == pytest.approx(want, rel=rel), key


def test_a_router_tensor_changed_in_place_after_observation_fails_its_metrics_instead_of_lying() -> None:
    """The model scales its logits in place after observing them: metrics reading the logits
    (and the families, which read them with the choices) are reported failed on every rank
    with the reason; the training step itself runs, and the other metrics stay exact."""
    model = Model(inplace=True)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL + FAMILIES])
    xs, masks = _batches([(2, 5), (1, 5)], [False, True])
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            model(x, mask).sum().backward()
    failed = {f.metric: f.error for f in metrics.failures}
    reads_logits = {"layer-router-decision-entropy", "layer-router-z-loss", "layer-router-logits-l2",
                    "layer-router-logits-max", *FAMILIES}
    assert set(failed) == reads_logits
    assert all("router_logits (router_logits) was changed in place after it was observed" in e for e in failed.values())
    got = _records(metrics)
    assert {k[0] for k in got} == set(ROUTER + RESIDUAL) - reads_logits
    _assert_expected(got, replay(model, xs, masks))


class _Awkward(torch.nn.Module):
    """Residual blocks whose outputs are a transposed view, a slice of a wider tensor, another
    dtype than the input, or another width (no contribution then)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(D, D, bias=False)
        self.how = how

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "transposed":
            t = h.transpose(0, 1).contiguous()
            return (t + self.mlp(t)).transpose(0, 1)
        if self.how == "slice":
            return torch.cat([h + self.mlp(h), h], dim=-1)[..., :D]
        if self.how == "bf16":
            return (h.float() + self.mlp(h.float())).to(torch.bfloat16)
        return torch.cat([h.float(), self.mlp(h.float())], dim=-1)  # wider


class _AwkwardModel(torch.nn.Module):
    def __init__(self, hows: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_Awkward(h) for h in hows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_awkward_block_outputs_equal_the_full_tensors() -> None:
    hows = ["transposed", "slice", "bf16", "wide"]
    model = _AwkwardModel(hows)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in RESIDUAL])
    xs, _ = _batches([(3, 4), (2, 4)], [False, False])
    with metrics.step(1):
        for x in xs:
            model(x)
    assert metrics.failures == []
    got = _records(metrics)
    stream: dict[int, list[torch.Tensor]] = {}
    contribution: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for x in xs:
            h = x
            for i, layer in enumerate(model.layers):
                out = layer(h)
                stream.setdefault(i, []).append(token_rows(out, None).double())
                if out.shape == h.shape:
                    contribution.setdefault(i, []).append(token_rows(out.double() - h.double(), None))
                h = out
    for i in range(len(hows)):
        s = torch.cat(stream[i])
        assert got[("layer-residual-accumulator-rms", i, None)] == pytest.approx(s.pow(2).mean().sqrt().item(), rel=1e-6)
        assert got[("layer-residual-accumulator-l2", i, None)] == pytest.approx(s.norm().item(), rel=1e-6)
        if i in contribution:
            c = torch.cat(contribution[i])
            assert got[("layer-residual-contribution-l2", i, None)] == pytest.approx(c.norm().item(), rel=1e-6)
        else:
            assert ("layer-residual-contribution-l2", i, None) not in got


def test_empty_micro_batches() -> None:
    """A zero-token micro-batch adds nothing; a step with only one gives the empty values
    (no mean record, zero norms and counts) for router and residual metrics alike."""
    model = Model()
    names = ROUTER + RESIDUAL
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names])
    xs, masks = _batches([(2, 5), (0, 5)], [False, False])
    with metrics.step(1):
        for x in xs:
            model(x).sum().backward()
    assert metrics.failures == []
    _assert_expected(_records(metrics), replay(model, xs, masks))
    with metrics.step(2):
        model(xs[1])
    got = _records(metrics)
    reference = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names])
    with reference.step(2):
        model(xs[1])
    assert metrics.failures == [] and reference.failures == []
    want = _records(reference)
    assert got[("layer-residual-accumulator-l2", 0, None)] == 0.0
    assert got[("layer-expert-tokens", 0, None)] == (0.0, 0.0, 0.0, 0.0)
    assert ("layer-residual-accumulator-rms", 1, None) not in got  # no token: no mean, not a NaN
    _assert_same(got, want)


def test_a_step_without_backward_or_optimizer() -> None:
    """Only the forward runs in a due step: token metrics are exact; the update metric reports
    that the optimizer did not run."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ROUTER + RESIDUAL + ["layer-update-ratio"]],
                            optimizer=optimizer)
    xs, masks = _batches([(2, 5), (1, 5)], [True, False])
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            model(x, mask)
    assert {f.metric for f in metrics.failures} == {"layer-update-ratio"}
    _assert_expected(_records(metrics), replay(model, xs, masks))


def test_select_and_modules_patterns() -> None:
    """``select`` narrows residual and router sites to layer 1; ``modules`` picks the router's
    linear output (the logits) for layer-activation-rms; unselected sites add nothing."""
    model = Model()
    metrics = TensorMetrics(model, metrics=[
        (build_metric("layer-residual-contribution-rms", select="layers.1"), 1),
        (build_metric("layer-residual-accumulator-rms"), 1),
        (build_metric("layer-router-z-loss", select="layers.1.*"), 1),
        (build_metric("layer-expert-tokens"), 1),
        (build_metric("layer-activation-rms", modules=["layers.*.moe.router"]), 1),
    ], modules={"layer-activation-rms": ["layers.*.moe.router"]})
    xs, masks = _batches([(2, 5), (1, 5)], [False, True])
    with metrics.step(1):
        for x, mask in zip(xs, masks):
            model(x, mask)
    assert metrics.failures == []
    got = _records(metrics)
    seen = replay(model, xs, masks)
    assert {k for k in got if k[0] in ("layer-residual-contribution-rms", "layer-router-z-loss")} == {
        ("layer-residual-contribution-rms", 1, None), ("layer-router-z-loss", 1, None)}
    _assert_expected(got, seen, layers=(1,))
    _assert_expected({k: v for k, v in got.items() if k[1] == 0}, seen, layers=(0,))
    activations = {r.tensor: r.value for r in metrics.last_records if r.metric == "layer-activation-rms"}
    assert activations.keys() == {"layers.0.moe.router", "layers.1.moe.router"}
    for layer in range(2):
        want = seen.cat(seen.logits, layer).pow(2).mean().sqrt().item()
        assert activations[f"layers.{layer}.moe.router"] == pytest.approx(want, rel=1e-6)


def test_due_sets_at_intervals_one_and_two_with_changing_sequence_lengths() -> None:
    """Metrics at intervals 1 and 2 over four steps whose token counts change (new stand-in
    shapes, new due sets): each step's values are its own tensors', parameters included."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    every = ["layer-residual-accumulator-rms", "layer-expert-tokens", "layer-param-l2"]
    second = ["layer-residual-contribution-l2", "layer-router-z-loss", "layer-residual-accumulator-l2"]
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in every]
                            + [(build_metric(n), 2) for n in second]
                            + [(build_metric("layer-grad-l2", select="layers.1.*"), 2)], optimizer=optimizer)
    for step, seq in enumerate([5, 3, 7, 3], 1):
        xs, masks = _batches([(2, seq)], [step == 3], seed=step)
        params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        with metrics.step(step):
            model(xs[0], masks[0]).pow(2).sum().backward()
            grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        assert metrics.failures == []
        got = _records(metrics)
        assert {k[0] for k in got} == set(every + (second + ["layer-grad-l2"] if step % 2 == 0 or step == 1 else []))
        model_now = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # replay with the parameters of the forward
            for n, p in model.named_parameters():
                p.copy_(params[n])
            seen = replay(model, xs, masks)
            for n, p in model.named_parameters():
                p.copy_(model_now[n])
        _assert_expected(got, seen)
        for layer in range(2):
            want = math.sqrt(sum(v.pow(2).sum().item() for n, v in params.items() if n.startswith(f"layers.{layer}.")))
            assert got[("layer-param-l2", layer, None)] == pytest.approx(want, rel=1e-6)
        if ("layer-grad-l2", 1, None) in got:
            want = math.sqrt(sum(v.pow(2).sum().item() for n, v in grads.items() if n.startswith("layers.1.")))
            assert got[("layer-grad-l2", 1, None)] == pytest.approx(want, rel=1e-6)
            assert ("layer-grad-l2", 0, None) not in got


def test_families_that_read_different_sites_of_a_layer_do_not_share_its_summary() -> None:
    """One family selects the logits (softmax of them), the other reads the layer's sigmoid
    scores: in one step each equals itself alone, in either order."""
    specs = [("layer-router-seq-aux-decomposition", {"select": ["*.expert_indices", "*.router_logits"]}),
             ("layer-router-routing-balance", {})]
    xs, masks = _batches([(2, 5), (1, 5)], [False, True])

    def run(chosen):
        model = Model(scores="sigmoid")
        metrics = TensorMetrics(model, metrics=[(build_metric(n, **o), 1) for n, o in chosen])
        with metrics.step(1):
            for x, mask in zip(xs, masks):
                model(x, mask)
        assert metrics.failures == []
        return _records(metrics)

    alone = {**run(specs[:1]), **run(specs[1:])}
    scored = run([("layer-router-seq-aux-decomposition", {})])  # the scores give other values
    assert any(not math.isclose(v, alone[k], rel_tol=1e-3) for k, v in scored.items() if isinstance(v, float))
    for order in (specs, specs[::-1]):
        _assert_same(run(order), alone, rel=1e-12)


def test_site_choices_follow_the_site_objects() -> None:
    """Remembered per list of site objects: another list (even with equal sites, or after the
    cache was emptied) gets its own answer, and a metric set by name its own."""
    topology = Topology.single_process()
    metrics = [build_metric("layer-param-l2", select="layers.1.*"), build_metric("global-param-l2")]
    choices = SiteChoices()

    def sites(n: int) -> list[Site]:
        return [Site(name=f"layers.{i}.w", kind="param", logical_shape=(2,), layer=i) for i in range(n)]

    for n in [3, 1, 2, 3] + list(range(1, 12)):
        listed = sites(n)
        want = [[i for i, s in enumerate(listed) if m.accepts(s)] for m in metrics]
        assert choices.of(metrics, listed) == want
        assert choices.of(metrics[1:], listed) == want[1:]
        tensors = [torch.full((2,), float(i + 1)) for i in range(n)]
        prepared = prepare_states(metrics, listed, tensors, topology, choices=choices)
        assert [sorted(state) for _, state, _ in prepared] == [sorted(listed[i].key for i in w) for w in want]


def test_the_token_mask_leaves_an_expert_bias_as_long_as_the_micro_batch_whole() -> None:
    """An ``expert_bias`` [E] observed in a padded micro-batch of E tokens is not a token row:
    the bias statistics are those of the whole bias (it was cut to the unpadded entries)."""
    bias = torch.tensor([0.5, -1.0, 2.0, 0.25])
    model = Model()
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-router-expert-bias"), 1)])
    with metrics.step(1):
        observe(model, "token_mask", torch.tensor([[True, True, False, True]]), kind="token_mask")
        for layer in model.layers:
            observe(layer.moe, "expert_bias", bias, kind="expert_bias")
        model(torch.randn(1, 4, D, generator=torch.Generator().manual_seed(0)))
    assert metrics.failures == []
    got = _records(metrics)
    for layer in (0, 1):
        assert got[("layer-router-expert-bias", layer, "mean")] == pytest.approx(bias.mean().item())
        assert got[("layer-router-expert-bias", layer, "std")] == pytest.approx(bias.std(correction=0).item())
        assert got[("layer-router-expert-bias", layer, "range")] == pytest.approx(3.0)
