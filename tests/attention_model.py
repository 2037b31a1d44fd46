"""A tiny causal attention model that observes its queries and keys with ``tm.observe`` (kind
``attn_qk``), for the attention tests; its layers keep what they observed for the reference."""

from __future__ import annotations

import torch

import tmetrics_core as tm
from tmetrics_core.attention_spec import AttentionSpec

HEADS, KV_HEADS, HEAD_DIM, WIDTH = 4, 2, 8, 32


class Attention(torch.nn.Module):
    """Grouped-query attention over ``heads`` local query heads (a tensor-parallel rank's share
    when ``head_split``); scores are scaled by ``logit_scale`` (to stress the log-sum-exp)."""

    def __init__(self, *, heads: int = HEADS, kv_heads: int = KV_HEADS, head_split: bool = False,
                 logit_scale: float = 1.0, key_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.key_range = key_range
        """Keep only these key positions (a rank of a key split: ``AttentionSpec.k_positions``)."""
        self.heads, self.kv_heads, self.head_split = heads, kv_heads, head_split
        self.q = torch.nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(WIDTH, kv_heads * HEAD_DIM, bias=False)
        self.logit_scale = logit_scale
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, h: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        b, t, _ = h.shape
        q = self.q(h).view(b, t, self.heads, HEAD_DIM).transpose(1, 2) * self.logit_scale
        k = self.k(h).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q, k = q.bfloat16().float(), k.bfloat16().float()  # bf16 values: float64 scores exact
        if self.key_range is not None:
            k = k[:, :, self.key_range[0]:self.key_range[1]]
        self.seen.append((q.detach(), k.detach()))
        tm.observe(self, "qk", (q, k), kind="attn_qk", attention=spec, shard_dim=1 if self.head_split else None)
        return torch.tanh(h)  # the next layer's input does not depend on how heads are split


class Block(torch.nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = Attention(**kwargs)

    def forward(self, h: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        return self.attn(h, spec)


class AttentionModel(torch.nn.Module):
    def __init__(self, layers: int = 3, **kwargs) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(**kwargs) for _ in range(layers)])

    def forward(self, h: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        for block in self.layers:
            h = block(h, spec)
        return h


def shard_heads(full: AttentionModel, part: AttentionModel, rank: int, size: int) -> None:
    """Copy ``full``'s weights into ``part``, whose layers hold tensor-parallel rank ``rank``'s
    share of the query and key heads (Megatron's column-parallel split of the projections)."""
    with torch.no_grad():
        for whole, mine in zip(full.layers, part.layers):
            for name in ("q", "k"):
                w = getattr(whole.attn, name).weight
                getattr(mine.attn, name).weight.copy_(w.chunk(size, dim=0)[rank])


def attention_metrics(model: torch.nn.Module, **kwargs) -> tm.TensorMetrics:
    """The four attention metrics due every step."""
    from tmetrics_core.metrics.catalogue import build_metric

    names = ("layer-attn-logit-max", "layer-attn-entropy", "layer-attn-sink", "layer-attn-lse")
    return tm.TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names], **kwargs)


def table(records) -> dict[tuple[str, int, str], object]:
    """``(metric, layer, stat) -> value`` of a step's records."""
    return {(r.metric, r.layer, r.stat): r.value for r in records}
