"""``layer-activation-rms`` with no ``modules:`` hooks its documented defaults (each layer's
attention and MLP outputs): before, it hooked nothing and wrote no record. Values against float64."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.tiny import VOCAB, tiny_llama
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


def test_default_modules_are_hooked():
    model = tiny_llama()
    seen: dict[str, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        for part, module in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            module.register_forward_hook(lambda m, a, o, key=f"layers.{i}.{part}": seen.setdefault(key, []).append(
                (o[0] if isinstance(o, tuple) else o).detach().double()))
    tm = TensorMetrics(model, metrics=[(build_metric("layer-activation-rms"), 1)])
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with tm.step(1):
        model(input_ids=ids, labels=ids).loss.backward()
    got = {r.labels.tensor: r.value for r in tm.last_records}
    tm.close()
    want = {key: torch.cat([t.reshape(-1) for t in ts]).pow(2).mean().sqrt().item() for key, ts in seen.items()}
    assert got.keys() == want.keys() and len(want) == 4
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
