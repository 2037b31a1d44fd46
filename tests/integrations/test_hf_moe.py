"""Hugging Face MoE models out of the box (transformers 5, experts stacked ``[E, ...]``): tiny models
built from configs, 2 optimizer steps on CPU, no user hooks and no private attributes. Tokens per
expert equal the counts of the router's own top-k choices; per-expert gradient and parameter L2
equal float64 hand norms of each expert's slices of the stacked tensors; the global gradient L2
counts every element once. The references are read by the test's own hooks on the routers."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, VOCAB = 4, 2, 64
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
              max_position_embeddings=64)
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=16)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16, intermediate_size=16,
                       shared_expert_intermediate_size=16)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16, intermediate_size=16,
                       head_dim=16)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                     intermediate_size=16)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=16,
                         intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                          intermediate_size=16, head_dim=16)),
}
NAMES = ("expert-grad-l2", "expert-param-l2", "global-grad-l2", "layer-expert-tokens", "layer-router-logits-l2")


def _model(family: str) -> torch.nn.Module:
    model_class, config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_SMALL, **extra)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # some families initialise routers to zero: give every expert a chance
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer -> the transformers router module of that layer (for the test's own references)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and type(router).__name__.lower().endswith("router"):
            out[i] = router
    return out


def _stacked(model: torch.nn.Module) -> dict[int, list[torch.nn.Parameter]]:
    """Layer -> its stacked expert tensors ``[E, ...]`` (weights and biases)."""
    return {i: [p for _, p in layer.mlp.experts.named_parameters()] for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_and_expert_metrics_equal_the_models_own_choices_and_hand_norms(family: str) -> None:
    model = _model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], optimizer=optimizer)
    assert metrics.manifest.num_experts == EXPERTS
    routers, stacked = _routers(model), _stacked(model)
    assert sorted(routers) == sorted(stacked) and routers
    seen: dict[int, list] = {}
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out))
             for i, r in routers.items()]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        seen.clear()
        with metrics.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
            grads = {i: [p.grad.double() for p in ps] for i, ps in stacked.items()}
            params = {i: [p.detach().double().clone() for p in ps] for i, ps in stacked.items()}
            total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                                  if p.grad is not None))
            optimizer.step()
            optimizer.zero_grad()
        records = {(r.metric, r.layer, r.expert): r.value for r in metrics.last_records}
        assert not metrics.failures
        assert math.isclose(records[("global-grad-l2", None, None)], total, rel_tol=1e-9)
        for layer, outs in seen.items():
            logits, chosen = torch.cat([o[0] for o in outs]), torch.cat([o[2] for o in outs])
            counts = torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()
            assert list(records[("layer-expert-tokens", layer, None)]) == counts
            assert math.isclose(records[("layer-router-logits-l2", layer, None)],
                                float(logits.detach().double().norm()), rel_tol=1e-6)
        for layer in stacked:
            for e in range(EXPERTS):
                want = math.sqrt(sum(float(g[e].pow(2).sum()) for g in grads[layer]))
                assert math.isclose(records[("expert-grad-l2", layer, e)], want, rel_tol=1e-6), (layer, e)
                want = math.sqrt(sum(float(p[e].pow(2).sum()) for p in params[layer]))
                assert math.isclose(records[("expert-param-l2", layer, e)], want, rel_tol=1e-6), (layer, e)
        assert {k[1] for k in records if k[0] == "layer-expert-tokens"} == set(seen)
        assert all(len(r._forward_hooks) == 2 for r in routers.values())  # the test's and tmetrics' (kept)
    for h in hooks:
        h.remove()
    metrics.close()


@pytest.mark.parametrize("glob", ["layers.*.moe", "model.layers.*.mlp"])
def test_modules_globs_take_canonical_module_names_or_module_paths(glob: str) -> None:
    model = _model("mixtral")
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-activation-rms", modules=glob), 1)],
                            modules={"layer-activation-rms": (glob,)})
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out.detach()))
             for i, layer in enumerate(model.model.layers)]
    with metrics.step(1):
        model(input_ids=torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2)))
    records = {r.tensor: r.value for r in metrics.last_records}
    assert sorted(records) == ["layers.0.moe", "layers.1.moe"]  # canonical names label the sites
    for i, out in outputs.items():
        assert math.isclose(records[f"layers.{i}.moe"], float(out.double().pow(2).mean().sqrt()), rel_tol=1e-6)
    for h in hooks:
        h.remove()


def test_globs_in_another_naming_are_refused_with_the_naming_and_the_nearest_name() -> None:
    from tmetrics_core.errors import ConfigError

    model = _model("mixtral")
    with pytest.raises(ConfigError, match=r"modules: globs take canonical module names.*nearest: 'layers\.\*\.moe'"):
        TensorMetrics(model, metrics=[(build_metric("layer-activation-rms", modules="layers.*.mlp"), 1)],
                      modules={"layer-activation-rms": ("layers.*.mlp",)})
    with pytest.raises(ConfigError, match=r"select: globs take canonical tensor names.*matches the framework's name "
                                          r"'model\.layers\.0\.mlp\.gate\.weight', whose canonical name is "
                                          r"'layers\.0\.moe\.router\.weight'"):
        TensorMetrics(model, metrics=[(build_metric("layer-grad-l2", select="model.layers.*.mlp.gate.*"), 1)])


def test_updates_and_adam_state_of_expert_slices_are_read_as_views() -> None:
    model = _model("qwen2_moe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = ("layer-update-ratio", "layer-optimizer-state-rms", "expert-grad-l2")
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], optimizer=optimizer)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    for step in (1, 2):
        with metrics.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
            before = [[p.detach().double().clone() for p in layer.parameters()] for layer in model.model.layers]
            optimizer.step()
            optimizer.zero_grad()
    records = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
    assert not metrics.failures
    for i, (layer, then) in enumerate(zip(model.model.layers, before)):
        now = [p.detach().double() for p in layer.parameters()]
        ratio = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(now, then))) / math.sqrt(
            sum(float(a.pow(2).sum()) for a in now))
        assert math.isclose(records[("layer-update-ratio", i, None)], ratio, rel_tol=1e-6)
        state = [optimizer.state[p]["exp_avg_sq"].double() for p in layer.parameters()]
        rms = math.sqrt(sum(float(s.pow(2).sum()) for s in state) / sum(s.numel() for s in state))
        assert math.isclose(records[("layer-optimizer-state-rms", i, "exp_avg_sq")], rms, rel_tol=1e-6)


def test_an_expert_count_that_disagrees_with_the_config_is_refused() -> None:
    from tmetrics_core.errors import ConfigError

    model = _model("mixtral")  # 4 experts; an offset of 4 would number them 4..7 of 8
    with pytest.raises(ConfigError, match=r"routers score \[4\] experts each but its expert parameters number 8"):
        TensorMetrics(model, metrics=[(build_metric("layer-expert-tokens"), 1)], expert_offset=4)
