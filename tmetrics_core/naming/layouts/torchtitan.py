"""torchtitan layout (llama3, llama4, qwen3, deepseek_v3 models).

torchtitan keeps layers in a ``ModuleDict`` keyed by the global layer id, and pipeline
stages delete the layers they do not own, so names already carry global layer indices: keep
``layer_offset=0``. Routed experts are stacked: ``moe.experts.w1`` is ``[E, hidden, dim]``
(a DTensor of global shape under expert parallelism). ``w1`` is the gate, ``w3`` up, ``w2``
down; torchtitan 0.3.0 calls them ``moe.routed_experts.inner_experts.w1_EFD``, ``w3_EFD``
(``[E, hidden, dim]``) and ``w2_EDF`` (``[E, dim, hidden]``). ``wq``/``wk`` rows are permuted
for RoPE relative to Hugging Face; norms and maxima are unchanged by a row permutation.
"""

from __future__ import annotations

from tmetrics_core.naming.layouts.layout import Layout, Rule

__all__ = [
    "TORCHTITAN",
]

TORCHTITAN = Layout(
    name="torchtitan",
    roots=(),
    block="layers.{L}.",
    rules=(
        Rule("tok_embeddings.weight", "embed.weight"),
        Rule("norm.weight", "final_norm.weight"),
        Rule("output.weight", "head.weight"),
        # attention
        Rule("layers.{L}.attention_norm.weight", "layers.{L}.attn_norm.weight"),
        Rule("layers.{L}.attention.wq.{P}", "layers.{L}.attn.q.{P}"),
        Rule("layers.{L}.attention.wk.{P}", "layers.{L}.attn.k.{P}"),
        Rule("layers.{L}.attention.wv.{P}", "layers.{L}.attn.v.{P}"),
        Rule("layers.{L}.attention.wo.{P}", "layers.{L}.attn.o.{P}"),
        Rule("layers.{L}.attention.q_norm.weight", "layers.{L}.attn.q_norm.weight"),
        Rule("layers.{L}.attention.k_norm.weight", "layers.{L}.attn.k_norm.weight"),
        # multi-head latent attention (deepseek_v3)
        Rule("layers.{L}.attention.wq_a.{P}", "layers.{L}.attn.q_down.{P}"),
        Rule("layers.{L}.attention.wq_b.{P}", "layers.{L}.attn.q_up.{P}"),
        Rule("layers.{L}.attention.wkv_a.{P}", "layers.{L}.attn.kv_down.{P}"),
        Rule("layers.{L}.attention.wkv_b.{P}", "layers.{L}.attn.kv_up.{P}"),
        Rule("layers.{L}.attention.kv_norm.weight", "layers.{L}.attn.kv_norm.weight"),
        # dense MLP
        Rule("layers.{L}.ffn_norm.weight", "layers.{L}.mlp_norm.weight"),
        Rule("layers.{L}.feed_forward.w1.{P}", "layers.{L}.mlp.gate.{P}"),
        Rule("layers.{L}.feed_forward.w3.{P}", "layers.{L}.mlp.up.{P}"),
        Rule("layers.{L}.feed_forward.w2.{P}", "layers.{L}.mlp.down.{P}"),
        # MoE
        Rule("layers.{L}.moe.router.gate.{P}", "layers.{L}.moe.router.{P}"),
        Rule("layers.{L}.moe.expert_bias", "layers.{L}.moe.router.expert_bias"),
        Rule(
            "layers.{L}.moe.experts.w1",
            "layers.{L}.moe.experts.gate.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.gate.weight",
        ),
        Rule(
            "layers.{L}.moe.experts.w3",
            "layers.{L}.moe.experts.up.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.up.weight",
        ),
        Rule(
            "layers.{L}.moe.experts.w2",
            "layers.{L}.moe.experts.down.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.down.weight",
        ),
        # torchtitan 0.3.0 names the stacked experts by their dims (E experts, F hidden, D model)
        Rule(
            "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
            "layers.{L}.moe.experts.gate.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.gate.weight",
        ),
        Rule(
            "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
            "layers.{L}.moe.experts.up.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.up.weight",
        ),
        Rule(
            "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
            "layers.{L}.moe.experts.down.weight",
            expert_dim=0,
            each="layers.{L}.moe.experts.{E}.down.weight",
        ),
        Rule("layers.{L}.moe.shared_experts.w1.{P}", "layers.{L}.moe.shared.gate.{P}"),
        Rule("layers.{L}.moe.shared_experts.w3.{P}", "layers.{L}.moe.shared.up.{P}"),
        Rule("layers.{L}.moe.shared_experts.w2.{P}", "layers.{L}.moe.shared.down.{P}"),
    ),
)
