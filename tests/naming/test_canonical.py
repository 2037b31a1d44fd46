"""Canonical names on real module trees (tiny `transformers` models, no weights downloaded) and
on name lists of Megatron-Core and torchtitan kept in tests/data."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2MoeConfig,
)

from tmetrics_core.errors import ConfigError
from tmetrics_core.naming.layouts import LAYOUTS, Rule, component_of
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.naming.canonical import (
    COMPONENTS,
    KNOWN_LAYOUTS,
    canonical_name,
    canonicalize,
    detect_layout,
    strip_wrappers,
)
from tmetrics_core.naming.name import CanonicalName
from tmetrics_core.tensor_metrics import TensorMetrics

transformers.logging.set_verbosity_error()

DATA = Path(__file__).parent.parent / "data"
LAYERS, EXPERTS, HIDDEN, FFN = 2, 4, 32, 48


def read_names(file: str) -> dict[str, list[tuple[str, str]]]:
    """Sections of a name list: ``## section`` headers, ``original  canonical`` lines."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in (DATA / file).read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        elif line.strip() and not line.startswith("#"):
            original, canonical = line.split()
            current.append((original, canonical))
    return sections


LISTS = {
    "megatron": read_names("names_megatron.txt"),
    "torchtitan": read_names("names_torchtitan.txt"),
    "hf": read_names("names_hf4.txt"),
}


def on_meta(pairs: list[tuple[str, str]]) -> list[tuple[str, torch.Tensor]]:
    return [(original, torch.empty(2, device="meta")) for original, _ in pairs]


def decoder(config_class: Callable[..., transformers.PretrainedConfig], **extra: object) -> torch.nn.Module:
    config = config_class(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    built = {
        "llama": decoder(LlamaConfig),
        "mistral": decoder(MistralConfig),
        "mixtral": decoder(MixtralConfig, num_local_experts=EXPERTS, num_experts_per_tok=2),
        "qwen2-moe": decoder(
            Qwen2MoeConfig,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
        "phi3": decoder(Phi3Config, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gpt2": AutoModelForCausalLM.from_config(
            GPT2Config(
                n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
            )
        ),
    }
    with torch.no_grad():
        for model in built.values():
            for parameter in model.parameters():
                parameter.normal_()
    return built


def names_of(entries: list[CanonicalName]) -> dict[str, CanonicalName]:
    return {entry.name: entry for entry in entries}


LLAMA_SCHEME = [
    "embed.weight",
    *(
        f"layers.{i}.{leaf}.weight"
        for i in range(LAYERS)
        for leaf in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down", "attn_norm", "mlp_norm")
    ),
    "final_norm.weight",
    "head.weight",
]


def test_llama_gets_exactly_the_scheme(models: dict[str, torch.nn.Module]) -> None:
    entries = canonicalize(models["llama"].named_parameters())
    assert sorted(entry.name for entry in entries) == sorted(LLAMA_SCHEME)
    q = names_of(entries)["layers.1.attn.q.weight"]
    assert q == CanonicalName(
        name="layers.1.attn.q.weight",
        original="model.layers.1.self_attn.q_proj.weight",
        layer=1,
        expert=None,
        component="attn.q",
        family="layers.*.attn.q.weight",
        layout="hf",
    )
    assert names_of(entries)["head.weight"].original == "lm_head.weight"
    assert names_of(entries)["final_norm.weight"].component == "final_norm"


@pytest.mark.parametrize("model", ["llama", "mistral", "mixtral", "qwen2-moe"])
def test_query_projection_of_layer_1_in_hf_models(models: dict[str, torch.nn.Module], model: str) -> None:
    named = names_of(canonicalize(models[model].named_parameters()))
    assert named["layers.1.attn.q.weight"].original == "model.layers.1.self_attn.q_proj.weight"
    leaves = ("attn.q", "attn.k", "attn.v", "attn.o", "attn_norm", "mlp_norm")
    shared = {"embed.weight", "final_norm.weight", "head.weight"}
    shared |= {f"layers.{i}.{leaf}.weight" for i in range(LAYERS) for leaf in leaves}
    assert shared <= named.keys()


def test_same_logical_tensors_in_hf_llama_and_torchtitan(models: dict[str, torch.nn.Module]) -> None:
    hf = canonicalize(models["llama"].named_parameters())
    titan = LISTS["torchtitan"]["llama3"]
    assert sorted(entry.name for entry in hf) == sorted(canonical for _, canonical in titan)
    assert canonical_name("layers.1.attention.wq.weight").name == "layers.1.attn.q.weight"


def test_same_logical_tensors_in_gpt2_and_megatron(models: dict[str, torch.nn.Module]) -> None:
    gpt2 = canonicalize(models["gpt2"].named_parameters(remove_duplicate=False))
    megatron = canonicalize(on_meta(LISTS["megatron"]["gpt2-like"]))
    assert sorted(entry.name for entry in gpt2) == sorted(entry.name for entry in megatron)
    gpt2_qkv = names_of(gpt2)["layers.1.attn.qkv.weight"]
    megatron_qkv = names_of(megatron)["layers.1.attn.qkv.weight"]
    assert (gpt2_qkv.original, gpt2_qkv.transposed) == ("transformer.h.1.attn.c_attn.weight", True)
    assert megatron_qkv.original == "decoder.layers.1.self_attention.linear_qkv.weight"
    assert not megatron_qkv.transposed
    assert megatron_qkv.component == gpt2_qkv.component == "attn.qkv"


def test_expert_2_up_projection_of_layer_1_in_every_layout(models: dict[str, torch.nn.Module]) -> None:
    want = "layers.1.moe.experts.2.up.weight"
    for model in ("mixtral", "qwen2-moe"):
        entry = names_of(canonicalize(models[model].named_parameters(), split_stacked=True))[want]
        assert entry.original == "model.layers.1.mlp.experts.gate_up_proj"
        assert (entry.layer, entry.expert, entry.part) == (1, 2, 1)
        assert entry.component == "moe.experts.up"
        assert entry.family == "layers.*.moe.experts.*.up.weight"
    assert canonical_name("model.layers.1.block_sparse_moe.experts.2.w3.weight").name == want
    assert canonical_name("model.layers.1.mlp.experts.2.up_proj.weight").name == want
    titan = [("layers.1.moe.experts.w3", torch.empty(EXPERTS, FFN, HIDDEN, device="meta"))]
    assert names_of(canonicalize(titan, split_stacked=True))[want].expert == 2
    for original in (
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.linear_fc1.weight2",
    ):
        entry = canonical_name(original)
        assert (entry.name, entry.layer, entry.expert) == ("layers.1.moe.experts.2.fc1.weight", 1, 2)


def test_stacked_experts_are_one_entry_unless_split(models: dict[str, torch.nn.Module]) -> None:
    whole = names_of(canonicalize(models["mixtral"].named_parameters()))
    gate_up = whole["layers.1.moe.experts.gate_up.weight"]
    assert (gate_up.expert, gate_up.expert_dim, gate_up.region) == (None, 0, ())
    assert gate_up.family == "layers.*.moe.experts.gate_up.weight"
    split = canonicalize(models["mixtral"].named_parameters(), split_stacked=True)
    layer_1 = [entry.name for entry in split if entry.original == "model.layers.1.mlp.experts.gate_up_proj"]
    assert layer_1 == [f"layers.1.moe.experts.{e}.{part}.weight" for e in range(EXPERTS) for part in ("gate", "up")]
    down = names_of(split)["layers.1.moe.experts.3.down.weight"]
    assert (down.part, down.region) == (None, ((0, 3, 4),))


@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe"])
def test_expert_slices_are_the_weights_the_model_computes_with(models: dict[str, torch.nn.Module], model: str) -> None:
    experts = models[model].model.layers[1].mlp.experts
    stored = dict(models[model].named_parameters())
    named = names_of(canonicalize(stored.items(), split_stacked=True))

    def logical(name: str) -> torch.Tensor:
        entry = named[name]
        return entry.view(stored[entry.original])

    x = torch.randn(5, HIDDEN)
    route = torch.full((5, 1), 2)
    with torch.no_grad():
        got = experts(x, route, torch.ones(5, 1))
        gate = logical("layers.1.moe.experts.2.gate.weight")
        up = logical("layers.1.moe.experts.2.up.weight")
        down = logical("layers.1.moe.experts.2.down.weight")
        want = torch.nn.functional.linear(experts.act_fn(x @ gate.T) * (x @ up.T), down)
    assert gate.shape == up.shape == (experts.gate_up_proj.shape[1] // 2, HIDDEN)
    torch.testing.assert_close(got, want)


def test_gpt2_conv1d_weights_are_viewed_in_linear_orientation(models: dict[str, torch.nn.Module]) -> None:
    block = models["gpt2"].transformer.h[1]
    stored = dict(models["gpt2"].named_parameters())
    named = names_of(canonicalize(stored.items()))
    x = torch.randn(3, HIDDEN)
    for canonical, module in (("layers.1.attn.qkv", block.attn.c_attn), ("layers.1.mlp.fc1", block.mlp.c_fc)):
        weight, bias = named[f"{canonical}.weight"], named[f"{canonical}.bias"]
        assert weight.transposed and not bias.transposed
        logical = weight.view(stored[weight.original])
        assert logical.shape == (module.nf, HIDDEN)
        with torch.no_grad():
            torch.testing.assert_close(torch.nn.functional.linear(x, logical, stored[bias.original]), module(x))


def test_phi3_fused_gate_up_splits_into_gate_and_up(models: dict[str, torch.nn.Module]) -> None:
    mlp = models["phi3"].model.layers[0].mlp
    stored = dict(models["phi3"].named_parameters())
    named = names_of(canonicalize(stored.items(), split_stacked=True))
    gate, up, down = (named[f"layers.0.mlp.{p}.weight"] for p in ("gate", "up", "down"))
    assert (gate.part, up.part, gate.expert) == (0, 1, None)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        hidden = mlp.activation_fn(x @ gate.view(stored[gate.original]).T) * (x @ up.view(stored[up.original]).T)
        torch.testing.assert_close(hidden @ stored[down.original].T, mlp(x))
    assert "layers.0.mlp.gate_up.weight" in names_of(canonicalize(stored.items()))


def test_layer_and_expert_offsets_make_indices_global(models: dict[str, torch.nn.Module]) -> None:
    q = canonical_name("module.decoder.layers.1.self_attention.linear_qkv.weight", layer_offset=4)
    assert (q.name, q.layer, q.family) == ("layers.5.attn.qkv.weight", 5, "layers.*.attn.qkv.weight")
    expert = canonical_name(
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", layer_offset=4, expert_offset=8
    )
    assert (expert.name, expert.layer, expert.expert) == ("layers.5.moe.experts.10.fc1.weight", 5, 10)
    split = canonicalize(models["mixtral"].named_parameters(), layer_offset=4, expert_offset=8, split_stacked=True)
    up = names_of(split)["layers.5.moe.experts.10.up.weight"]
    assert (up.layer, up.expert, up.region[0]) == (5, 10, (0, 2, 3))
    assert {entry.layer for entry in split} == {None, 4, 5}
    embed = canonical_name("model.embed_tokens.weight", layer_offset=4)
    assert (embed.name, embed.layer) == ("embed.weight", None)


@pytest.mark.parametrize(
    ("original", "clean"),
    [
        ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("module.module.decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
        ("_orig_mod.module.layers.1.attention.wq.weight", "layers.1.attention.wq.weight"),
        (
            "_fsdp_wrapped_module.model.layers.3._fsdp_wrapped_module._checkpoint_wrapped_module"
            ".self_attn.q_proj.weight",
            "model.layers.3.self_attn.q_proj.weight",
        ),
        ("model.layers.0.module.weight", "model.layers.0.module.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_strip_wrappers(original: str, clean: str) -> None:
    assert strip_wrappers(original) == clean


@pytest.fixture()
def single_process_group() -> object:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_real_wrappers_do_not_change_names(single_process_group: object) -> None:
    torch.manual_seed(0)
    model = decoder(LlamaConfig)
    plain = [entry.name for entry in canonicalize(model.named_parameters())]
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = checkpoint_wrapper(layer)
    wrapped = torch.nn.parallel.DistributedDataParallel(torch.compile(model))
    originals = [name for name, _ in wrapped.named_parameters()]
    assert originals[1].startswith("module._orig_mod.model.layers.0._checkpoint_wrapped_module.")
    assert [entry.name for entry in canonicalize(wrapped.named_parameters())] == plain


def test_tied_embedding_appears_once(models: dict[str, torch.nn.Module]) -> None:
    entries = canonicalize(models["gpt2"].named_parameters(remove_duplicate=False))
    named = names_of(entries)
    assert "head.weight" not in named
    assert named["embed.weight"].original == "transformer.wte.weight"
    assert named["embed.weight"].tied == ("lm_head.weight",)
    assert len(entries) == len(list(models["gpt2"].parameters()))
    tied_llama = decoder(LlamaConfig, tie_word_embeddings=True)
    named = names_of(canonicalize(tied_llama.named_parameters(remove_duplicate=False)))
    assert named["embed.weight"].tied == ("lm_head.weight",) and "head.weight" not in named


def test_ties_are_found_through_shared_storage_but_not_between_views_of_a_buffer() -> None:
    embedding = torch.nn.Parameter(torch.randn(8, 4))
    alias = torch.nn.Parameter(embedding.data)
    assert alias is not embedding
    flat = torch.zeros(2 * 16)
    named = [
        ("tok_embeddings.weight", embedding),
        ("output.weight", alias),
        ("layers.0.attention.wq.weight", flat[:16].view(4, 4)),
        ("layers.0.attention.wk.weight", flat[16:].view(4, 4)),
        ("layers.0.attention.wv.weight", torch.zeros(0)),
        ("layers.0.attention.wo.weight", torch.zeros(0)),
    ]
    entries = canonicalize(named)
    assert [entry.name for entry in entries] == [
        "embed.weight",
        "layers.0.attn.q.weight",
        "layers.0.attn.k.weight",
        "layers.0.attn.v.weight",
        "layers.0.attn.o.weight",
    ]
    assert entries[0].tied == ("output.weight",)


def test_two_parameters_on_one_name_raise_naming_both() -> None:
    named = [
        ("module.layers.0.attention.wq.weight", torch.zeros(2)),
        ("layers.0.attention.wq.weight", torch.zeros(2)),
    ]
    with pytest.raises(ConfigError) as raised:
        canonicalize(named)
    message = str(raised.value)
    assert "'module.layers.0.attention.wq.weight'" in message and "'layers.0.attention.wq.weight'" in message
    assert "'layers.0.attn.q.weight'" in message and "layout=" in message and "rename" in message


def test_collision_from_two_roots_of_one_layout() -> None:
    with pytest.raises(ConfigError, match="'model.norm.weight' and 'norm.weight'"):
        canonicalize([("model.norm.weight", torch.zeros(2)), ("norm.weight", torch.zeros(2))], layout="hf")


@pytest.mark.parametrize(
    ("source", "section", "layout"),
    [(source, section, source) for source, sections in LISTS.items() for section in sections],
)
def test_name_lists(source: str, section: str, layout: str) -> None:
    pairs = LISTS[source][section]
    assert detect_layout(original for original, _ in pairs) == layout
    entries = canonicalize(on_meta(pairs))
    assert [(entry.original, entry.name) for entry in entries] == pairs
    assert all(entry.layout == layout or entry.layer is None for entry in entries)
    for original, canonical in pairs:
        assert canonical_name(original, layout=layout).name == canonical


def test_name_list_fields() -> None:
    named = names_of(canonicalize(on_meta(LISTS["torchtitan"]["deepseek_v3"])))
    stacked = named["layers.1.moe.experts.up.weight"]
    assert (stacked.layer, stacked.expert, stacked.expert_dim, stacked.component) == (1, None, 0, "moe.experts.up")
    assert named["layers.1.moe.router.expert_bias"].component == "moe.router"
    legacy = canonical_name("decoder.layers.1.mlp.experts.weight1")
    assert (legacy.expert, legacy.expert_dim, legacy.transposed) == (None, None, True)


def test_unknown_names_keep_their_cleaned_path() -> None:
    outside = canonical_name("module.vision_tower.blocks.0.proj.weight", layer_offset=4)
    assert (outside.name, outside.layer, outside.component, outside.family, outside.layout) == (
        "vision_tower.blocks.0.proj.weight",
        None,
        "vision_tower.blocks.0.proj",
        "vision_tower.blocks.0.proj.weight",
        None,
    )
    named = canonicalize(
        [
            ("model.layers.1.self_attn.sinks", torch.zeros(2)),
            ("model.layers.1.self_attn.q_proj.weight", torch.zeros(2)),
        ],
        layer_offset=4,
    )
    sinks = named[0]
    assert (sinks.name, sinks.layer, sinks.component, sinks.family) == (
        "layers.5.self_attn.sinks",
        5,
        "self_attn",
        "layers.*.self_attn.sinks",
    )


def test_layout_choice() -> None:
    assert KNOWN_LAYOUTS == ("hf", "hf-gpt2", "hf-gpt-oss", "hf-switch", "megatron", "torchtitan", "canonical")
    assert detect_layout(["shared.weight", "encoder.block.0.layer.1.mlp.experts.expert_2.wi.weight"]) == "hf-switch"
    assert detect_layout(["embed.weight", "layers.0.attn.q.weight", "layers.0.moe.experts.3.up.weight"]) == "canonical"
    assert detect_layout(["norm.weight", "layers.0.attention.wq.weight", "output.weight"]) == "torchtitan"
    assert detect_layout(["norm.weight"]) == "hf"
    assert detect_layout(["something.else"]) is None
    forced = canonical_name("model.layers.0.self_attn.q_proj.weight", layout="torchtitan")
    assert (forced.name, forced.layer) == ("model.layers.0.self_attn.q_proj.weight", None)
    with pytest.raises(ConfigError, match="unknown layout 'titan'.*'torchtitan'") as raised:
        canonical_name("norm.weight", layout="titan")
    assert raised.value.path == "layout"


@pytest.mark.parametrize("offsets", [{"layer_offset": -1}, {"expert_offset": -2}, {"layer_offset": 1.5}])
def test_offsets_must_be_non_negative_integers(offsets: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="need an integer >= 0") as raised:
        canonicalize([("norm.weight", torch.zeros(1))], **offsets)  # type: ignore[arg-type]
    assert raised.value.path == next(iter(offsets))


def test_split_needs_a_tensor_that_splits() -> None:
    with pytest.raises(ConfigError, match="needs at least 2 dims"):
        canonicalize([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(6))], split_stacked=True)
    with pytest.raises(ConfigError, match="must split into 2 equal pieces"):
        canonicalize([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 5, 3))], split_stacked=True)


def test_tables_speak_the_canonical_vocabulary() -> None:
    for layout in LAYOUTS.values():
        for rule in layout.rules:
            assert component_of(rule.target) in COMPONENTS, (layout.name, rule.path)
            for part in rule.parts or ("",):
                if rule.each:
                    assert component_of(rule.each.replace("{S}", part)) in COMPONENTS, (layout.name, rule.path)


def test_table_rows_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown placeholders"):
        Rule("layers.{X}.w", "layers.{X}.w")
    with pytest.raises(ValueError, match="not in the path"):
        Rule("layers.{L}.w.weight", "layers.{L}.moe.experts.{E}.up.weight")
    with pytest.raises(ValueError, match="`each` is needed"):
        Rule("layers.{L}.experts.w1", "layers.{L}.moe.experts.gate.weight", expert_dim=0)


def test_plain_blocks_get_their_layers_without_any_known_tensor_name():
    """A model of bare blocks (no embed, head or known component) is still laid out per layer."""
    names = ["emb.weight", "layers.0.fc.weight", "layers.0.fc.bias", "layers.1.fc.weight", "out.weight"]
    assert detect_layout(names) == "canonical"
    got = {c.original: (c.name, c.layer, c.family)
           for c in canonicalize([(n, torch.zeros(2)) for n in names])}
    assert got["layers.1.fc.weight"] == ("layers.1.fc.weight", 1, "layers.*.fc.weight")
    assert got["emb.weight"][1] is None and got["out.weight"][1] is None


def test_layer_metric_on_a_model_without_layers_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="is per layer, but no tensor got a layer index.*tmetrics names"):
        TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 1)])
