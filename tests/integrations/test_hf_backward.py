"""Cotangent metrics on a tiny Hugging Face Llama with ``gradient_checkpointing_enable()``
(reentrant and not): the decoder layers are found as the blocks with no user code, and every
micro-batch's cotangents (and the forward's residual stream) are observed once despite the
recomputation: values equal float64 autograd of the same batch without checkpointing."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.integrations.tiny import LAYERS, token_rows, tiny_llama
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

NAMES = ("layer-residual-grad-l2", "layer-backward-gain", "layer-residual-accumulator-l2", "output-logits-grad-l2")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = token_rows(4)
    return torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])


def _reference(model: torch.nn.Module) -> dict[tuple[str, int | None], float]:
    model = copy.deepcopy(model).double()
    outs, ins = {}, {}

    def keep(i):
        def hook(m, args, kwargs, out):
            h = out[0] if isinstance(out, tuple) else out
            x = args[0] if args else kwargs["hidden_states"]
            h.retain_grad()
            x.retain_grad()
            outs[i], ins[i] = h, x
        return hook
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(keep(i), with_kwargs=True)
    ids, labels = _batch()
    result = model(input_ids=ids, labels=labels)
    result.logits.retain_grad()
    result.loss.backward()
    out = {("output-logits-grad-l2", None): result.logits.grad.norm().item()}
    for i in range(LAYERS):
        g, gi = outs[i].grad, ins[i].grad
        out[("layer-residual-grad-l2", i)] = g.norm().item()
        out[("layer-backward-gain", i)] = gi.square().mean().sqrt().item() / g.square().mean().sqrt().item()
        out[("layer-residual-accumulator-l2", i)] = outs[i].norm().item()
    return out


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_observes_each_cotangent_once(reentrant: bool) -> None:
    model = tiny_llama()
    want = _reference(model)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    tm = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES])
    ids, labels = _batch()
    with tm.step(1):
        for k in range(2):  # two micro-batches of two sequences
            (model(input_ids=ids[2 * k:2 * k + 2], labels=labels[2 * k:2 * k + 2]).loss / 2).backward()
    got = {(r.metric, r.layer): r.value for r in tm.last_records}
    tm.close()
    assert set(got) == set(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-5), (key, got[key], value)
