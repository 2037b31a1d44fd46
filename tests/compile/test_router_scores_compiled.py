"""``layer-router-decision-entropy`` of HF Mixtral's MoE blocks compiled (``fullgraph=True``) from
the first step: the score
function comes from the router's class (softmax here; sigmoid where it keeps a score-correction
bias, as DeepSeek-V3's) and is checked against the returned top-k weights on the device, so the
compiled run writes the eager float64 value. Before, it wrote nothing (the function was only
found from host values)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.integrations.test_hf_moe import EXPERTS, _model, _routers
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

pytest.importorskip("transformers")


def test_decision_entropy_under_compile_from_the_first_step() -> None:
    model = _model("mixtral")
    blocks = [layer.mlp for layer in model.model.layers]  # the MoE blocks, compiled alone (fast to trace)
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits: dict[int, torch.Tensor] = {}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: logits.__setitem__(i, o[0].detach().double()))
             for i, r in _routers(model).items()]
    with torch.no_grad():
        for block in blocks:
            block(hidden)  # eager reference outputs, outside tmetrics
    for h in hooks:
        h.remove()
    tm = TensorMetrics(model, metrics=[(build_metric("layer-router-decision-entropy"), 1)])
    compiled = [torch.compile(block, backend="eager", fullgraph=True) for block in blocks]
    with tm.step(1):
        with torch.no_grad():
            for block in compiled:
                block(hidden)
    got = {r.layer: r.value for r in tm.last_records}
    assert tm.failures == []
    tm.close()
    assert sorted(got) == sorted(logits)
    for layer, z in logits.items():
        p = torch.softmax(z, dim=-1)
        want = float((-(p * p.clamp_min(1e-300).log()).sum(dim=-1) / math.log(EXPERTS)).mean())
        assert got[layer] == pytest.approx(want, rel=1e-6), layer
