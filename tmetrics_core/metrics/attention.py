"""Attention statistics per head from queries and keys, without a ``[T x T]`` attention matrix.

For each query ``i`` of head ``h`` the scores ``x_j`` over its visible keys (see
:class:`~tmetrics_core.attention_spec.AttentionSpec`) are summarised by four float64 numbers,
accumulated over key blocks with the online-softmax rule:

- ``m = max_j x_j`` (the query's largest logit),
- ``s = sum_j exp(x_j - m)``,
- ``t = sum_j exp(x_j - m) (x_j - m)`` (the entropy numerator, shifted by ``m``),
- ``u = sum_j exp(x_j - m) [j is the query's sink key]``.

Two summaries ``(m1, s1, t1, u1)`` and ``(m2, s2, t2, u2)`` of disjoint key sets merge exactly:
with ``M = max(m1, m2)`` and ``a_k = exp(m_k - M)``, ``s = s1 a1 + s2 a2``,
``t = (t1 + s1 (m1 - M)) a1 + (t2 + s2 (m2 - M)) a2``, ``u = u1 a1 + u2 a2`` (:func:`rescaled`:
one MAX of ``m``, then one SUM of the rescaled parts, across ranks holding other keys). Then

- log-sum-exp ``lse = m + log s``,
- entropy ``H = -sum_j p_j log p_j = log s - t / s`` (nats),
- sink mass ``p_sink = u / s``.

Scores are formed in float64 (``q`` and ``k`` cast per block) as ``(q . k) * scale``. For bf16
and fp16 inputs every product and every partial sum of ``q . k`` is exact in float64, so the
score, and the maximum, is the same bit for bit whatever the blocking (float32 inputs: within an
ulp of float64); the other values are as exact as float64 allows, whatever the logits' scale. Cost per observation: ``2 B Hq Tq Tk D`` multiply-adds in float64 (about
twice what the attention forward's ``QK^T`` does) and about ``_BLOCK_ELEMENTS`` float64 scores
of working memory (32 MiB), plus ``4 B Hq Tq`` float64 for the per-query parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from tmetrics_core.attention_spec import AttentionSpec

__all__ = ["QueryParts", "SUM_FIELDS", "head_summary", "query_parts", "rescaled"]

SUM_FIELDS = ("entropy", "lse", "sink", "queries")
"""Per-head sums over valid queries, in this order: entropy (nats), log-sum-exp, sink mass, count."""

_BLOCK_ELEMENTS = 1 << 22
"""Float64 scores per block (32 MiB): queries x keys x heads of one recompute step."""


@dataclass(frozen=True, slots=True)
class QueryParts:
    """Per-query softmax parts, float64 ``[B, Hq, Tq]`` each (see the module docstring), and
    ``counted`` (bool, same shape): the query is a real token (not padding) of this rank."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor
    u: torch.Tensor
    counted: torch.Tensor


def query_parts(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> QueryParts:
    """The parts of every query over the keys ``k`` visible to it.

    Args:
        q: ``[B, Hq, Tq, D]`` queries after RoPE, any float dtype and device.
        k: ``[B, Hkv, Tk, D]`` keys, ``Hq`` a multiple of ``Hkv``.
        spec: score function and mask.

    A query that sees no key here has ``m = -inf``, ``s = t = u = 0``.
    """
    batch, heads, tq, dim = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    if heads % kv_heads or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} do not pair as "
                         "[B, Hq, Tq, D] and [B, Hkv, Tk, D] with Hq a multiple of Hkv")
    group = heads // kv_heads
    device = q.device
    scale = spec.scale if spec.scale is not None else dim ** -0.5
    q_pos = spec.q_positions.to(device) if spec.q_positions is not None else torch.arange(tq, device=device)
    k_pos = spec.k_positions.to(device) if spec.k_positions is not None else torch.arange(tk, device=device)
    shape = (batch, kv_heads, group, tq)
    m = torch.full(shape, -math.inf, dtype=torch.float64, device=device)
    s, t = (torch.zeros(shape, dtype=torch.float64, device=device) for _ in range(2))
    counted = torch.ones(shape, dtype=torch.bool, device=device)
    structure = None if spec.mask is not None else _Structure(spec, q_pos, k_pos, batch)
    if structure is None:
        explicit = _grouped(cast(torch.Tensor, spec.mask).to(device), kv_heads, group)
        sink = _first_visible(explicit)
    else:
        explicit = None
        sink = structure.sink_index()[:, None, None, :]
        counted = counted & structure.q_valid[:, None, None, :]
    if tq == 0 or tk == 0:
        return _parts(m, s, t, torch.zeros_like(s), counted)
    # Default positions: a causal query block sees no key after its last query, a window no key
    # before its first query's window (the blocks skipped hold only invisible scores).
    ranged = structure is not None and spec.q_positions is None and spec.k_positions is None
    q_block, k_block = _blocks(batch * heads, tq, tk, square=ranged and (spec.causal or spec.window is not None))
    for q0 in range(0, tq, q_block):
        q1 = min(tq, q0 + q_block)
        first, last = 0, tk
        if ranged and spec.causal:
            last = min(tk, q1)
        if ranged and spec.window is not None:
            first = max(0, q0 - spec.window + 1)
        qs = q[:, :, q0:q1].to(torch.float64).reshape(batch, kv_heads, group, q1 - q0, dim)
        acc: tuple[torch.Tensor, ...] = (m[..., q0:q1], s[..., q0:q1], t[..., q0:q1])
        for k0 in range(first - first % k_block, last, k_block):
            k1 = min(last, k0 + k_block)
            ks = k[:, :, k0:k1].to(torch.float64).unsqueeze(2)  # [B, Hkv, 1, kb, D]
            x = (qs @ ks.transpose(-1, -2)) * scale  # [B, Hkv, g, qb, kb]
            if spec.softcap is not None:
                x = torch.tanh(x / spec.softcap) * spec.softcap
            if explicit is not None:
                block = explicit[..., q0:q1, k0:k1]
                x = torch.where(block, x, -math.inf) if block.dtype == torch.bool else x + block.to(torch.float64)
            elif structure is not None:
                visible = structure.visible(q0, q1, k0, k1)
                if visible is not None:
                    x = torch.where(visible, x, -math.inf)
            acc = _merge(acc, _block_parts(x))
        m[..., q0:q1], s[..., q0:q1], t[..., q0:q1] = acc
    x_sink = _sink_scores(q, k, sink, scale, spec, explicit)
    some = (s > 0) & torch.isfinite(x_sink)
    u = torch.where(some, torch.exp(torch.where(some, x_sink - m, 0.0)), 0.0)
    return _parts(m, s, t, u, counted)


def rescaled(parts: QueryParts, top: torch.Tensor) -> torch.Tensor:
    """``[3, B, Hq, Tq]``: ``s``, ``t``, ``u`` of ``parts`` referred to the maximum ``top``
    (the MAX of ``m`` over the ranks holding other keys of the same queries); their SUM over
    those ranks is the merged ``s``, ``t``, ``u`` (module docstring)."""
    return _rescale(parts.m, parts.s, parts.t, top, parts.u)


def head_summary(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, u: torch.Tensor,
                 counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head ``(max logit [Hq], sums [4, Hq])`` of complete per-query parts ``[B, Hq, Tq]``.

    A query counts when ``counted`` and it sees some key (``s > 0``): the max logit is the max
    of its ``m``; the sums (:data:`SUM_FIELDS`) add its entropy, log-sum-exp, sink mass and 1.
    Heads without a counted query have max ``-inf`` and zero sums.
    """
    valid = counted & (s > 0)
    safe = torch.where(valid, s, torch.ones_like(s))
    entropy = torch.log(safe) - t / safe
    lse = m + torch.log(safe)
    zero = torch.zeros_like(s)
    fields = torch.stack([torch.where(valid, entropy, zero), torch.where(valid, lse, zero),
                          torch.where(valid, u / safe, zero), valid.to(torch.float64)])
    sums = fields.sum(dim=(1, 3))  # [4, Hq]
    top = torch.where(valid, m, torch.full_like(m, -math.inf)).amax(dim=(0, 2))
    return top, sums


class _Structure:
    """The visibility of keys to queries from causal, window, padding and segments, formed per
    block (``[B or 1, 1, 1, qb, kb]``), and each query's sink key: its segment's first real token.
    ``k_positions`` must be increasing (a rank's keys in sequence order)."""

    def __init__(self, spec: AttentionSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, batch: int) -> None:
        self.spec, self.q_pos, self.k_pos = spec, q_pos, k_pos
        device = q_pos.device
        self.masked = spec.token_mask is not None or spec.segment_ids is not None
        if not self.masked:
            # One sequence per row, all real: every query counts and its sink is position 0.
            self.q_valid = torch.ones(batch, q_pos.numel(), dtype=torch.bool, device=device)
            self.sink = torch.zeros(batch, q_pos.numel(), dtype=torch.int64, device=device)
            return
        given = spec.token_mask if spec.token_mask is not None else spec.segment_ids
        assert given is not None
        valid = (spec.token_mask.to(device).bool() if spec.token_mask is not None
                 else torch.ones(given.shape, dtype=torch.bool, device=device))
        segments = (spec.segment_ids.to(device) if spec.segment_ids is not None
                    else torch.zeros(given.shape, dtype=torch.int64, device=device))
        self.q_valid, self.k_valid = valid[:, q_pos], valid[:, k_pos]
        self.q_seg, self.k_seg = segments[:, q_pos], segments[:, k_pos]
        self.sink = _segment_starts(valid, segments)[:, q_pos]

    def visible(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Bool ``[B or 1, 1, 1, qb, kb]``: key ``k0 + j`` visible to query ``q0 + i``; None when
        every key is."""
        spec = self.spec
        qp, kp = self.q_pos[q0:q1, None], self.k_pos[None, k0:k1]
        ok = None
        if self.masked:
            ok = self.k_valid[:, None, k0:k1] & (self.q_seg[:, q0:q1, None] == self.k_seg[:, None, k0:k1])
        if spec.causal:
            ok = (kp <= qp) if ok is None else ok & (kp <= qp)
        if spec.window is not None:
            ok = (qp - kp < spec.window) if ok is None else ok & (qp - kp < spec.window)
        if ok is None:
            return None
        return (ok if ok.dim() == 3 else ok.unsqueeze(0))[:, None, None]

    def sink_index(self) -> torch.Tensor:
        """``[B, Tq]``: the local index of each query's sink key, ``-1`` where this rank does not
        hold it or the query cannot see it (outside its window, after it under causal)."""
        k_pos, q_pos, sink = self.k_pos, self.q_pos, self.sink
        index = torch.searchsorted(k_pos, sink).clamp(max=max(k_pos.numel() - 1, 0))
        held = (k_pos[index] == sink) if k_pos.numel() else torch.zeros_like(sink, dtype=torch.bool)
        if self.spec.causal:
            held = held & (sink <= q_pos)
        if self.spec.window is not None:
            held = held & (q_pos - sink < self.spec.window)
        return torch.where(held, index, -1)


def _segment_starts(valid: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: for each position, the first real token's position in its segment (a run of
    equal segment ids), ``T`` when the segment has none."""
    batch, span = valid.shape
    pos = torch.arange(span, device=valid.device).expand(batch, span)
    new = torch.ones_like(valid)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    run = new.long().cumsum(dim=1) - 1
    first = torch.full((batch, span), span, dtype=torch.int64, device=valid.device)
    first.scatter_reduce_(1, run, torch.where(valid, pos, span), reduce="amin")
    return first.gather(1, run)


def _grouped(mask: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """An SDPA mask ``[B|1, Hq|1, Tq, Tk]`` as ``[B|1, Hkv|1, g|1, Tq, Tk]`` (a view)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def _first_visible(mask: torch.Tensor) -> torch.Tensor:
    """Each query's first visible key index of an explicit mask (``-1`` when none)."""
    visible = mask if mask.dtype == torch.bool else mask > -math.inf
    first = visible.to(torch.uint8).argmax(dim=-1)
    return torch.where(visible.any(dim=-1), first, torch.full_like(first, -1))


def _blocks(heads: int, tq: int, tk: int, *, square: bool) -> tuple[int, int]:
    """Query and key block lengths of about ``_BLOCK_ELEMENTS`` scores: whole key rows while
    they fit, else square blocks (and square ones where blocks of invisible keys are skipped)."""
    per_head = max(1, _BLOCK_ELEMENTS // max(1, heads))
    k_block = max(1, min(tk, math.isqrt(per_head) if square else per_head))
    q_block = max(1, min(tq, per_head // k_block))
    return q_block, k_block


def _block_parts(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(m, s, t)`` of one block of scores ``[..., qb, kb]`` (``-inf``: invisible)."""
    m = x.amax(dim=-1)
    e = torch.exp(x - torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1))  # 0 where invisible
    # e log e = e (x - m), and 0 where e is 0: one pass, no 0 * -inf.
    return m, e.sum(dim=-1), -torch.special.entr(e).sum(dim=-1)


def _merge(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    top = torch.maximum(a[0], b[0])
    ra, rb = _rescale(a[0], a[1], a[2], top), _rescale(b[0], b[1], b[2], top)
    return (top, *(ra + rb).unbind(0))


def _rescale(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, top: torch.Tensor, *linear: torch.Tensor
             ) -> torch.Tensor:
    """``[2 + len(linear), ...]``: ``(s a, (t + s d) a, *(l a))`` with ``d = m - top``,
    ``a = exp(d)``; zeros where this part saw no key (``s == 0``)."""
    some = s > 0
    d = torch.where(some, m - torch.where(some, top, 0.0), 0.0)
    a = torch.where(some, torch.exp(d), 0.0)
    return torch.stack([s * a, (t + s * d) * a, *(x * a for x in linear)])


def _sink_scores(q: torch.Tensor, k: torch.Tensor, sink: torch.Tensor, scale: float, spec: AttentionSpec,
                 explicit: torch.Tensor | None) -> torch.Tensor:
    """``[B, Hkv, g, Tq]``: each query's score with its sink key (local index ``sink``,
    broadcastable to that shape; ``-1``: not held here or not visible), ``-inf`` where none."""
    batch, heads, tq, dim = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    group = heads // kv_heads
    shape = (batch, kv_heads, group, tq)
    index = sink.expand(shape)
    held = index >= 0
    safe = index.clamp(min=0)
    keys = k.to(torch.float64).unsqueeze(2).expand(batch, kv_heads, group, tk, dim)
    chosen = keys.gather(3, safe.unsqueeze(-1).expand(*shape, dim))
    x = (q.to(torch.float64).reshape(batch, kv_heads, group, tq, dim) * chosen).sum(dim=-1) * scale
    if spec.softcap is not None:
        x = torch.tanh(x / spec.softcap) * spec.softcap
    if explicit is not None and explicit.dtype != torch.bool:
        x = x + explicit.expand(*shape, tk).gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(torch.float64)
    return torch.where(held, x, -math.inf)


def _parts(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, u: torch.Tensor, counted: torch.Tensor) -> QueryParts:
    """Grouped ``[B, Hkv, g, Tq]`` tensors as ``[B, Hq, Tq]`` (query head ``h = kv * g + j``)."""
    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])
    return QueryParts(flat(m), flat(s), flat(t), flat(u), flat(counted.expand(m.shape)))
