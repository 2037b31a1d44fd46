"""tmetrics' own layout: models whose parameter names already are canonical names (the demo,
or a model written for tmetrics). Every rule maps a name to itself, so layer and expert
indices, components and families are read from the names."""

from __future__ import annotations

from tmetrics_core.naming.layouts.layout import Layout, Rule

__all__ = ["CANONICAL"]

_LAYER_PARTS = (
    "attn_norm.weight", "mlp_norm.weight",
    *(f"attn.{p}.{{P}}" for p in ("q", "k", "v", "qkv", "o", "q_down", "q_up", "kv_down", "kv_up")),
    *(f"attn.{p}.weight" for p in ("q_norm", "k_norm", "kv_norm")),
    *(f"mlp.{p}.{{P}}" for p in ("gate", "up", "down", "fc1", "fc2", "gate_up")),
    "moe.router.{P}", "moe.router.expert_bias", "moe.shared_gate.{P}",
    *(f"moe.shared.{p}.{{P}}" for p in ("gate", "up", "down", "fc1", "fc2")),
    *(f"moe.experts.{{E}}.{p}.{{P}}" for p in ("gate", "up", "down", "fc1", "fc2", "gate_up")),
)

CANONICAL = Layout(
    name="canonical",
    roots=(),
    block="layers.{L}.",
    rules=(
        Rule("embed.weight", "embed.weight"),
        Rule("pos_embed.weight", "pos_embed.weight"),
        Rule("final_norm.weight", "final_norm.weight"),
        Rule("head.{P}", "head.{P}"),
        *(Rule(f"layers.{{L}}.{part}", f"layers.{{L}}.{part}") for part in _LAYER_PARTS),
    ),
)
