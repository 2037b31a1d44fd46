"""The demo model: canonical names, name-seeded init, MoE routing against a per-token reference,
observation sites, stages that compose to the whole model, and config validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from tmetrics_core.demo.model import Dispatch, ModelConfig, MoE, Transformer, fixed_shape_dispatch, local_dispatch
from tmetrics_core.errors import ConfigError
from tmetrics_core.observe import observing

TINY = ModelConfig(d_model=16, n_layers=3, n_heads=2, d_ff=12, n_experts=4, top_k=2, dense_layers=(1,), seq_len=8)


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"embed.weight", "final_norm.weight", "head.weight"}
    mlp = ("gate", "up", "down") if config.activation == "swiglu" else ("fc1", "fc2")
    for i in range(config.n_layers):
        names |= {f"layers.{i}.attn_norm.weight", f"layers.{i}.mlp_norm.weight"}
        names |= {f"layers.{i}.attn.{p}.weight" for p in "qkvo"}
        if config.is_moe(i):
            names.add(f"layers.{i}.moe.router.weight")
            names |= {f"layers.{i}.moe.experts.{e}.{p}.weight" for e in range(config.n_experts) for p in mlp}
        else:
            names |= {f"layers.{i}.mlp.{p}.weight" for p in mlp}
    return names


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_parameter_names_are_canonical(activation: str) -> None:
    config = ModelConfig(d_model=16, n_layers=3, n_heads=2, d_ff=12, n_experts=4, dense_layers=(1,),
                         activation=activation)
    model = Transformer(config)
    assert {name for name, _ in model.named_parameters()} == _expected_names(config)
    assert model.layers["0"].moe.router.weight.shape == (4, 16)


def test_stage_keeps_global_names_and_values() -> None:
    full = dict(Transformer(TINY, seed=5).named_parameters())
    stage = dict(Transformer(TINY, seed=5, layers=[2], experts=[1, 3], embed=False, head=True).named_parameters())
    assert set(stage) == {n for n in full if n.startswith("layers.2.") and ".experts.0." not in n
                          and ".experts.2." not in n} | {"final_norm.weight", "head.weight"}
    for name, param in stage.items():
        assert torch.equal(param, full[name]), name


def test_init_depends_on_seed_and_scales_output_projections() -> None:
    config = ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=256)
    a = dict(Transformer(config, seed=0).named_parameters())
    b = dict(Transformer(config, seed=1).named_parameters())
    assert not torch.equal(a["layers.0.attn.q.weight"], b["layers.0.attn.q.weight"])
    assert torch.equal(a["layers.0.attn_norm.weight"], torch.ones(128))
    assert a["layers.0.attn.q.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert a["layers.0.moe.experts.0.down.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert a["layers.0.attn.o.weight"].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    # Distinct tensors get distinct draws even with equal shapes.
    assert not torch.equal(a["layers.0.attn.q.weight"], a["layers.0.attn.k.weight"])


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over all experts, top-k of logits + bias, renormalised weights."""
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    for n, token in enumerate(tokens):
        logits = moe.router.weight @ token
        probs = logits.softmax(-1)
        chosen = sorted(range(moe.n_experts), key=lambda e: -(logits[e] + moe.expert_bias[e]).item())[:moe.top_k]
        total = sum(probs[e] for e in chosen)
        out[n] = sum(probs[e] / total * moe.experts[str(e)](token) for e in chosen)
    return out.view_as(x)


@pytest.mark.parametrize("dispatch", [local_dispatch, fixed_shape_dispatch])
def test_moe_matches_per_token_reference(dispatch: Dispatch) -> None:
    torch.manual_seed(0)
    moe = Transformer(TINY, seed=2).layers["0"].moe
    moe.dispatch = dispatch
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_dispatches_give_the_same_gradients() -> None:
    x = torch.randn(3, 4, 16)
    grads = []
    for dispatch in (local_dispatch, fixed_shape_dispatch):
        moe = Transformer(TINY, seed=2).layers["0"].moe
        moe.dispatch = dispatch
        moe(x).square().sum().backward()
        grads.append({name: p.grad for name, p in moe.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_expert_bias_steers_choice_but_not_weights() -> None:
    torch.manual_seed(0)
    moe = Transformer(TINY, seed=2).layers["0"].moe
    moe.expert_bias[3] = -1e4
    x = torch.randn(4, 6, 16)
    recorder = _Recorder(kinds=frozenset({"router_topk"}))
    with torch.no_grad(), observing(recorder):
        out = moe(x)
        torch.testing.assert_close(out, _reference_moe(moe, x), rtol=1e-5, atol=1e-6)
    (indices,) = [t for _, name, t, _ in recorder.seen if name == "expert_indices"]
    assert indices.shape == (24, 2) and 3 not in indices.unique().tolist()


@dataclass
class _Recorder:
    kinds: frozenset[str]
    seen: list[tuple[torch.nn.Module, str, torch.Tensor, str]] = field(default_factory=list)

    def record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
               shard_dim: int | None) -> None:
        assert shard_dim is None
        self.seen.append((module, name, tensor.detach().clone(), kind))


def test_observation_sites_once_per_moe_layer() -> None:
    model = Transformer(TINY, seed=0)
    tokens = torch.randint(0, 256, (3, 8))
    recorder = _Recorder(kinds=frozenset({"router_logits", "router_topk"}))
    with observing(recorder):
        model(tokens)
    moes = [model.layers["0"].moe, model.layers["2"].moe]
    assert [(m, name, kind) for m, name, _, kind in recorder.seen] == [
        (moes[0], "router_logits", "router_logits"), (moes[0], "expert_indices", "router_topk"),
        (moes[1], "router_logits", "router_logits"), (moes[1], "expert_indices", "router_topk"),
    ]
    logits, indices = recorder.seen[0][2], recorder.seen[1][2]
    assert logits.shape == (24, 4) and logits.dtype == torch.float32
    assert indices.shape == (24, 2) and indices.dtype == torch.int64
    assert torch.equal(indices, logits.topk(2, dim=-1).indices)
    # Kinds nobody watches are not delivered.
    quiet = _Recorder(kinds=frozenset({"activation"}))
    with observing(quiet):
        model(tokens)
    assert quiet.seen == []


def test_stages_compose_to_the_whole_model() -> None:
    tokens = torch.randint(0, 256, (2, 8))
    whole = Transformer(TINY, seed=4)
    first = Transformer(TINY, seed=4, layers=[0, 1], head=False)
    last = Transformer(TINY, seed=4, layers=[2], embed=False)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), whole(tokens), rtol=0, atol=0)


def test_attention_is_causal() -> None:
    model = Transformer(TINY, seed=1)
    tokens = torch.randint(0, 256, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_loss_at_init_is_near_uniform() -> None:
    model = Transformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32), seed=0)
    tokens = torch.randint(0, 256, (4, 33))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)


@pytest.mark.parametrize(("kwargs", "path"), [
    ({"d_model": 10, "n_heads": 3}, "model.n_heads"),
    ({"d_model": 12, "n_heads": 4}, "model.n_heads"),  # head width 3 is odd: RoPE needs pairs
    ({"top_k": 5, "n_experts": 4}, "model.top_k"),
    ({"dense_layers": (4,), "n_layers": 4}, "model.dense_layers"),
    ({"n_layers": 0}, "model.n_layers"),
    ({"activation": "relu"}, "model.activation"),
])
def test_config_errors_name_the_field(kwargs: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.path == path
