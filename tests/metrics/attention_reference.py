"""The float64 materialised reference of the attention statistics: the whole ``[T x T]``
softmax per head, for tests only."""

from __future__ import annotations

import math

import torch


def reference_table(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor, *,
                    scale: float, softcap: float | None = None, counted: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    """Per-head ``max`` (logit), mean ``entropy``, ``lse`` and ``sink`` mass over counted queries.

    Args:
        q: ``[B, Hq, Tq, D]``; k: ``[B, Hkv, Tk, D]``.
        visible: bool ``[B, 1 or Hq, Tq, Tk]``.
        sink: int64 ``[B, Tq]``, the sink key index of each query (-1: none).
        counted: bool ``[B, Tq]``: queries that count (those seeing some key among them).
    """
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    x = (q.double() @ kk.transpose(-1, -2)) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    vis = visible.expand(x.shape)
    x = x.masked_fill(~vis, -math.inf)
    p = torch.softmax(x, dim=-1)
    sees = vis.any(dim=-1)
    if counted is not None:
        sees = sees & counted[:, None, :]
    p = torch.where(sees[..., None], p, torch.zeros_like(p))
    entropy = -(torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))).sum(-1)
    lse = torch.logsumexp(x, dim=-1)
    idx = sink.clamp(min=0)[:, None, :, None].expand(x.shape[0], x.shape[1], -1, 1)
    sink_p = torch.where(sink[:, None, :, None] >= 0, p.gather(-1, idx), torch.zeros_like(idx, dtype=p.dtype))[..., 0]
    n = sees.double().sum(dim=(0, 2))

    def mean(v: torch.Tensor) -> torch.Tensor:
        return torch.where(sees, v, torch.zeros_like(v)).sum(dim=(0, 2)) / n

    top = torch.where(sees[..., None], x, torch.full_like(x, -math.inf)).amax(dim=(0, 2, 3))
    return {"max": top, "entropy": mean(entropy), "lse": mean(lse), "sink": mean(sink_p), "queries": n}


def structured_visible(batch: int, tq: int, tk: int, *, causal: bool = False, window: int | None = None,
                       token_mask: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                       q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(visible [B, 1, Tq, Tk], sink [B, Tq] as key index, counted [B, Tq])`` from the
    structure, written plainly (loops over positions) as a second derivation of the masks."""
    qp = torch.arange(tq) if q_pos is None else q_pos
    kp = torch.arange(tk) if k_pos is None else k_pos
    span = int(max(qp.max(), kp.max())) + 1
    valid = torch.ones(batch, span, dtype=torch.bool) if token_mask is None else token_mask.bool()
    seg = torch.zeros(batch, span, dtype=torch.int64) if segments is None else segments
    visible = torch.zeros(batch, 1, tq, tk, dtype=torch.bool)
    sink = torch.full((batch, tq), -1, dtype=torch.int64)
    for b in range(batch):
        for i in range(tq):
            pi = int(qp[i])
            start = pi
            while start > 0 and seg[b, start - 1] == seg[b, pi]:
                start -= 1
            end = start
            while end < span and not (seg[b, end] == seg[b, pi] and valid[b, end]):
                end += 1
            for j in range(tk):
                pj = int(kp[j])
                ok = bool(valid[b, pj]) and seg[b, pj] == seg[b, pi]
                ok = ok and (not causal or pj <= pi) and (window is None or pi - pj < window)
                visible[b, 0, i, j] = ok
                if pj == end:
                    sink[b, i] = j
    counted = valid[:, qp]
    return visible, sink, counted
