"""Single-process float64 reference of the router metrics, written sequence by sequence from
the definitions (Switch Transformer aux loss, ST-MoE z-loss, the Megatron-LM router
diagnostics), independently of tmetrics_core.metrics.router."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = float(torch.finfo(torch.float32).eps)


@dataclass
class Layer:
    """One MoE layer's full observation: probabilities (rows sum to 1), dispatched ids,
    optional bias, tokens per sequence (None: the whole batch is one sequence)."""

    probs: torch.Tensor
    ids: torch.Tensor
    bias: torch.Tensor | None
    seq_len: int | None
    logits: torch.Tensor | None = None


def sequence_stats(p: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None) -> dict[str, float]:
    """Every per-sequence statistic of one sequence (``p``: [L, E], ``ids``: [L, k])."""
    tokens, experts = p.shape
    k = ids.shape[1]
    u = 1.0 / experts
    s = p.mean(0)
    aux_sets = [set(torch.topk(p[t], min(k, experts)).indices.tolist()) if k else set() for t in range(tokens)]
    act_sets = [set(ids[t].tolist()) for t in range(tokens)]
    aux_counts = torch.zeros(experts, dtype=torch.float64)
    act_counts = torch.zeros(experts, dtype=torch.float64)
    for a_set, c_set in zip(aux_sets, act_sets):
        for e in a_set:
            aux_counts[e] += 1
        for e in c_set:
            act_counts[e] += 1
    a = aux_counts / max(aux_counts.sum().item(), 1.0)
    c = act_counts / max(act_counts.sum().item(), 1.0)
    overlap = sum(len(x & y) for x, y in zip(aux_sets, act_sets)) / max(aux_counts.sum().item(), 1.0)
    margins = []
    for t in range(tokens):
        if 0 < k < experts:
            chosen = [p[t, e].item() for e in aux_sets[t]]
            others = [p[t, e].item() for e in range(experts) if e not in aux_sets[t]]
            low, high = min(chosen), max(others)
            margins.append(max(low - high, 0.0) / max(low, EPS))
        else:
            margins.append(0.0)
    da, ds, dc = a - u, s - u, c - u
    denominator = math.sqrt((da @ da).item() * (ds @ ds).item())
    out = {
        "seq_aux_loss": experts * (a @ s).item(),
        "aux_load_imbalance": experts * (da @ da).item(),
        "score_imbalance": experts * (ds @ ds).item(),
        "imbalance_coupling": experts * (da @ ds).item(),
        "imbalance_alignment": (da @ ds).item() / denominator if denominator > 0 else 0.0,
        "actual_load_imbalance": experts * (dc @ dc).item(),
        "aux_actual_tv": 0.5 * (a - c).abs().sum().item(),
        "aux_actual_overlap": overlap,
        "aux_max_over_mean": experts * a.max().item(),
        "actual_max_over_mean": experts * c.max().item(),
        "actual_inactive_fraction": (c == 0).double().mean().item(),
        "topk_boundary_relative_margin": sum(margins) / len(margins),
    }
    if bias is not None:
        b = bias.double()
        out.update({
            "bias_mean": b.mean().item(), "bias_std": b.std(correction=0).item(),
            "bias_rms": b.pow(2).mean().sqrt().item(), "bias_range": (b.max() - b.min()).item(),
            "bias_abs_max": b.abs().max().item(), "bias_score_correlation": _corr(b, s),
            "bias_aux_load_correlation": _corr(b, a), "bias_actual_load_correlation": _corr(b, c),
        })
    out["_score_sum"] = p.sum(0)
    out["_aux_counts"] = aux_counts
    out["_act_counts"] = act_counts
    return out


def _corr(x: torch.Tensor, y: torch.Tensor) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    d = math.sqrt((dx @ dx).item() * (dy @ dy).item())
    return (dx @ dy).item() / d if d > 0 else 0.0


def layer_stats(layer: Layer) -> list[dict]:
    tokens = layer.probs.shape[0]
    length = layer.seq_len or tokens
    if not tokens:
        return []
    return [sequence_stats(layer.probs[i:i + length], layer.ids[i:i + length], layer.bias)
            for i in range(0, tokens, length)]


def layer_values(seqs: list[dict], experts: int) -> dict[str, float]:
    """Per-layer values of every op name used by the families."""
    def mean(f):
        vals = [s[f] for s in seqs if f in s]
        return sum(vals) / len(vals) if vals else math.nan

    score = sum((s["_score_sum"] for s in seqs), torch.zeros(experts, dtype=torch.float64))
    aux = sum((s["_aux_counts"] for s in seqs), torch.zeros(experts, dtype=torch.float64))
    act = sum((s["_act_counts"] for s in seqs), torch.zeros(experts, dtype=torch.float64))
    score, aux, act = (v / max(v.sum().item(), 1.0) for v in (score, aux, act))
    u = 1.0 / experts
    batch_loss = experts * (aux @ score).item()
    out = {f: mean(f) for f in seqs[0] if not f.startswith("_")} if seqs else {}
    out.update({
        "global_batch_aux_loss": batch_loss,
        "seq_global_aux_loss_gap": mean("seq_aux_loss") - batch_loss,
        "global_actual_load_imbalance": experts * ((act - u) @ (act - u)).item(),
        "global_aux_actual_tv": 0.5 * (aux - act).abs().sum().item(),
        "global_aux_max_over_mean": experts * aux.max().item(),
        "global_actual_max_over_mean": experts * act.max().item(),
        "max_seq_aux_loss": max(s["seq_aux_loss"] for s in seqs) if seqs else math.nan,
        "max_actual_load_imbalance": max(s["actual_load_imbalance"] for s in seqs) if seqs else math.nan,
        "min_aux_actual_overlap": min(s["aux_actual_overlap"] for s in seqs) if seqs else math.nan,
    })
    return out


# (op name, value key in layer_values, roll-up: pool field / max / min / mean of layers)
DECOMPOSITION = [("loss-mean", "seq_aux_loss", "pool"), ("loss-max", "max_seq_aux_loss", "max"),
                 ("assignment-imbalance-mean", "aux_load_imbalance", "pool"),
                 ("score-imbalance-mean", "score_imbalance", "pool"),
                 ("imbalance-coupling-mean", "imbalance_coupling", "pool"),
                 ("imbalance-alignment-mean", "imbalance_alignment", "pool")]
BALANCE = [("actual-imbalance-mean", "actual_load_imbalance", "pool"),
           ("actual-imbalance-max", "max_actual_load_imbalance", "max"),
           ("aux-actual-tv-mean", "aux_actual_tv", "pool"), ("topk-overlap-mean", "aux_actual_overlap", "pool"),
           ("topk-overlap-min", "min_aux_actual_overlap", "min"), ("aux-max-over-mean", "aux_max_over_mean", "pool"),
           ("actual-max-over-mean", "actual_max_over_mean", "pool"),
           ("actual-inactive-fraction", "actual_inactive_fraction", "pool"),
           ("global-actual-imbalance", "global_actual_load_imbalance", "layers"),
           ("global-aux-actual-tv", "global_aux_actual_tv", "layers"),
           ("global-aux-max-over-mean", "global_aux_max_over_mean", "layers"),
           ("global-actual-max-over-mean", "global_actual_max_over_mean", "layers")]
HEALTH = [("seq-loss", "seq_aux_loss", "pool", False), ("seq-assignment-imbalance", "aux_load_imbalance", "pool", False),
          ("seq-score-imbalance", "score_imbalance", "pool", False),
          ("global-batch-loss", "global_batch_aux_loss", "layers", False),
          ("seq-global-loss-gap", "seq_global_aux_loss_gap", "layers", False),
          ("global-aux-max-over-mean", "global_aux_max_over_mean", "layers", False),
          ("global-actual-imbalance", "global_actual_load_imbalance", "layers", False),
          ("global-actual-max-over-mean", "global_actual_max_over_mean", "layers", False),
          ("topk-boundary-relative-margin", "topk_boundary_relative_margin", "pool", True)]
BIAS = [(name, f"bias_{field}", "pool") for name, field in (
    ("mean", "mean"), ("std", "std"), ("rms", "rms"), ("range", "range"), ("abs-max", "abs_max"),
    ("score-correlation", "score_correlation"), ("aux-load-correlation", "aux_load_correlation"),
    ("actual-load-correlation", "actual_load_correlation"))]


def family_results(layers: dict[int, Layer]) -> dict[str, list]:
    """The four families' records (labels (layer, expert, tensor, stat), value)."""
    seqs = {i: layer_stats(layer) for i, layer in layers.items()}
    values = {i: layer_values(seqs[i], layers[i].probs.shape[1]) for i in layers}
    out: dict[str, list] = {}

    def rollup(ids, key, how):
        if how == "pool":
            pooled = [s[key] for i in ids for s in seqs[i] if key in s]
            return sum(pooled) / len(pooled) if pooled else math.nan
        vals = [values[i][key] for i in ids]
        if any(v != v for v in vals):
            return math.nan
        return {"max": max, "min": min}[how](vals) if how in ("max", "min") else sum(vals) / len(vals)

    for name, table, per_layer in (("layer-router-seq-aux-decomposition", DECOMPOSITION, True),
                                   ("layer-router-routing-balance", BALANCE, True)):
        rows = []
        ids = sorted(layers)
        if per_layer:
            rows += [((i, None, None, op), values[i].get(key, math.nan)) for i in ids for op, key, _ in table]
        if ids:
            rows += [((None, None, None, op), rollup(ids, key, how)) for op, key, how in table]
        out[name] = rows
    ids = sorted(layers)
    rows = []
    if ids:
        rows += [((None, None, None, op), rollup(ids, key, how)) for op, key, how, _ in HEALTH]
        for op, key, _, smallest in HEALTH:
            vals = [values[i].get(key, math.nan) for i in ids]
            worst = math.nan if any(v != v for v in vals) else (min(vals) if smallest else max(vals))
            rows.append(((None, None, None, f"worst-layer-{op}"), worst))
    out["layer-router-health"] = rows
    biased = sorted(i for i in layers if layers[i].bias is not None and layers[i].probs.shape[0])
    rows = [((i, None, None, op), values[i].get(key, math.nan)) for i in biased for op, key, _ in BIAS]
    if biased:
        rows += [((None, None, None, op), rollup(biased, key, how)) for op, key, how in BIAS]
    out["layer-router-expert-bias"] = rows
    return out


def simple_results(layers: dict[int, Layer]) -> dict[str, list]:
    """Expert tokens, load imbalance, dead experts, decision entropy, z-loss."""
    out: dict[str, list] = {k: [] for k in ("layer-expert-tokens", "layer-expert-load-imbalance",
                                            "layer-dead-experts", "layer-router-decision-entropy",
                                            "layer-router-z-loss")}
    for i in sorted(layers):
        layer = layers[i]
        tokens, experts = layer.probs.shape
        counts = torch.bincount(layer.ids.reshape(-1), minlength=experts).double()
        out["layer-expert-tokens"].append(((i, None, None, None), tuple(counts.tolist())))
        mean = counts.mean().item()
        stats = ({"max-over-mean": counts.max().item() / mean, "cv": counts.std(correction=0).item() / mean}
                 if mean else {"max-over-mean": math.nan, "cv": math.nan})
        out["layer-expert-load-imbalance"] += [((i, None, None, k), v) for k, v in stats.items()]
        out["layer-dead-experts"].append(((i, None, None, None), float((counts == 0).sum())))
        p = layer.probs
        entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(1) / math.log(experts)
        out["layer-router-decision-entropy"].append(((i, None, None, None),
                                                     entropy.mean().item() if tokens else math.nan))
        if layer.logits is not None:
            lse = torch.logsumexp(layer.logits.double(), dim=1)
            out["layer-router-z-loss"].append(((i, None, None, None), lse.pow(2).mean().item() if tokens else math.nan))
    return out
