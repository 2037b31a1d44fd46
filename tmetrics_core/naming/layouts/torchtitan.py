"""torchtitan layout (llama3, llama4, qwen3, deepseek_v3 models), 0.3.0 names and older ones.

torchtitan keeps layers in a ``ModuleDict`` keyed by the global layer id, and pipeline
stages delete the layers they do not own, so names already carry global layer indices: keep
``layer_offset=0``. ``w1`` is the gate, ``w3`` up, ``w2`` down. ``wq``/``wk`` rows are permuted
for RoPE relative to Hugging Face; norms and maxima are unchanged by a row permutation.

torchtitan 0.3.0 (llama3 and qwen3 flavours) names:

- ``attention.qkv_linear.wqkv.weight``: q, k and v fused, ``[n_kv_heads * (h + 2) * head_dim,
  dim]`` with ``h = n_heads // n_kv_heads``. Its rows are grouped per key/value head: for
  each kv head ``g``, ``h`` query heads, then key head ``g``, then value head ``g`` (each
  ``head_dim`` rows). So q, k and v are not contiguous chunks: named whole, as ``attn.qkv``,
  or, where a metric's ``select`` asks for them, as ``attn.q`` / ``attn.k`` / ``attn.v`` views
  that keep the group dim (`fused_qkv_geometry` reads the geometry from the modules).
- ``lm_head.weight`` (older: ``output.weight``): the output projection.
- ``moe.routed_experts.inner_experts.w1_EFD`` / ``w3_EFD`` ``[E, hidden, dim]`` and ``w2_EDF``
  ``[E, dim, hidden]`` (older: ``moe.experts.w1`` ...): every routed expert stacked along dim
  0 (a DTensor of global shape under expert parallelism), one slice per expert.
- ``moe.expert_bias_E`` (older: ``moe.expert_bias``): the load-balancing bias buffer.
"""

from __future__ import annotations

from typing import Any

from tmetrics_core.naming.layouts.layout import Layout, Rule

__all__ = [
    "TORCHTITAN",
    "fused_qkv_geometry",
]


def fused_qkv_geometry(model: Any) -> dict[str, tuple[int, int]]:
    """``{parameter name: (heads_per_kv, head_dim)}`` for the ``wqkv`` weight and bias of every
    torchtitan ``FusedQKVLinear`` in ``model`` (found by its attributes ``wqkv``,
    ``heads_per_kv`` and ``head_dim``, so torchtitan need not be imported); names as
    ``model.named_parameters()`` gives them."""
    out: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        wqkv = getattr(module, "wqkv", None)
        heads, dim = getattr(module, "heads_per_kv", None), getattr(module, "head_dim", None)
        if wqkv is None or not isinstance(heads, int) or not isinstance(dim, int):
            continue
        for leaf, _ in wqkv.named_parameters(recurse=False):
            out[f"{path}.wqkv.{leaf}" if path else f"wqkv.{leaf}"] = (heads, dim)
    return out

TORCHTITAN = Layout(
    name="torchtitan",
    roots=(),
    block="layers.{L}.",
    rules=(
        Rule("tok_embeddings.weight", "embed.weight"),
        Rule("norm.weight", "final_norm.weight"),
        Rule("output.weight", "head.weight"),
        Rule("lm_head.weight", "head.weight"),
        # attention
        Rule("layers.{L}.attention.qkv_linear.wqkv.{P}", "layers.{L}.attn.qkv.{P}"),
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
        Rule("layers.{L}.moe.expert_bias_E", "layers.{L}.moe.router.expert_bias"),
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
        Rule("layers.{L}.moe.shared_experts.w1.{P}", "layers.{L}.moe.shared.gate.{P}"),
        Rule("layers.{L}.moe.shared_experts.w3.{P}", "layers.{L}.moe.shared.up.{P}"),
        Rule("layers.{L}.moe.shared_experts.w2.{P}", "layers.{L}.moe.shared.down.{P}"),
    ),
)
