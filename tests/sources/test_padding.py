"""Hugging Face padding with no hand-observed mask: the model's ``attention_mask`` is taken as
the step's ``token_mask``, so residual and activation metrics run over real tokens only (float64
references over the unpadded rows). A mask the model cannot give as ``[batch, seq]`` is said once."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.tiny import VOCAB, tiny_llama
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


def _rms(rows: list[torch.Tensor]) -> float:
    return torch.cat([r.reshape(-1) for r in rows]).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("positional", [False, True])
def test_attention_mask_is_the_token_mask(positional):
    model = tiny_llama()
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 3:] = 0  # right padding: 3 of 12 tokens
    keep = mask.reshape(-1).bool()
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}

    def spy(key):
        def hook(m, a, o):
            out = (o[0] if isinstance(o, tuple) else o).detach().double()
            seen.setdefault(key, []).append(out.reshape(-1, out.shape[-1])[keep])
        return hook
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(spy(("layer-residual-accumulator-rms", i)))
        layer.mlp.register_forward_hook(spy(("layer-activation-rms", i)))
    tm = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 1),
                                       (build_metric("layer-activation-rms", modules="layers.*.mlp"), 1)])
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with tm.step(1):
        out = model(ids, mask) if positional else model(input_ids=ids, attention_mask=mask)
        out.logits.float().pow(2).mean().backward()
    got = {(r.metric, r.labels.layer): r.value for r in tm.last_records}
    tm.close()
    assert got.keys() == seen.keys()
    for key, rows in seen.items():
        assert sum(len(r) for r in rows) == 9
        assert got[key] == pytest.approx(_rms(rows), rel=1e-6), key


def test_a_mask_of_another_shape_is_said_once(caplog):
    model = tiny_llama()
    tm = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 1)])
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    additive = torch.zeros(2, 1, 6, 6)
    with caplog.at_level("WARNING", logger="tmetrics"):
        for step in (1, 2):
            with tm.step(step):
                model(input_ids=ids, attention_mask=additive)
    tm.close()
    assert sum("padding tokens are counted" in r.message for r in caplog.records) == 1


def test_the_model_inside_a_wrapper_is_hooked():
    class Wrapper(torch.nn.Module):  # as a LightningModule holds a Hugging Face model
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_llama()

        def forward(self, ids, mask):
            return self.net(input_ids=ids, attention_mask=mask).logits

    model = Wrapper()
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    outs: list[torch.Tensor] = []
    model.net.model.layers[1].register_forward_hook(lambda m, a, o: outs.append(
        (o[0] if isinstance(o, tuple) else o).detach().double().reshape(-1, 16)[mask.reshape(-1).bool()]))
    tm = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 1)])
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with tm.step(1):
        model(ids, mask).float().pow(2).mean().backward()
    got = {r.labels.layer: r.value for r in tm.last_records}
    tm.close()
    assert got[1] == pytest.approx(_rms(outs), rel=1e-6)
