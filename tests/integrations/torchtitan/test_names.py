"""torchtitan 0.3.0 names, read from the real package's models (llama3 ``debugmodel``, qwen3
``debugmodel_moe``, built on the meta device): every parameter gets a canonical name of the
canonical vocabulary, the fused ``wqkv`` is ``attn.qkv``, ``lm_head`` is ``head``, and each
stacked routed-expert tensor splits into one site per expert."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.naming.canonical import COMPONENTS, canonicalize, detect_layout


def _model(family: str, flavor: str) -> torch.nn.Module:
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    spec = {"llama3": llama3, "qwen3": qwen3}[family](flavor)
    with torch.device("meta"):
        return spec.model.build()


@pytest.fixture(scope="module", params=[("llama3", "debugmodel"), ("qwen3", "debugmodel_moe")], ids=lambda p: p[0])
def model(request) -> torch.nn.Module:
    return _model(*request.param)


def test_every_parameter_has_a_canonical_name(model):
    params = list(model.named_parameters())
    assert detect_layout([n for n, _ in params]) == "torchtitan"
    entries = canonicalize(params, split_stacked=True)
    assert {e.component for e in entries} <= COMPONENTS, sorted({e.component for e in entries} - COMPONENTS)
    blocks = {n for n, _ in params if n.startswith("layers.")}
    assert all(e.layer is not None for e in entries if e.original in blocks)
    # Splitting stacked experts keeps every element exactly once.
    shapes = dict(params)
    views = sum(math.prod(e.view(shapes[e.original]).shape) for e in entries)
    assert views == sum(p.numel() for _, p in params)
    assert [e.name for e in entries if e.original == "lm_head.weight"] == ["head.weight"]


def test_fused_qkv_is_attn_qkv_with_rows_per_kv_head_group(model):
    entries = {e.original: e for e in canonicalize(model.named_parameters())}
    for layer, block in model.layers.items():
        qkv = block.attention.qkv_linear
        entry = entries[f"layers.{layer}.attention.qkv_linear.wqkv.weight"]
        assert entry.name == f"layers.{layer}.attn.qkv.weight" and entry.component == "attn.qkv"
        rows = qkv.wqkv.weight.shape[0]
        assert rows % ((qkv.heads_per_kv + 2) * qkv.head_dim) == 0


def test_stacked_routed_experts_are_one_site_per_expert():
    model = _model("qwen3", "debugmodel_moe")
    params = dict(model.named_parameters())
    entries = canonicalize(params.items(), split_stacked=True)
    for layer, block in model.layers.items():
        experts = block.moe.routed_experts.inner_experts
        for leaf, projection in (("w1_EFD", "gate"), ("w3_EFD", "up"), ("w2_EDF", "down")):
            stacked = getattr(experts, leaf)
            mine = [e for e in entries if e.original == f"layers.{layer}.moe.routed_experts.inner_experts.{leaf}"]
            assert [e.expert for e in mine] == list(range(stacked.shape[0]))
            assert [e.name for e in mine] == [f"layers.{layer}.moe.experts.{j}.{projection}.weight"
                                              for j in range(stacked.shape[0])]
            assert {tuple(e.view(stacked).shape) for e in mine} == {tuple(stacked.shape[1:])}
    buffers = {e.original: e.name for e in canonicalize(model.named_buffers())}
    assert buffers["layers.0.moe.expert_bias_E"] == "layers.0.moe.router.expert_bias"
