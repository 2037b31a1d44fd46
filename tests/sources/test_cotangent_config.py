"""Start-up errors of cotangent metrics: modules: globs that pick modules without a cotangent
(frozen, no grad path) or no module at all, and a model without blocks or head; a frozen model
part after a trainable one is fine."""
from __future__ import annotations

import pytest
import torch

from tests.backward_model import Net
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


def _start(model, name, modules=None):
    return TensorMetrics(model, metrics=[(build_metric(name, modules=modules), 1)])


def test_modules_without_a_cotangent_are_refused_with_their_names():
    model = Net()
    for p in [*model.embed.parameters(), *model.layers[0].parameters()]:
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"no cotangent: layers\.0\.mlp.*Narrow modules") as err:
        _start(model, "layer-activation-grad-rms", ["layers.*.mlp"])
    assert err.value.path == "metrics[0]"
    _start(model, "layer-activation-grad-rms", ["layers.1.mlp", "layers.2.mlp"]).close()  # after a trainable one


def test_globs_matching_nothing_and_missing_blocks_or_head_are_refused():
    with pytest.raises(ConfigError, match="match no module"):
        _start(Net(), "layer-activation-grad-rms", ["layers.*.attn"])
    bare = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="needs the model.s blocks"):
        _start(bare, "layer-backward-gain")
    with pytest.raises(ConfigError, match="needs the output head"):
        _start(bare, "output-logits-grad-l2")


def test_start_up_walks_the_model_once_for_every_cotangent_metric(monkeypatch):
    import sys

    walks = []
    original = torch.nn.Module.modules

    def modules(self):
        if sys._getframe(1).f_code.co_filename.endswith("startup_checks.py"):
            walks.append(type(self).__name__)
        return original(self)

    monkeypatch.setattr(torch.nn.Module, "modules", modules)
    metrics = TensorMetrics(Net(), metrics=[(build_metric("layer-activation-grad-rms", modules=["layers.*.mlp"]), 1),
                                            (build_metric("layer-activation-grad-quant", modules=["layers.1.mlp"]), 1)])
    assert [m.name for m, _ in metrics.metrics] == ["layer-activation-grad-rms", "layer-activation-grad-quant"]
    assert walks == ["Net"]  # it was one per cotangent metric (2 here), and one more for each refused
    metrics.close()
