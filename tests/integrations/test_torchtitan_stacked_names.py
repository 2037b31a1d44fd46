"""torchtitan 0.3.0 grouped experts (``moe.routed_experts.inner_experts.w1_EFD`` ``[E, F, D]``...) are
named one slice per expert, as its older ``moe.experts.w1`` names were; built on the meta device
(qwen3 ``debugmodel_moe``: 64 experts per layer), so no memory is used."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.naming.canonical import canonicalize

pytest.importorskip("torchtitan")


def test_torchtitan_030_stacked_experts_split_into_one_slice_per_expert() -> None:
    from torchtitan.models.qwen3 import model_registry

    with torch.device("meta"):
        model = model_registry("debugmodel_moe").model.build()
    stored = dict(model.named_parameters())
    names = {c.name: c for c in canonicalize(stored.items(), split_stacked=True)}
    experts = stored["layers.1.moe.routed_experts.inner_experts.w1_EFD"].shape[0]
    for e in (0, experts - 1):
        for part, original, shape in (("gate", "w1_EFD", (768, 256)), ("up", "w3_EFD", (768, 256)),
                                      ("down", "w2_EDF", (256, 768))):
            entry = names[f"layers.1.moe.experts.{e}.{part}.weight"]
            assert entry.original == f"layers.1.moe.routed_experts.inner_experts.{original}"
            assert (entry.layer, entry.expert, entry.region) == (1, e, ((0, e, e + 1),))
            assert tuple(entry.view(stored[entry.original]).shape) == shape
    assert f"layers.1.moe.experts.{experts}.gate.weight" not in names
    assert names["layers.1.moe.router.weight"].original == "layers.1.moe.router.gate.weight"
