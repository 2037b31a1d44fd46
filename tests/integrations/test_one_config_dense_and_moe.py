"""One config for a dense and an MoE model (issue 35, item 4): router metrics marked
``optional: true`` are skipped with one INFO line where the model has no router, and a glob with
alternatives (``layers.*.{mlp,moe}``) chooses the feed-forward part of both. A dense Llama and a
Mixtral, each built from a tiny config, trained two steps with the same config; every value is
checked against a float64 reference."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.integrations.tiny import SEQ, VOCAB, by_step, read_jsonl
from tmetrics_core.errors import ConfigError
from tmetrics_core.tensor_metrics import TensorMetrics

CONFIG = {
    "metrics": [
        {"name": "layer-grad-l2", "select": "layers.*.{mlp,moe}.*"},
        {"name": "layer-activation-rms", "modules": "layers.*.{mlp,moe}"},
        {"name": "layer-router-logits-l2", "optional": True},
        {"name": "layer-expert-tokens", "optional": True},
    ],
    "sinks": {"jsonl": {}},
}
ROUTER_METRICS = ("layer-router-logits-l2", "layer-expert-tokens")


def _model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=SEQ)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, num_local_experts=4,
                                                                      num_experts_per_tok=2))


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_one_config_serves_a_dense_and_an_moe_model(tmp_path, kind, caplog):
    caplog.set_level(logging.INFO, logger="tmetrics")
    model = _model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = model.model.layers
    outputs: dict[int, torch.Tensor] = {}
    for i, block in enumerate(blocks):
        block.mlp.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(
            i, (out[0] if isinstance(out, tuple) else out).detach().double()))
    router_logits: dict[int, torch.Tensor] = {}
    if kind == "mixtral":
        for i, block in enumerate(blocks):
            block.mlp.gate.register_forward_hook(lambda m, a, out, i=i: router_logits.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).detach().double()))
    metrics = TensorMetrics.from_config(CONFIG, model=model, optimizer=optimizer, run_dir=tmp_path)
    expected: dict[int, dict[tuple, float]] = {}
    ids = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        with metrics.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
            want = expected[step] = {}
            for i, block in enumerate(blocks):
                grads = [p.grad.double() for p in block.mlp.parameters()]
                want[("layer-grad-l2", i)] = math.sqrt(sum(float(g.square().sum()) for g in grads))
                want[("layer-activation-rms", f"layers.{i}.{'mlp' if kind == 'llama' else 'moe'}")] = math.sqrt(
                    float(outputs[i].square().mean()))
                if kind == "mixtral":
                    want[("layer-router-logits-l2", i)] = math.sqrt(float(router_logits[i].square().sum()))
            optimizer.step()
            optimizer.zero_grad()
    metrics.close()

    skipped = [r.getMessage() for r in caplog.records if "optional metric" in r.getMessage()]
    lines = read_jsonl(tmp_path)
    got = {step: {(r["metric"], r["labels"].get("layer") if r["metric"] != "layer-activation-rms"
                   else r["labels"]["tensor"]): r["value"] for r in lines if r["step"] == step
                  and r["metric"] != "layer-expert-tokens"} for step in (1, 2)}
    by_step(lines)  # each record once
    for step in (1, 2):
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5), (step, key)
    tokens = [r for r in lines if r["metric"] == "layer-expert-tokens"]
    if kind == "llama":
        assert len(skipped) == len(ROUTER_METRICS)
        assert all("skipped" in s and "router" in s for s in skipped)
        assert not tokens
    else:
        assert not skipped
        assert {(r["step"], r["labels"]["layer"]) for r in tokens} == {(s, i) for s in (1, 2) for i in (0, 1)}
        assert all(sum(r["value"]) == 2 * SEQ * 2 for r in tokens)  # every token routed to top-2 experts


def test_a_router_metric_not_marked_optional_is_refused_on_a_dense_model_with_the_way_out(tmp_path):
    model = _model("llama")
    config = {"metrics": ["layer-router-logits-l2"], "sinks": {"jsonl": {}}}
    with pytest.raises(ConfigError, match=r"no router.*optional: true"):
        TensorMetrics.from_config(config, model=model, run_dir=tmp_path)
