"""Hugging Face Llama and Mixtral observed through the attention table with no user code:
``attn_implementation="sdpa"`` gives the values of ``"eager"`` and runs SDPA (the eager function
is never called), the values equal the float64 materialised softmax of the layer's q and k, and
the table is restored on close."""

from __future__ import annotations

import pytest
import torch

from tests.attention_model import attention_metrics, table
from tests.metrics.attention_reference import reference_table

B, T, VOCAB = 2, 9, 64


def _model(name: str, impl: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation=impl)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **common, num_local_experts=4, num_experts_per_tok=2)).eval()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding: padded queries see no key and count nowhere
    return {"input_ids": ids, "attention_mask": mask}


def _records(name: str, impl: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list]:
    """The attention table of one forward, and the (q, k) each layer's attention received."""
    import transformers.integrations.sdpa_attention as sdpa

    model = _model(name, impl)
    modeling = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    seen: list[tuple[torch.Tensor, torch.Tensor, object]] = []
    kernels: list[str] = []
    eager, sdpa_forward = modeling.eager_attention_forward, sdpa.sdpa_attention_forward

    def counting_eager(module, q, k, v, mask, *args, **kwargs):
        kernels.append("eager")
        seen.append((q.detach(), k.detach(), mask))
        return eager(module, q, k, v, mask, *args, **kwargs)

    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        kernels.append("sdpa")
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", counting_eager)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    from transformers.modeling_utils import AttentionInterface
    before = dict(AttentionInterface._global_mapping)
    metrics = attention_metrics(model)
    with metrics.step(1), torch.no_grad():
        model(**_batch())
    out = table(metrics.last_records)
    metrics.close()
    assert AttentionInterface._global_mapping == before  # the wrapper is gone after close
    assert kernels == [impl] * 2, kernels  # SDPA stays SDPA: the eager function never ran under sdpa
    assert sdpa.sdpa_attention_forward is sdpa_forward
    return out, seen


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_sdpa_equals_eager_and_stays_sdpa(name, monkeypatch):
    eager, seen = _records(name, "eager", monkeypatch)
    sdpa, _ = _records(name, "sdpa", monkeypatch)
    assert eager.keys() == sdpa.keys() and len(eager) == 2 * (2 + 3 * 4)
    for key, value in eager.items():
        assert sdpa[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
        if key[1] == 0:
            assert sdpa[key] == value, key  # the first layer's q and k are the same tensors: same values
    # Against the materialised softmax of what eager attention received (its own float mask).
    for layer, (q, k, mask) in enumerate(seen):
        visible = mask[..., :T] > torch.finfo(mask.dtype).min / 2
        sink = torch.where(visible[:, 0].any(-1), visible[:, 0].to(torch.uint8).argmax(-1), -1)
        want = reference_table(q, k, visible, sink, scale=(q.shape[-1]) ** -0.5)
        torch.testing.assert_close(torch.tensor(eager[("layer-attn-entropy", layer, "heads")], dtype=torch.float64),
                                   want["entropy"], rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(torch.tensor(eager[("layer-attn-sink", layer, "heads")], dtype=torch.float64),
                                   want["sink"], rtol=1e-5, atol=1e-12)
        assert eager[("layer-attn-logit-max", layer, "heads")] == tuple(want["max"].tolist())


def test_an_unreachable_implementation_is_refused_at_start_up():
    from tmetrics_core.errors import ConfigError

    model = _model("llama", "sdpa")
    model.config._attn_implementation = "custom_kernel"  # as a model whose attention no table entry reaches
    with pytest.raises(ConfigError, match=r"custom_kernel.*tm.observe\(self, 'qk', \(q, k\), kind='attn_qk'"):
        attention_metrics(model)
