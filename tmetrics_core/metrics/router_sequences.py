"""The per-sequence router statistics that the diagnostic families
(:mod:`~tmetrics_core.metrics.router_families`) report, computed on the device in one pass per
layer, and their reduced vectors read back by name.

For each sequence ``g`` of a layer, with ``u = 1/E``:

- ``s`` = mean score row over the sequence's tokens (rows normalized to sum 1, so sigmoid
  routers are read as DeepSeek-V3's sequence-wise aux loss reads them);
- ``a`` = share of the sequence's *unbiased* top-k assignments (top-k of the scores, k the width
  of ``router_topk``) per expert; ``c`` = share of its dispatched assignments (``router_topk``);
- ``seq_aux_loss = E sum_i a_i s_i`` (Switch Transformer's balance loss, per sequence; 1 when
  balanced), ``aux_load_imbalance = E sum (a_i - u)^2`` and ``score_imbalance = E sum (s_i - u)^2``
  (0 when balanced), ``imbalance_coupling = E sum (a_i - u)(s_i - u)`` (so the loss is
  ``1 + coupling``), ``imbalance_alignment`` = cosine of ``a - u`` and ``s - u`` (0 if either is 0),
  ``actual_load_imbalance = E sum (c_i - u)^2``, ``aux_actual_tv = 1/2 sum |a_i - c_i|``,
  ``aux_actual_overlap`` = share of unbiased assignments that were dispatched,
  ``aux_max_over_mean = E max a``, ``actual_max_over_mean = E max c``,
  ``actual_inactive_fraction`` = share of experts with no dispatched token,
  ``topk_boundary_relative_margin`` = mean over tokens of ``max(0, lowest chosen score - highest
  other score) / lowest chosen score`` (0 when k = 0 or k = E);
- bias statistics: mean, population std, RMS, range, max |b|, and Pearson correlations of ``b``
  with ``s``, ``a`` and ``c`` across experts (0 when either side is constant).

Sequences: a ``router_topk`` site with ``Site.meta`` entry ``("seq_len", L)`` holds whole
sequences of ``L`` tokens, row-major; sequences may be spread over ``dp`` ranks in any way, each
whole on one rank. Without it (ragged sequences after padding removal), each observation (one
micro-batch on one rank) counts as one sequence: per-sequence values are then micro-batch values
and depend on how tokens are split across ranks; ``global`` values never do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from tmetrics_core.metrics.router import site_experts
from tmetrics_core.metrics.statistics import Statistic, flagged_value, neutral

__all__ = [
    "BIAS_FIELDS",
    "ROUTER_EXTREMES",
    "ROUTER_SUMS",
    "SEQUENCE_FIELDS",
    "LayerSummary",
    "RouterOp",
    "layer_summary",
]

SEQUENCE_FIELDS = (
    "seq_aux_loss", "aux_load_imbalance", "score_imbalance", "imbalance_coupling",
    "imbalance_alignment", "actual_load_imbalance", "aux_actual_tv", "aux_actual_overlap",
    "aux_max_over_mean", "actual_max_over_mean", "actual_inactive_fraction",
    "topk_boundary_relative_margin", "bias_mean", "bias_std", "bias_rms", "bias_range",
    "bias_abs_max", "bias_score_correlation", "bias_aux_load_correlation",
    "bias_actual_load_correlation",
)
"""Per-sequence statistics, summed over sequences in the first entries of the sums vector."""

_EXTREMES = ("seq_aux_loss", "actual_load_imbalance", "-aux_actual_overlap")
_EXTREMES_SIZE = 2 * len(_EXTREMES)
_COUNTS = ("sequences", "bias_sequences", "tokens")
BIAS_FIELDS = SEQUENCE_FIELDS[12:]
_MARGIN_EPS = float(torch.finfo(torch.float32).eps)


class _RouterSums(Statistic):
    """Per layer: sums over sequences of :data:`SEQUENCE_FIELDS`, the sequence, biased-sequence
    and token counts, then summed scores, unbiased and dispatched assignment counts (E each).
    Computed jointly with :class:`_RouterExtremes` by :func:`layer_summary`."""

    name, op = "router_sums", "sum"

    def size(self, site):
        return len(SEQUENCE_FIELDS) + len(_COUNTS) + 3 * site_experts(site)


class _RouterExtremes(Statistic):
    """Per layer: max over sequences of the loss and the dispatched imbalance, and ``-min`` of
    the top-k overlap, then one NaN flag per extreme: ``[x_1, x_2, x_3, f_1, f_2, f_3]``.

    An extreme that is NaN (a NaN score reaches the loss) is carried as ``x = -inf, f = 1``,
    reduced with MAX like the values, so every rank reports NaN however the reduction orders
    the ranks (NOTE [NaN under MAX] in :mod:`~tmetrics_core.metrics.statistics`)."""

    name, op = "router_extremes", "max"

    def size(self, site):
        return _EXTREMES_SIZE


ROUTER_SUMS = _RouterSums()
ROUTER_EXTREMES = _RouterExtremes()


def layer_summary(probs: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None,
                  seq_len: int | None, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums and extremes vectors of one layer's local observation (float64; the
    layouts of :class:`_RouterSums` and :class:`_RouterExtremes`, extremes NaN-flagged).

    Args:
        probs: ``[T, E]`` routing probabilities (rows sum to 1).
        ids: ``[T, k]`` dispatched global expert ids.
        bias: ``[E]`` expert bias or None.
        seq_len: tokens per sequence, or None (the observation is one sequence).
        experts: E.

    Raises:
        ValueError: token counts that disagree or are not a multiple of ``seq_len``; ids out of range.
    """
    tokens = probs.shape[0]
    device = probs.device
    sums = torch.zeros(len(SEQUENCE_FIELDS) + len(_COUNTS) + 3 * experts, dtype=torch.float64, device=device)
    extremes = neutral("max", _EXTREMES_SIZE, device)
    if ids.shape[0] != tokens:
        raise ValueError(f"router_topk has {ids.shape[0]} tokens but the scores have {tokens}")
    if not tokens:
        return sums, extremes
    if seq_len is not None and tokens % seq_len:
        raise ValueError(f"{tokens} tokens are not whole sequences of seq_len {seq_len}")
    groups = tokens // seq_len if seq_len else 1
    group = (torch.arange(tokens, device=device) // (seq_len or tokens))
    k = ids.shape[1]
    ids = ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"expert ids must be in [0, {experts}); got {int(ids.min())}..{int(ids.max())}")
    p = probs.to(torch.float64)
    aux = torch.zeros_like(p, dtype=torch.bool)
    if k:
        aux.scatter_(1, torch.topk(p, min(k, experts), dim=1).indices, True)
    actual = torch.zeros_like(p, dtype=torch.bool)
    actual.scatter_(1, ids, True)

    def per_group(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((groups,) + tuple(x.shape[1:]), dtype=torch.float64, device=device)
        return out.index_add_(0, group, x.to(torch.float64))

    n = per_group(torch.ones(tokens, device=device))
    score = per_group(p) / n.unsqueeze(1)
    aux_counts, actual_counts = per_group(aux), per_group(actual)
    a = aux_counts / aux_counts.sum(1, keepdim=True).clamp_min(1)
    c = actual_counts / actual_counts.sum(1, keepdim=True).clamp_min(1)
    overlap = per_group((aux & actual).sum(1)) / aux_counts.sum(1).clamp_min(1)
    if 0 < k < experts:
        floor = p.masked_fill(~aux, math.inf).amin(1)
        ceiling = p.masked_fill(aux, -math.inf).amax(1)
        margin = per_group((floor - ceiling).clamp_min(0) / floor.clamp_min(_MARGIN_EPS)) / n
    else:
        margin = torch.zeros(groups, dtype=torch.float64, device=device)
    u = 1.0 / experts
    da, ds, dc = a - u, score - u, c - u
    coupling = (da * ds).sum(1)
    norm = (da.pow(2).sum(1) * ds.pow(2).sum(1)).sqrt()
    fields = [
        experts * (a * score).sum(1), experts * da.pow(2).sum(1), experts * ds.pow(2).sum(1),
        experts * coupling, torch.where(norm > 0, coupling / norm, torch.zeros_like(norm)),
        experts * dc.pow(2).sum(1), 0.5 * (a - c).abs().sum(1), overlap,
        experts * a.amax(1), experts * c.amax(1), (c == 0).to(torch.float64).mean(1), margin,
    ]
    if bias is not None:
        b = bias.detach().to(torch.float64).reshape(1, experts).expand(groups, experts)
        fields += [b.mean(1), b.std(1, correction=0), b.pow(2).mean(1).sqrt(), b.amax(1) - b.amin(1),
                   b.abs().amax(1), _correlation(b, score), _correlation(b, a), _correlation(b, c)]
    else:
        fields += [torch.zeros(groups, dtype=torch.float64, device=device)] * len(BIAS_FIELDS)
    per_sequence = torch.stack(fields, dim=1)
    head = len(SEQUENCE_FIELDS)
    sums[:head] = per_sequence.sum(0)
    sums[head:head + 3] = torch.tensor([groups, groups if bias is not None else 0, tokens],
                                       dtype=torch.float64, device=device)
    body = sums[head + 3:].view(3, experts)
    body[0], body[1], body[2] = p.sum(0), aux_counts.sum(0), actual_counts.sum(0)
    peaks = torch.stack([fields[0].max(), fields[5].max(), (-overlap).max()])
    nan = torch.isnan(peaks)
    return sums, torch.cat([peaks.masked_fill(nan, -math.inf), nan.to(torch.float64)])


def _correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation along dim 1 (0 where either row is constant)."""
    dx = x - x.mean(1, keepdim=True)
    dy = y - y.mean(1, keepdim=True)
    denominator = (dx.pow(2).sum(1) * dy.pow(2).sum(1)).sqrt()
    return torch.where(denominator > 0, (dx * dy).sum(1) / denominator, torch.zeros_like(denominator))


@dataclass(frozen=True, slots=True)
class RouterOp:
    """One reported statistic: ``name`` (the record's stat), the per-sequence ``field`` or
    global formula, ``aggregation`` (``mean``, ``max``, ``min`` over sequences, or ``global``)
    and whether the worst layer is the smallest value."""

    name: str
    field: str
    aggregation: str
    worst_is_min: bool = False



class LayerSummary:
    """The reduced sums and extremes of one layer, read by name."""

    def __init__(self, vectors: Mapping[str, list[float]]) -> None:
        sums = vectors[ROUTER_SUMS.name]
        head = len(SEQUENCE_FIELDS)
        self.field_sums = dict(zip(SEQUENCE_FIELDS, sums[:head]))
        self.sequences, self.bias_sequences, self.tokens = sums[head:head + 3]
        experts = (len(sums) - head - 3) // 3
        body = sums[head + 3:]
        self.score, self.aux, self.actual = body[:experts], body[experts:2 * experts], body[2 * experts:]
        self.experts = experts
        top = vectors[ROUTER_EXTREMES.name]
        peak = [flagged_value((top[i], top[i + len(_EXTREMES)])) for i in range(len(_EXTREMES))]
        self.extremes = {"seq_aux_loss": peak[0], "actual_load_imbalance": peak[1], "aux_actual_overlap": -peak[2]}

    def mean(self, field: str) -> float:
        count = self.bias_sequences if field in BIAS_FIELDS else self.sequences
        return self.field_sums[field] / count if count else math.nan

    def global_value(self, field: str) -> float:
        e = self.experts
        score, aux, actual = (_normalized(v) for v in (self.score, self.aux, self.actual))
        if field == "global_batch_aux_loss":
            return e * sum(x * y for x, y in zip(aux, score))
        if field == "seq_global_aux_loss_gap":
            return self.mean("seq_aux_loss") - self.global_value("global_batch_aux_loss")
        if field == "actual_load_imbalance":
            return e * sum((x - 1.0 / e) ** 2 for x in actual)
        if field == "aux_actual_tv":
            return 0.5 * sum(abs(x - y) for x, y in zip(aux, actual))
        if field == "aux_max_over_mean":
            return e * max(aux)
        if field == "actual_max_over_mean":
            return e * max(actual)
        raise KeyError(f"no global router statistic {field!r}")

    def value(self, op: RouterOp) -> float:
        if op.aggregation == "mean":
            return self.mean(op.field)
        if op.aggregation == "global":
            return self.global_value(op.field)
        extreme = self.extremes[op.field]
        return extreme if math.isfinite(extreme) or self.sequences else math.nan


def _normalized(values: list[float]) -> list[float]:
    total = max(sum(values), 1.0)
    return [v / total for v in values]
