"""Blocks found by structure on models whose block lists no layout names: torch's
``nn.TransformerEncoder``, GPT-NeoX, BERT, ViT, T5 and Whisper (encoder and decoder as two
stacks, numbered one after the other), each from a tiny config. Per-layer gradient and residual
records with no configuration, against float64 references from the model's own tensors."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.naming.canonical import canonicalize
from tmetrics_core.naming.stacks import Stack, find_stacks
from tmetrics_core.tensor_metrics import TensorMetrics

transformers = pytest.importorskip("transformers")

D = 8


def _torch_encoder():
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True), 2,
                                        enable_nested_tensor=False)
    return model, (lambda: (model(torch.randn(2, 5, D)),)), {"layers": [0, 1]}


def _neox():
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16))
    return model, (lambda: (model(torch.randint(32, (2, 5))).logits,)), {"gpt_neox.layers": [0, 1]}


def _bert():
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return model, (lambda: (model(torch.randint(32, (2, 5))).last_hidden_state,)), {"encoder.layer": [0, 1]}


def _vit():
    model = transformers.ViTModel(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    blocks = next(p for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    return model, (lambda: (model(torch.randn(2, 3, 8, 8)).last_hidden_state,)), {blocks: [0, 1, 2]}


def _t5():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=D, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=3, num_heads=2, dropout_rate=0.0))
    run = lambda: (model(input_ids=torch.randint(32, (2, 5)), decoder_input_ids=torch.randint(32, (2, 4))).logits,)
    return model, run, {"encoder.block": [0, 1], "decoder.block": [2, 3, 4]}


def _whisper():
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=32, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_mel_bins=4, max_source_positions=8,
        max_target_positions=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    run = lambda: (model(input_features=torch.randn(2, 4, 16), decoder_input_ids=torch.randint(32, (2, 4))).logits,)
    return model, run, {"model.encoder.layers": [0, 1], "model.decoder.layers": [2, 3]}


@pytest.mark.parametrize("make", [_torch_encoder, _neox, _bert, _vit, _t5, _whisper],
                         ids=["torch-encoder", "gpt-neox", "bert", "vit", "t5", "whisper"])
def test_blocks_found_by_structure(make: Callable):
    torch.manual_seed(0)
    model, run, stacks = make()
    model.train()
    expected = {f"{path}.{k}": layer for path, layers in stacks.items() for k, layer in enumerate(layers)}
    names = canonicalize(model.named_parameters())
    for cn in names:
        inside = next((b for b in expected if cn.original.startswith(b + ".")), None)
        assert cn.layer == (expected[inside] if inside else None), cn
        if inside:
            assert cn.name.startswith(f"layers.{cn.layer}."), cn
    outs: dict[int, list[torch.Tensor]] = {}
    blocks = dict(model.named_modules())
    hooks = [blocks[path].register_forward_hook(
        lambda m, a, o, layer=layer: outs.setdefault(layer, []).append(
            (o[0] if isinstance(o, tuple) else o).detach().double()))
        for path, layer in expected.items()]
    tm = TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 1),
                                       (build_metric("layer-residual-accumulator-l2"), 1)])
    with tm.step(1):
        run()[0].float().pow(2).mean().backward()
    for h in hooks:
        h.remove()
    got = {(r.metric, r.layer): r.value for r in tm.last_records}
    tm.close()
    assert tm.failures == []
    grads: dict[int, float] = {}
    for cn in names:
        p = dict(model.named_parameters())[cn.original]
        if cn.layer is not None and p.grad is not None:
            grads[cn.layer] = grads.get(cn.layer, 0.0) + p.grad.double().pow(2).sum().item()
    layers = sorted(set(expected.values()))
    assert sorted(layer for metric, layer in got if metric == "layer-grad-l2") == layers
    for layer in layers:
        assert got[("layer-grad-l2", layer)] == pytest.approx(grads[layer] ** 0.5, rel=1e-6), layer
        want = torch.cat([o.reshape(-1) for o in outs[layer]]).norm().item()
        assert got[("layer-residual-accumulator-l2", layer)] == pytest.approx(want, rel=1e-6), layer


def test_no_repeated_blocks_says_what_was_found():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    why = r"the model itself \(2 entries: its entries are single modules, not blocks\)"
    with pytest.raises(ConfigError, match=why):
        TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 1)])


def test_experts_of_a_single_block_are_not_a_stack():
    """A pipeline stage holding one MoE layer: its experts are not blocks; a model wrapped whole
    in an nn.Sequential keeps its blocks."""
    def names(prefix: str, layers: range) -> list[str]:
        return [f"{prefix}layers.{i}.moe.experts.{e}.fc1.weight" for i in layers for e in range(4)] + [
            f"{prefix}layers.{i}.attn.q.weight" for i in layers]
    assert find_stacks(names("", range(1, 2))) == ()
    assert find_stacks([*names("0.", range(3)), "1.weight"]) == (Stack("0.layers", (0, 1, 2), 0),)
