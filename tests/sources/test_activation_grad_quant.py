"""``layer-activation-grad-quant`` reads the ``activation_grad`` sites of the backward family:
on one rank with one micro-batch, each recipe's statistics equal the float64 reference of the
same recipe over the module's output cotangent taken by autograd (E5M2 for fp8-tensorwise, the
gradient format)."""
from __future__ import annotations

import math

import torch

from tests.backward_model import L, Net, batch, loss_of
from tests.metrics.test_quant import reference_values
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

RECIPES = ("fp8-tensorwise", "mxfp8")


def _cotangents() -> list[torch.Tensor]:
    """Each block's mlp output cotangent of the mean loss, float32 as the model runs."""
    model = Net()
    grads: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.layers):
        block.mlp.register_full_backward_hook(lambda m, gi, go, i=i: grads.__setitem__(i, go[0].detach()))
    tokens, targets = batch(1)
    loss_of(model(tokens), targets).backward()
    return [grads[i] for i in range(L)]


def test_activation_grad_quant_equals_reference():
    model = Net()
    metric = build_metric("layer-activation-grad-quant", modules=["layers.*.mlp"], recipe=list(RECIPES))
    tm = TensorMetrics(model, metrics=[(metric, 1)])
    tokens, targets = batch(1)
    with tm.step(1):
        loss_of(model(tokens), targets).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    got = {(r.labels.layer, r.labels.stat): r.value for r in tm.last_records
           if r.metric == "layer-activation-grad-quant"}
    tm.close()
    assert {layer for layer, _ in got} == set(range(L))
    for layer, g in enumerate(_cotangents()):
        for recipe in RECIPES:
            for stat, want in reference_values(recipe, "activation_grad", [g]).items():
                value = got[(layer, f"{recipe}.{stat}")]
                if math.isnan(want):
                    assert math.isnan(value), (layer, recipe, stat)
                else:
                    assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-12), (layer, recipe, stat, value, want)
