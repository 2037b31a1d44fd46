"""Hugging Face ``transformers`` layouts.

``HF`` covers the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3), Mixtral, Qwen2-MoE and
DeepSeek-V3 as both transformers 4.x (one module per expert) and 5.x (experts stacked into
``gate_up_proj`` ``[E, 2 * intermediate, hidden]`` and ``down_proj`` ``[E, hidden,
intermediate]``) build them. ``HF_GPT2`` is GPT-2, whose ``Conv1D`` stores weights
``[in, out]``. ``HF_GPT_OSS`` is GPT-OSS: its router is ``mlp.router`` (with a bias) and its
stacked experts are stored ``[E, in, out]`` (``gate_up_proj`` ``[E, hidden, 2 * intermediate]``
with gate and up columns interleaved, not in halves), so each expert's ``gate_up`` is one
slice, transposed, and not split into parts. ``HF_SWITCH`` is the encoder of Switch
Transformers (``SwitchTransformersEncoderModel``), the one MoE of transformers 5 that keeps one
module per expert (``experts.expert_{e}``, a ``ModuleDict`` of ``wi``/``wo`` MLPs) and its router
weight in ``router.classifier``; encoder-decoder models (two stacks numbered from 0 each) are not
named by it.
"""

from __future__ import annotations

from tmetrics_core.naming.layouts.layout import Layout, Rule

__all__ = [
    "HF",
    "HF_GPT2",
    "HF_GPT_OSS",
    "HF_SWITCH",
]

HF = Layout(
    name="hf",
    roots=("model.", "language_model."),
    block="layers.{L}.",
    rules=(
        Rule("embed_tokens.weight", "embed.weight"),
        Rule("norm.weight", "final_norm.weight"),
        Rule("lm_head.weight", "head.weight"),
        # attention
        Rule("layers.{L}.input_layernorm.weight", "layers.{L}.attn_norm.weight"),
        Rule("layers.{L}.self_attn.q_proj.{P}", "layers.{L}.attn.q.{P}"),
        Rule("layers.{L}.self_attn.k_proj.{P}", "layers.{L}.attn.k.{P}"),
        Rule("layers.{L}.self_attn.v_proj.{P}", "layers.{L}.attn.v.{P}"),
        Rule("layers.{L}.self_attn.qkv_proj.{P}", "layers.{L}.attn.qkv.{P}"),
        Rule("layers.{L}.self_attn.o_proj.{P}", "layers.{L}.attn.o.{P}"),
        Rule("layers.{L}.self_attn.q_norm.weight", "layers.{L}.attn.q_norm.weight"),
        Rule("layers.{L}.self_attn.k_norm.weight", "layers.{L}.attn.k_norm.weight"),
        # multi-head latent attention (DeepSeek-V3)
        Rule("layers.{L}.self_attn.q_a_proj.{P}", "layers.{L}.attn.q_down.{P}"),
        Rule("layers.{L}.self_attn.q_a_layernorm.weight", "layers.{L}.attn.q_norm.weight"),
        Rule("layers.{L}.self_attn.q_b_proj.{P}", "layers.{L}.attn.q_up.{P}"),
        Rule("layers.{L}.self_attn.kv_a_proj_with_mqa.{P}", "layers.{L}.attn.kv_down.{P}"),
        Rule("layers.{L}.self_attn.kv_a_layernorm.weight", "layers.{L}.attn.kv_norm.weight"),
        Rule("layers.{L}.self_attn.kv_b_proj.{P}", "layers.{L}.attn.kv_up.{P}"),
        # dense MLP
        Rule("layers.{L}.post_attention_layernorm.weight", "layers.{L}.mlp_norm.weight"),
        Rule("layers.{L}.mlp.gate_proj.{P}", "layers.{L}.mlp.gate.{P}"),
        Rule("layers.{L}.mlp.up_proj.{P}", "layers.{L}.mlp.up.{P}"),
        Rule("layers.{L}.mlp.down_proj.{P}", "layers.{L}.mlp.down.{P}"),
        Rule(
            "layers.{L}.mlp.gate_up_proj.{P}",
            "layers.{L}.mlp.gate_up.{P}",
            parts=("gate", "up"),
            part_dim=0,
            each="layers.{L}.mlp.{S}.{P}",
        ),
        # MoE, transformers 5.x: router weight on the `gate` module, experts stacked
        Rule("layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.weight"),
        Rule("layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.router.expert_bias"),
        Rule(
            "layers.{L}.mlp.experts.gate_up_proj",
            "layers.{L}.moe.experts.gate_up.weight",
            expert_dim=0,
            parts=("gate", "up"),
            part_dim=1,
            each="layers.{L}.moe.experts.{E}.{S}.weight",
        ),
        Rule(
            "layers.{L}.mlp.experts.down_proj",
            "layers.{L}.moe.experts.down.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.down.weight",
        ),
        # MoE, transformers 4.x: one module per expert
        Rule("layers.{L}.mlp.experts.{E}.gate_proj.{P}", "layers.{L}.moe.experts.{E}.gate.{P}"),
        Rule("layers.{L}.mlp.experts.{E}.up_proj.{P}", "layers.{L}.moe.experts.{E}.up.{P}"),
        Rule("layers.{L}.mlp.experts.{E}.down_proj.{P}", "layers.{L}.moe.experts.{E}.down.{P}"),
        Rule("layers.{L}.block_sparse_moe.gate.weight", "layers.{L}.moe.router.weight"),
        Rule("layers.{L}.block_sparse_moe.experts.{E}.w1.weight", "layers.{L}.moe.experts.{E}.gate.weight"),
        Rule("layers.{L}.block_sparse_moe.experts.{E}.w3.weight", "layers.{L}.moe.experts.{E}.up.weight"),
        Rule("layers.{L}.block_sparse_moe.experts.{E}.w2.weight", "layers.{L}.moe.experts.{E}.down.weight"),
        # shared experts: Qwen2-MoE spells it `shared_expert`, DeepSeek-V3 `shared_experts`
        Rule("layers.{L}.mlp.shared_expert.gate_proj.{P}", "layers.{L}.moe.shared.gate.{P}"),
        Rule("layers.{L}.mlp.shared_expert.up_proj.{P}", "layers.{L}.moe.shared.up.{P}"),
        Rule("layers.{L}.mlp.shared_expert.down_proj.{P}", "layers.{L}.moe.shared.down.{P}"),
        Rule("layers.{L}.mlp.shared_experts.gate_proj.{P}", "layers.{L}.moe.shared.gate.{P}"),
        Rule("layers.{L}.mlp.shared_experts.up_proj.{P}", "layers.{L}.moe.shared.up.{P}"),
        Rule("layers.{L}.mlp.shared_experts.down_proj.{P}", "layers.{L}.moe.shared.down.{P}"),
        Rule("layers.{L}.mlp.shared_expert_gate.weight", "layers.{L}.moe.shared_gate.weight"),
    ),
)

HF_GPT2 = Layout(
    name="hf-gpt2",
    roots=("transformer.",),
    block="h.{L}.",
    rules=(
        Rule("wte.weight", "embed.weight"),
        Rule("wpe.weight", "pos_embed.weight"),
        Rule("ln_f.{P}", "final_norm.{P}"),
        Rule("lm_head.weight", "head.weight"),
        Rule("h.{L}.ln_1.{P}", "layers.{L}.attn_norm.{P}"),
        Rule("h.{L}.attn.c_attn.{P}", "layers.{L}.attn.qkv.{P}", transposed=True),
        Rule("h.{L}.attn.c_proj.{P}", "layers.{L}.attn.o.{P}", transposed=True),
        Rule("h.{L}.ln_2.{P}", "layers.{L}.mlp_norm.{P}"),
        Rule("h.{L}.mlp.c_fc.{P}", "layers.{L}.mlp.fc1.{P}", transposed=True),
        Rule("h.{L}.mlp.c_proj.{P}", "layers.{L}.mlp.fc2.{P}", transposed=True),
    ),
)

HF_GPT_OSS = Layout(
    name="hf-gpt-oss",
    roots=HF.roots,
    block=HF.block,
    rules=(
        *(rule for rule in HF.rules if ".mlp." not in rule.path),
        Rule("layers.{L}.mlp.router.{P}", "layers.{L}.moe.router.{P}"),
        Rule(
            "layers.{L}.mlp.experts.gate_up_proj",
            "layers.{L}.moe.experts.gate_up.weight",
            transposed=True,
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.gate_up.weight",
        ),
        Rule(
            "layers.{L}.mlp.experts.gate_up_proj_bias",
            "layers.{L}.moe.experts.gate_up.bias",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.gate_up.bias",
        ),
        Rule(
            "layers.{L}.mlp.experts.down_proj",
            "layers.{L}.moe.experts.down.weight",
            transposed=True,
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.down.weight",
        ),
        Rule(
            "layers.{L}.mlp.experts.down_proj_bias",
            "layers.{L}.moe.experts.down.bias",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.down.bias",
        ),
    ),
)

HF_SWITCH = Layout(
    name="hf-switch",
    roots=("encoder.",),
    block="block.{L}.",
    rules=(
        Rule("shared.weight", "embed.weight"),
        Rule("embed_tokens.weight", "embed.weight"),
        Rule("final_layer_norm.weight", "final_norm.weight"),
        Rule("block.{L}.layer.0.layer_norm.weight", "layers.{L}.attn_norm.weight"),
        Rule("block.{L}.layer.0.SelfAttention.q.weight", "layers.{L}.attn.q.weight"),
        Rule("block.{L}.layer.0.SelfAttention.k.weight", "layers.{L}.attn.k.weight"),
        Rule("block.{L}.layer.0.SelfAttention.v.weight", "layers.{L}.attn.v.weight"),
        Rule("block.{L}.layer.0.SelfAttention.o.weight", "layers.{L}.attn.o.weight"),
        Rule("block.{L}.layer.0.SelfAttention.relative_attention_bias.weight", "layers.{L}.attn.rel_bias.weight"),
        Rule("block.{L}.layer.1.layer_norm.weight", "layers.{L}.mlp_norm.weight"),
        Rule("block.{L}.layer.1.mlp.wi.weight", "layers.{L}.mlp.fc1.weight"),
        Rule("block.{L}.layer.1.mlp.wo.weight", "layers.{L}.mlp.fc2.weight"),
        Rule("block.{L}.layer.1.mlp.router.classifier.{P}", "layers.{L}.moe.router.{P}"),
        Rule("block.{L}.layer.1.mlp.experts.expert_{E}.wi.weight", "layers.{L}.moe.experts.{E}.fc1.weight"),
        Rule("block.{L}.layer.1.mlp.experts.expert_{E}.wo.weight", "layers.{L}.moe.experts.{E}.fc2.weight"),
    ),
)
