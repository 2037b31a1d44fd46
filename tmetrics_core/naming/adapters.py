"""PEFT adapter tensors read as pieces of the module they adapt.

PEFT wraps an adapted module: ``q_proj.weight`` becomes ``q_proj.base_layer.weight`` (the frozen
base weight) beside ``q_proj.lora_A.default.weight`` and ``q_proj.lora_B.default.weight``, and a
``PeftModel`` puts the whole model under ``base_model.model.``. tmetrics names the base weight as
the unwrapped model's (``base_layer`` and ``original_module`` are wrapper pieces, see
`tmetrics_core.naming.canonical.strip_wrappers`) and each adapter tensor below the canonical name
of the module it adapts:

=============================================  =========================================
PEFT name (below the block)                    canonical name
=============================================  =========================================
``self_attn.q_proj.lora_A.default.weight``     ``attn.q.lora_A.weight`` (LoRA, DoRA)
``self_attn.q_proj.lora_B.default.weight``     ``attn.q.lora_B.weight``
``...q_proj.lora_magnitude_vector.default.weight``  ``attn.q.lora_magnitude.weight`` (DoRA)
``embed_tokens.lora_embedding_A.default``      ``embed.lora_A`` (LoRA on an embedding)
``self_attn.k_proj.ia3_l.default``             ``attn.k.ia3`` (IA3)
``lm_head.modules_to_save.default.weight``     ``head.trained_copy.weight``
=============================================  =========================================

The adapter named ``default`` leaves no trace in the name; another adapter's name stays after the
piece (``attn.q.lora_A.second.weight``). Pure string functions.
"""

from __future__ import annotations

__all__ = ["ADAPTER_PIECES", "split_adapter"]

ADAPTER_PIECES: dict[str, str] = {
    "lora_A": "lora_A",
    "lora_B": "lora_B",
    "lora_embedding_A": "lora_A",
    "lora_embedding_B": "lora_B",
    "lora_magnitude_vector": "lora_magnitude",
    "ia3_l": "ia3",
    "modules_to_save": "trained_copy",
}
"""PEFT's container attribute -> the piece of the canonical name."""

_LEAVES = frozenset({"weight", "bias"})


def split_adapter(clean: str) -> tuple[str, str] | None:
    """``(base, suffix)`` for an adapter tensor's cleaned name, else None.

    ``base`` is the name of the adapted module's weight (``...q_proj.weight``), whose canonical
    name gives the adapter's module and layer; ``suffix`` goes after that module's canonical name
    (``lora_A.weight``, ``ia3``, ``lora_A.second.weight``).
    """
    pieces = clean.split(".")
    for j in range(len(pieces) - 2, -1, -1):
        piece = ADAPTER_PIECES.get(pieces[j])
        if piece is None:
            continue
        tail = pieces[j + 1:]
        if not tail or len(tail) > 2 or (len(tail) == 2 and tail[1] not in _LEAVES):
            return None
        adapter = [] if tail[0] == "default" else [tail[0]]
        leaf = tail[1:]
        return ".".join([*pieces[:j], "weight"]), ".".join([piece, *adapter, *leaf])
    return None
