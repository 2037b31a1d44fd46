"""The demo model: a small byte-level decoder-only transformer with mixture-of-experts MLPs.

Module paths are the canonical tensor names (tmetrics_core.naming.canonical), so ``named_parameters()``
of the unwrapped model yields ``embed.weight``, ``layers.{i}.attn_norm.weight``,
``layers.{i}.attn.{q,k,v,o}.weight``, ``layers.{i}.mlp_norm.weight``,
``layers.{i}.moe.router.weight``, ``layers.{i}.moe.experts.{e}.{gate,up,down}.weight`` (or
``layers.{i}.mlp.{gate,up,down}.weight`` for dense blocks; ``fc1``/``fc2`` with GELU),
``final_norm.weight`` and ``head.weight``. ``layers`` and ``experts`` are ``nn.ModuleDict``s
keyed by the GLOBAL index, so a pipeline stage that holds layers 2 and 3, or an expert-parallel
rank that holds experts 4..7, keeps the global names.

Initialisation draws every tensor from its own generator seeded by ``(seed, canonical name)``:
the values do not depend on construction order or on which layers and experts a rank builds,
so every topology starts from the same parameters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.errors import ConfigError
from tmetrics_core.observe import observe

__all__ = [
    "Attention",
    "Block",
    "Dispatch",
    "MLP",
    "ModelConfig",
    "MoE",
    "Transformer",
    "fixed_shape_dispatch",
    "local_dispatch",
]


_CAUSAL = AttentionSpec(causal=True)
"""The attention's mask, for its ``attn_qk`` observation (the attention metrics)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the demo transformer. Defaults train in a few minutes on 2 CPU cores."""

    vocab_size: int = 256
    """Tokens are bytes, so 256."""
    d_model: int = 128
    """Width of the residual stream (features per token)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; ``d_model`` must be a multiple. Head width is ``d_model / n_heads``."""
    d_ff: int = 256
    """Hidden width of each expert MLP (and of dense MLPs)."""
    n_experts: int = 4
    """Experts per MoE block."""
    top_k: int = 2
    """Experts each token is routed to (1 <= top_k <= n_experts)."""
    dense_layers: tuple[int, ...] = ()
    """Global indices of blocks with a dense MLP instead of an MoE layer."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP form: SwiGLU (``gate``, ``up``, ``down``) or GELU (``fc1``, ``fc2``)."""
    seq_len: int = 128
    """Tokens per training sequence; RoPE positions run 0..seq_len-1."""
    rope_base: float = 10000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    init_std: float = 0.02
    """Standard deviation of weight initialisation; output projections use init_std / sqrt(2 n_layers)."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "n_experts", "seq_len"):
            if getattr(self, field) < 1:
                raise ConfigError(f"got {getattr(self, field)}; need >= 1", path=f"model.{field}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}",
                              path="model.n_heads")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"head width {self.d_model // self.n_heads} must be even for RoPE",
                              path="model.n_heads")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"got {self.top_k}; need 1 <= top_k <= n_experts ({self.n_experts})",
                              path="model.top_k")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"layers {bad} do not exist; valid 0..{self.n_layers - 1}",
                              path="model.dense_layers")
        if self.activation not in ("swiglu", "gelu"):
            raise ConfigError(f"got {self.activation!r}; valid: 'swiglu', 'gelu'", path="model.activation")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (global index) has an MoE MLP."""
        return layer not in self.dense_layers


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Apply rotary position embedding to ``x`` [B, H, T, hd] (pairs are the two halves of hd)."""
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)      # (hd/2,)
    angles = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE; separate ``q``, ``k``, ``v``, ``o`` projections.

    Under tensor parallelism ``q``/``k``/``v`` are column-split and ``o`` row-split, so each rank
    holds ``n_heads / tp`` whole heads; the head count is read from the local projection width.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.rope_base = config.rope_base
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.heads_split = False
        """Whether ``q``, ``k`` are column-split over ``tp`` (set by the demo's tensor parallelism)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, d] float -> [B, T, d]."""
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)   # (B, H_local, T, hd)
                   for proj in (self.q, self.k, self.v))
        q, k = _rotate(q, self.rope_base), _rotate(k, self.rope_base)
        observe(self, "qk", (q, k), kind="attn_qk", attention=_CAUSAL, shard_dim=1 if self.heads_split else None)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, H_local, T, hd)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Feed-forward network: SwiGLU ``down(silu(gate(x)) * up(x))`` or GELU ``fc2(gelu(fc1(x)))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h = config.d_model, config.d_ff
        self.swiglu = config.activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(d, h, bias=False)
            self.up = nn.Linear(d, h, bias=False)
            self.down = nn.Linear(h, d, bias=False)
        else:
            self.fc1 = nn.Linear(d, h, bias=False)
            self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., d] -> [..., d]."""
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.fc2(F.gelu(self.fc1(x)))


Dispatch = Callable[["MoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``dispatch(moe, tokens [N, d], topk_idx [N, k] int64, weights [N, k] float32) -> [N, d]``.

Routes each token to its experts and returns the weighted sum of their outputs. The default,
:func:`local_dispatch`, assumes every expert is local; expert parallelism installs one that
moves tokens between ranks (``tmetrics_core.demo.parallel``)."""


def local_dispatch(moe: MoE, tokens: torch.Tensor, topk_idx: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Dispatch when this rank holds every expert: each expert runs on its routed tokens."""
    return moe.expert_outputs(tokens, topk_idx, weights)


def fixed_shape_dispatch(moe: MoE, tokens: torch.Tensor, topk_idx: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """Dispatch for tensor-parallel experts: each expert runs on all tokens, unrouted ones at weight 0."""
    return moe.expert_outputs(tokens, topk_idx, weights, fixed_shapes=True)


class MoE(nn.Module):
    """Top-k mixture of experts: router ``nn.Linear(d, E, bias=False)`` and E MLP experts.

    Gate weights are the softmax probabilities of the chosen experts, renormalised to sum to 1
    per token (Mixtral's rule). Selection uses ``logits + expert_bias``; the buffer
    ``expert_bias`` [E] (zeros) biases the choice without entering the gate weights, as in
    DeepSeek-V3's auxiliary-loss-free balancing; the demo's dead-expert injection sets one entry
    very negative. No load-balancing loss is added.

    ``experts`` holds the experts this rank owns, keyed by global index; every expert is run on
    every step (on zero tokens if none was routed to it), so every expert parameter receives a
    gradient (possibly zero) and all ranks take part in the same collectives.

    Observation sites, once per forward: ``router_logits`` (kind ``router_logits``, [N, E]
    float32, N = local tokens) and ``expert_indices`` (kind ``router_topk``, [N, k] int64, global
    expert indices), both for this rank's own tokens.
    """

    expert_bias: torch.Tensor
    """Buffer [E] (registered in ``__init__``): added to the logits for the top-k choice only."""

    def __init__(self, config: ModelConfig, *, experts: Iterable[int] | None = None) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.n_experts = config.n_experts
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        owned = range(config.n_experts) if experts is None else experts
        self.experts = nn.ModuleDict({str(e): MLP(config) for e in owned})
        self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        self.dispatch: Dispatch = local_dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, d] -> [B, T, d]."""
        tokens = x.reshape(-1, x.shape[-1])                                    # (N, d)
        logits = self.router(tokens).float()                                  # (N, E)
        observe(self, "router_logits", logits, kind="router_logits", shard_dim=None)
        topk_idx = (logits + self.expert_bias).topk(self.top_k, dim=-1).indices  # (N, k)
        observe(self, "expert_indices", topk_idx, kind="router_topk", shard_dim=None)
        weights = logits.softmax(dim=-1).gather(-1, topk_idx)                  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.dispatch(self, tokens, topk_idx, weights.to(tokens.dtype)).view_as(x)

    def expert_outputs(self, tokens: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, *,
                       fixed_shapes: bool = False) -> torch.Tensor:
        """Sum over the LOCAL experts of ``weight * expert(token)`` for the tokens routed to them.

        ``tokens`` [N, d], ``topk_idx`` [N, k] (global expert indices), ``weights`` [N, k];
        returns [N, d], zero rows for tokens none of whose experts is local. With
        ``fixed_shapes`` every expert runs on all N tokens and unrouted tokens get weight 0
        (the same sums, E/k times the work, but shapes that do not change between steps, which
        DTensor's sharding cache needs).
        """
        out = torch.zeros_like(tokens)
        for key, expert in self.experts.items():
            routed = topk_idx == int(key)                                      # (N, k)
            if fixed_shapes:
                gate = (weights * routed).sum(dim=-1, keepdim=True)            # (N, 1)
                out = out + expert(tokens) * gate
                continue
            rows, slots = routed.nonzero(as_tuple=True)
            y = expert(tokens.index_select(0, rows)) * weights[rows, slots].unsqueeze(-1)
            out = out.index_add(0, rows, y)
        return out


class Block(nn.Module):
    """Pre-norm block: ``h + attn(attn_norm(h))`` then ``h + mlp(mlp_norm(h))`` (MoE or dense)."""

    def __init__(self, config: ModelConfig, layer: int, *, experts: Iterable[int] | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        if config.is_moe(layer):
            self.moe = MoE(config, experts=experts)
        else:
            self.mlp = MLP(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` [B, T, d] -> [B, T, d]."""
        h = h + self.attn(self.attn_norm(h))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return h + ffn(self.mlp_norm(h))


class Transformer(nn.Module):
    """The demo model, or one pipeline stage of it.

    Args:
        config: the model shape.
        seed: initialisation seed; each tensor's values depend only on ``(seed, its name)``.
        layers: global indices of the blocks this stage holds (default: all).
        experts: global indices of the experts each MoE block holds (default: all).
        embed: whether this stage holds ``embed`` (takes token ids [B, T] int64).
        head: whether this stage holds ``final_norm`` and ``head`` (returns logits [B, T, 256]).

    A stage without ``embed`` takes hidden states [B, T, d]; one without ``head`` returns them.
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0, layers: Iterable[int] | None = None,
                 experts: Iterable[int] | None = None, embed: bool = True, head: bool = True) -> None:
        super().__init__()
        self.config = config
        owned_experts = None if experts is None else tuple(experts)
        if embed:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({
            str(i): Block(config, i, experts=owned_experts)
            for i in (range(config.n_layers) if layers is None else layers)
        })
        if head:
            self.final_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Re-draw every parameter from a generator seeded by ``(seed, canonical name)``.

        Norm weights are ones; ``attn.o`` and MLP output projections (``down``, ``fc2``) are
        normal(0, init_std / sqrt(2 n_layers)) (GPT-2's residual scaling); everything else is
        normal(0, init_std).
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            leaf = name.rsplit(".", 2)[-2]
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(values * (out_std if leaf in ("o", "down", "fc2") else std))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] (first stage) or hidden [B, T, d] -> logits [B, T, V] or hidden."""
        h = self.embed(inputs) if hasattr(self, "embed") else inputs
        for block in self.layers.values():
            h = block(h)
        if hasattr(self, "head"):
            return self.head(self.final_norm(h))
        return h
