"""Megatron-Core GPT layout (``megatron.core.models.gpt.GPTModel``), local and Transformer
Engine specs.

Megatron numbers layers from 0 on every pipeline stage and experts from 0 on every
expert-parallel rank: the global numbers need the stage's first global layer and the rank's
first global expert as offsets, which ``tmetrics_core.integrations.megatron`` reads from
``TransformerLayer.layer_number`` and ``MoELayer.local_expert_indices`` (pass them by hand only
without it). Transformer Engine fuses the pre-attention and pre-MLP norms into
``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``; those are the norms.
``linear_fc1`` holds gate and up rows when the MLP is gated (SwiGLU) and is named ``fc1``
either way. Grouped GEMM keeps one tensor per local expert (``linear_fc1.weight3``); the
legacy ``GroupedMLP`` keeps all local experts in ``weight1`` ``[hidden, E * ffn]`` (stored
transposed, experts interleaved by ``view(E, hidden, -1)``), named without an expert index.
"""

from __future__ import annotations

from tmetrics_core.naming.layouts.layout import Layout, Rule

__all__ = [
    "MEGATRON",
]

MEGATRON = Layout(
    name="megatron",
    roots=("language_model.",),
    block="decoder.layers.{L}.",
    rules=(
        Rule("embedding.word_embeddings.weight", "embed.weight"),
        Rule("embedding.position_embeddings.weight", "pos_embed.weight"),
        Rule("decoder.final_layernorm.{P}", "final_norm.{P}"),
        Rule("output_layer.weight", "head.weight"),
        # attention
        Rule("decoder.layers.{L}.input_layernorm.{P}", "layers.{L}.attn_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_qkv.layer_norm_{P}", "layers.{L}.attn_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_qkv.{P}", "layers.{L}.attn.qkv.{P}"),
        Rule("decoder.layers.{L}.self_attention.q_layernorm.{P}", "layers.{L}.attn.q_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.k_layernorm.{P}", "layers.{L}.attn.k_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_proj.{P}", "layers.{L}.attn.o.{P}"),
        # multi-head latent attention
        Rule("decoder.layers.{L}.self_attention.linear_q_proj.{P}", "layers.{L}.attn.q.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_q_down_proj.{P}", "layers.{L}.attn.q_down.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_q_up_proj.layer_norm_{P}", "layers.{L}.attn.q_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_q_up_proj.{P}", "layers.{L}.attn.q_up.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_kv_down_proj.{P}", "layers.{L}.attn.kv_down.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_kv_up_proj.layer_norm_{P}", "layers.{L}.attn.kv_norm.{P}"),
        Rule("decoder.layers.{L}.self_attention.linear_kv_up_proj.{P}", "layers.{L}.attn.kv_up.{P}"),
        Rule("decoder.layers.{L}.self_attention.kv_layernorm.{P}", "layers.{L}.attn.kv_norm.{P}"),
        # dense MLP
        Rule("decoder.layers.{L}.pre_mlp_layernorm.{P}", "layers.{L}.mlp_norm.{P}"),
        Rule("decoder.layers.{L}.mlp.linear_fc1.layer_norm_{P}", "layers.{L}.mlp_norm.{P}"),
        Rule("decoder.layers.{L}.mlp.linear_fc1.{P}", "layers.{L}.mlp.fc1.{P}"),
        Rule("decoder.layers.{L}.mlp.linear_fc2.{P}", "layers.{L}.mlp.fc2.{P}"),
        # MoE
        Rule("decoder.layers.{L}.mlp.router.{P}", "layers.{L}.moe.router.{P}"),
        Rule("decoder.layers.{L}.mlp.router.expert_bias", "layers.{L}.moe.router.expert_bias"),
        Rule("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.{P}", "layers.{L}.moe.experts.{E}.fc1.{P}"),
        Rule("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.{P}", "layers.{L}.moe.experts.{E}.fc2.{P}"),
        Rule("decoder.layers.{L}.mlp.experts.linear_fc1.{P}{E}", "layers.{L}.moe.experts.{E}.fc1.{P}"),
        Rule("decoder.layers.{L}.mlp.experts.linear_fc2.{P}{E}", "layers.{L}.moe.experts.{E}.fc2.{P}"),
        Rule("decoder.layers.{L}.mlp.experts.weight1", "layers.{L}.moe.experts.fc1.weight", transposed=True),
        Rule("decoder.layers.{L}.mlp.experts.weight2", "layers.{L}.moe.experts.fc2.weight", transposed=True),
        Rule("decoder.layers.{L}.mlp.shared_experts.linear_fc1.{P}", "layers.{L}.moe.shared.fc1.{P}"),
        Rule("decoder.layers.{L}.mlp.shared_experts.linear_fc2.{P}", "layers.{L}.moe.shared.fc2.{P}"),
        Rule("decoder.layers.{L}.mlp.shared_experts.gate_weight", "layers.{L}.moe.shared_gate.weight"),
    ),
)
