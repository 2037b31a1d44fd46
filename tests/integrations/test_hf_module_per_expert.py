"""One module per expert, the transformers 4.x style, on the one MoE of transformers 5 that keeps it:
the encoder of Switch Transformers (``experts.expert_{e}`` MLPs, a top-1 router). With no user
hooks, tokens per expert equal the counts of the router's own dispatch mask, the decision entropy
equals that of the softmax of its own logits, and per-expert gradient and parameter L2 equal float64
hand norms of each expert's own weights. A router that drops tokens over an expert's capacity
fails the router metrics with that reason instead of counting other than its choice."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

transformers = pytest.importorskip("transformers")

EXPERTS, VOCAB = 4, 64
NAMES = ("layer-expert-tokens", "layer-router-decision-entropy", "expert-grad-l2", "expert-param-l2")


def _model(capacity: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=16, num_layers=2, num_heads=2, num_experts=EXPERTS,
        expert_capacity=capacity, encoder_sparse_step=1, router_jitter_noise=0.0)
    model = transformers.SwitchTransformersEncoderModel(config)
    with torch.no_grad():  # spread the routing over every expert
        for layer in _layers(model).values():
            layer.router.classifier.weight.normal_(0.0, 1.0)
    return model


def _layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer -> its sparse MLP (router and ``experts.expert_{e}``)."""
    return {i: block.layer[1].mlp for i, block in enumerate(model.encoder.block)}


def _run(model: torch.nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], optimizer=optimizer)
    assert metrics.manifest.num_experts == EXPERTS
    seen: dict[int, list] = {}
    hooks = [mlp.router.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out))
             for i, mlp in _layers(model).items()]
    for step in (1, 2):
        seen.clear()
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        with metrics.step(step):
            model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
            grads = {(i, e): [p.grad.double().clone() for p in mlp.experts[f"expert_{e}"].parameters()]
                     for i, mlp in _layers(model).items() for e in range(EXPERTS)}
            params = {(i, e): [p.detach().double().clone() for p in mlp.experts[f"expert_{e}"].parameters()]
                      for i, mlp in _layers(model).items() for e in range(EXPERTS)}
            optimizer.step()
            optimizer.zero_grad()
    for h in hooks:
        h.remove()
    records = {(r.metric, r.layer, r.expert): r.value for r in metrics.last_records}
    failures = list(metrics.failures)
    metrics.close()
    return records, failures, seen, grads, params


def test_tokens_entropy_and_expert_norms_of_module_per_expert_layers() -> None:
    records, failures, seen, grads, params = _run(_model(capacity=64))
    assert not failures and sorted(seen) == [0, 1]
    for layer, outs in seen.items():
        mask = torch.cat([o[0].reshape(-1, EXPERTS) for o in outs])
        assert bool((mask.sum(dim=1) == 1).all())  # no token dropped at this capacity
        assert list(records[("layer-expert-tokens", layer, None)]) == mask.sum(dim=0).tolist()
        assert sum(1 for c in mask.sum(dim=0).tolist() if c > 0) > 1  # a routing, not one expert
        p = torch.softmax(torch.cat([o[2].detach().reshape(-1, EXPERTS) for o in outs]).double(), dim=-1)
        entropy = float((-(p * p.log()).sum(dim=-1) / math.log(EXPERTS)).mean())
        assert math.isclose(records[("layer-router-decision-entropy", layer, None)], entropy, rel_tol=1e-6)
    for (layer, e), gs in grads.items():
        want = math.sqrt(sum(float(g.pow(2).sum()) for g in gs))
        assert want > 0 or list(records[("layer-expert-tokens", layer, None)])[e] == 0
        assert math.isclose(records[("expert-grad-l2", layer, e)], want, rel_tol=1e-6), (layer, e)
        want = math.sqrt(sum(float(p.pow(2).sum()) for p in params[(layer, e)]))
        assert math.isclose(records[("expert-param-l2", layer, e)], want, rel_tol=1e-6), (layer, e)


def test_tokens_dropped_over_capacity_fail_the_router_metrics_with_the_reason() -> None:
    records, failures, seen, _, _ = _run(_model(capacity=2))
    assert any(not bool((o[0].sum(dim=-1) == 1).all()) for outs in seen.values() for o in outs)
    reasons = {f.metric: f.error for f in failures}
    assert set(reasons) == {"layer-expert-tokens", "layer-router-decision-entropy"}
    assert all("dropped tokens over an expert's capacity" in r for r in reasons.values())
    assert ("expert-grad-l2", 0, 0) in records  # parameter metrics go on


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``item()``, ``bool()``: one
    ``_local_scalar_dense`` each, a synchronisation on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_dispatch_mask_check_reads_nothing_back_in_the_forward() -> None:
    """The dropped-token check is a device flag decided at the step's end: after the first step
    (which verifies each router's score function once), the forward with the router metrics due
    makes as many host reads as the model's own forward."""
    model = _model(capacity=64)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    bare = _HostReads()
    with bare, torch.no_grad():
        model(input_ids=ids)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES[:2]])
    counted = _HostReads()
    for step in (1, 2):
        with metrics.step(step):
            with counted if step == 2 else torch.no_grad(), torch.no_grad():
                model(input_ids=ids)
    assert not metrics.failures and counted.reads == bare.reads
    records = {(r.metric, r.layer): r.value for r in metrics.last_records}
    assert sum(records[("layer-expert-tokens", 0)]) == 2 * 12
    metrics.close()


@pytest.mark.parametrize("capacity", [2, 64])
def test_the_dropped_token_checks_ride_in_the_step_ends_one_host_copy(monkeypatch, capacity: int) -> None:
    """The step's end reads the device checks with the results in one host copy (on one
    process no collective needs them first), whether tokens were dropped (the router metrics
    fail with the reason, the others are logged) or not."""
    model = _model(capacity=capacity)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES])
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with metrics.step(1):  # the first step also verifies each router's score function once
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
    copies: list[int] = []
    finish, tolist = TensorMetrics._finish_step, torch.Tensor.tolist

    def counted(self, *args):
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.numel()) or tolist(t))
        try:
            return finish(self, *args)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    monkeypatch.setattr(TensorMetrics, "_finish_step", counted)
    metrics.failures.clear()
    with metrics.step(2):
        model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
    assert len(copies) == 1
    failed = {f.metric: f.error for f in metrics.failures}
    logged = {r.metric for r in metrics.last_records}
    if capacity == 2:
        assert set(failed) == {"layer-expert-tokens", "layer-router-decision-entropy"}
        assert all("dropped tokens over an expert's capacity" in reason for reason in failed.values())
        assert logged == {"expert-grad-l2", "expert-param-l2"}
    else:
        assert not failed and logged == set(NAMES)
    metrics.close()
