"""A small MoE model for the deferred-observation tests: residual layers whose ``moe`` block
observes its router logits, top-k choices and (optionally) scores, and a replay that gives the
full tensors each observation saw, so metrics can be checked against formulas on them.

``Model(layers, experts, top_k, scores=..., inplace=...)``: input ``[batch, seq, D]`` float32
(or bfloat16), output of the same shape; ``forward(x, mask=None)`` observes ``mask``
``[batch, seq]`` as the token mask first. ``scores``: None, ``"softmax"`` or ``"sigmoid"``
(DeepSeek-V3 style) router scores observed besides the logits. ``inplace`` scales the logits
in place after they were observed (a model that must not be supported silently).
"""

from __future__ import annotations

import math

import torch

from tmetrics_core.observe import observe
from tmetrics_core.sources.tokens import TokenObserver

_FOLLOW = TokenObserver._follow
"""The unpatched route followers (see :func:`count_routes`)."""

__all__ = ["D", "Model", "Observed", "replay", "row_entropy", "token_rows"]

D = 6


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


class MoE(torch.nn.Module):
    def __init__(self, experts: int, top_k: int, scores: str | None, inplace: bool) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, experts, bias=False)
        self.experts = torch.nn.ModuleList([Expert() for _ in range(experts)])
        self.top_k, self.scores, self.inplace = top_k, scores, inplace

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, D)                                           # (N, D)
        logits = self.router(tokens)                                        # (N, E)
        observe(self, "router_logits", logits, kind="router_logits")
        topk = logits.topk(self.top_k, dim=-1).indices                      # (N, k)
        observe(self, "expert_indices", topk, kind="router_topk")
        probs = logits.softmax(dim=-1)
        if self.scores is not None:
            scores = probs if self.scores == "softmax" else logits.sigmoid()
            observe(self, "router_scores", scores, kind="router_scores")
        if self.inplace:
            with torch.no_grad():
                logits.mul_(100.0)
        weights = torch.zeros_like(probs).scatter(-1, topk, probs.gather(-1, topk))  # (N, E)
        out = sum(expert(tokens) * weights[:, e:e + 1] for e, expert in enumerate(self.experts))
        return out.view_as(h)


class Layer(torch.nn.Module):
    def __init__(self, experts: int, top_k: int, scores: str | None, inplace: bool) -> None:
        super().__init__()
        self.moe = MoE(experts, top_k, scores, inplace)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class Model(torch.nn.Module):
    def __init__(self, layers: int = 2, experts: int = 4, top_k: int = 2, *, scores: str | None = None,
                 inplace: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([Layer(experts, top_k, scores, inplace) for _ in range(layers)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            observe(self, "token_mask", mask, kind="token_mask")
        for layer in self.layers:
            x = layer(x)
        return x


class Observed:
    """Per layer, the rows every observation saw (padding removed), over all micro-batches."""

    def __init__(self) -> None:
        self.stream: dict[int, list[torch.Tensor]] = {}
        self.contribution: dict[int, list[torch.Tensor]] = {}
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.topk: dict[int, list[torch.Tensor]] = {}

    def cat(self, part: dict[int, list[torch.Tensor]], layer: int) -> torch.Tensor:
        return torch.cat(part[layer])


def token_rows(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[tokens, features]`` rows of ``t`` without the padding tokens of ``mask``."""
    rows = t.reshape(-1, t.shape[-1])
    return rows[mask.reshape(-1)] if mask is not None else rows


@torch.no_grad()
def replay(model: Model, xs: list[torch.Tensor], masks: list[torch.Tensor | None]) -> Observed:
    """Run the micro-batches again without metrics, keeping the full tensors (float64 copies
    of what each site saw, the residual contribution as ``h - x`` of the exact values)."""
    seen = Observed()
    for x, mask in zip(xs, masks):
        h = x
        for i, layer in enumerate(model.layers):
            moe = layer.moe
            logits = moe.router(h.reshape(-1, D))
            out = layer(h)
            seen.logits.setdefault(i, []).append(token_rows(logits, mask).double())
            seen.topk.setdefault(i, []).append(token_rows(logits.topk(moe.top_k, dim=-1).indices, mask))
            seen.stream.setdefault(i, []).append(token_rows(out, mask).double())
            seen.contribution.setdefault(i, []).append(token_rows(out.double() - h.double(), mask))
            h = out
    return seen


def row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-row normalized softmax entropy ``H / log E`` of float64 logits."""
    p = logits.softmax(dim=-1)
    return -(p * p.log()).nansum(dim=-1) / math.log(logits.shape[-1])


def count_routes(monkeypatch, follow: bool) -> list[int]:
    """Patch ``TokenObserver._follow`` to count the routes taken (``follow``) or to send every
    observation down the general path (not ``follow``); returns the one-element counter. Safe to
    call twice in one test: it wraps the unpatched method."""
    taken = [0]

    def counted(self, route, tensor, minus):
        done = follow and _FOLLOW(self, route, tensor, minus)
        taken[0] += done
        return done

    monkeypatch.setattr(TokenObserver, "_follow", counted)
    return taken
