"""The built-in metric families: every metric tmetrics ships, as catalogue entries.

Each function here is one family registered by :mod:`tmetrics_core.metrics.catalogue` through the
same call as a family from an installed package's ``tmetrics.metrics`` entry point. Names are
kebab-case, scope first (``layer-grad-l2``); the Megatron-LM tensor-metrics names are aliases
with the same meaning (``global-wgrad-l2`` is ``global-grad-l2``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from tmetrics_core.metrics.activations import DEFAULT_MODULES, BackwardGain, ModuleRms, OutputEntropy
from tmetrics_core.metrics.attention_heads import AttentionEntropy, AttentionLogitMax, AttentionLse, AttentionSink
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.drift import ReplicaDrift
from tmetrics_core.metrics.entry import (
    BINS,
    FORMAT,
    MODULES,
    MOMENTS,
    RECIPE,
    SAMPLE,
    SCALE_MODE,
    SELECT,
    CatalogueEntry,
    made,
)
from tmetrics_core.metrics.norms import AbsMax, L2Norm, Max, MeanLineL2, NonFinite, Rms, ZeroFraction
from tmetrics_core.metrics.outliers import ChannelKurtosis, OutlierRatio
from tmetrics_core.metrics.quant.metric import QUANT_STATS, QuantMetric
from tmetrics_core.metrics.router import DeadExperts, DecisionEntropy, ExpertLoadImbalance, ExpertTokens, RouterZLoss
from tmetrics_core.metrics.router_families import ExpertBias, RouterHealth, RoutingBalance, SeqAuxDecomposition
from tmetrics_core.metrics.sketches import HistogramMetric, QuantileMetric
from tmetrics_core.metrics.updates import OptimizerStateRms, UpdateRatio

__all__ = ["FAMILIES"]

_ALL = "every placement: Replica, Shard(d), Shard(None), FlatShard, Owned; Partial reduced directly when linear, else materialized"
_LINES = "Replica, Shard(d), FlatShard (one per tensor), Owned; Partial materialized; 2-D and wider tensors only"
_COUNTS = "every placement; counts are not linear, so Partial is materialized first"
_ROWS = "token rows split (Shard(None), Shard(0)), Owned, Replica, vocab/expert split Shard(1); not FlatShard"
_ROUTER_ROWS = ("token rows split (Shard(None)), Owned, Replica; not Shard(1) (needs whole expert rows) nor "
                "FlatShard; with seq_len, not split on cp, tp or pp (they cut sequences)")
_TOPK = "token rows split (Shard(None)), Owned, Replica; not Shard(1) nor FlatShard"
_DRIFT = "sites Replica on dp (others are not copies); Shard, FlatShard and Owned on other axes"
_COTANGENT = ("; g is the cotangent of the loss the optimizer applies: the local one / (data-parallel averaging "
              "x loss scale), micro-batches summed, so equal on every topology of one global batch (docs/backward.md)")
_GRADS = ("DTensor cotangents of every placement (Partial reduced first, Replicate once, Shard and _StridedShard "
          "as in the forward), token rows split by data, sequence or pipeline, vocab split Shard(1)")


def _state_rms(*, moments: Sequence[str] = ("exp_avg", "exp_avg_sq"), **options: Any) -> TensorMetric:
    """``layer-optimizer-state-rms`` of the ``moments`` the optimizer keeps (SGD and Muon keep
    only the first: ``moments: [exp_avg]``)."""
    return OptimizerStateRms(source_kinds=tuple(moments), scope="layer", **options)


_SCOPE_WORDS = {"global": "all", "layer": "each layer's", "tensor": "each tensor's",
                "family": "each family's (one tensor name across layers)",
                "expert": "each (layer, global expert)'s routed-expert"}


def _norm_entries() -> list[CatalogueEntry]:
    out = []
    for kind, word, unit in (("param", "param", "parameter units"), ("grad", "grad", "gradient units")):
        for scope in ("global", "layer", "tensor", "family", "expert"):
            base = ("equals torch.nn.utils.clip_grad_norm_'s total norm (before clipping); "
                    if (kind, scope) == ("grad", "global") else "")
            out.append(CatalogueEntry(
                f"{scope}-{word}-l2", made(L2Norm, [kind], scope), (kind,), (scope,),
                f"sqrt(sum_i x_i^2) over {_SCOPE_WORDS[scope]} {word} elements", unit,
                base + ("smooth; spikes flag instability" if kind == "grad" else "slow drift; sudden jumps flag bad steps"),
                _ALL, aliases=(f"{scope}-wgrad-l2",) if kind == "grad" and scope in ("global", "layer") else ()))
        out.append(CatalogueEntry(
            f"layer-{word}-absmax", made(AbsMax, [kind], "layer"), (kind,), ("layer",),
            "max_i |x_i| over the layer", unit, "a few times the layer RMS; far larger means outliers", _ALL))
        out.append(CatalogueEntry(
            f"layer-{word}-rms", made(Rms, [kind], "layer"), (kind,), ("layer",),
            "sqrt(sum_i x_i^2 / N) over the layer", unit, "stable across steps; comparable across layers", _ALL))
        out.append(CatalogueEntry(
            f"layer-{word}-histogram", made(HistogramMetric, [kind], "layer"), (kind,), ("layer",),
            "counts in fixed signed log2 bins (bins per sign over 2^-40..2^24), zeros/NaN/Inf apart",
            "count", "a smooth bell in log-magnitude; no NaN/Inf", _COUNTS,
            options=(SELECT, BINS)))
    return out


def _tensor_entries() -> list[CatalogueEntry]:
    """Parameters, gradients, updates, optimizer state and replica drift beyond the norms."""
    e = CatalogueEntry
    return [
        e("global-param-mean-row-l2", made(MeanLineL2, ["param"], "global", dim=0), ("param",), ("global",),
          "mean over rows r of matrices of sqrt(sum_j W_rj^2)", "parameter units",
          "slow drift (init scale about sqrt(fan_in) * std)", _LINES),
        e("global-param-mean-column-l2", made(MeanLineL2, ["param"], "global", dim=1), ("param",), ("global",),
          "mean over columns c of matrices of sqrt(sum_i W_ic^2)", "parameter units", "slow drift", _LINES),
        e("layer-grad-nonfinite", made(NonFinite, ["grad"], "layer"), ("grad",), ("layer",),
          "#{g_i = NaN}, #{g_i = +Inf}, #{g_i = -Inf} (stats nan, posinf, neginf, total)", "count",
          "all 0", _COUNTS),
        e("layer-grad-zero-fraction", made(ZeroFraction, ["grad"], "layer"), ("grad",), ("layer",),
          "#{g_i = 0} / N", "fraction", "near 0; growth means dead units or vanished gradients", _COUNTS),
        e("layer-update-ratio", made(UpdateRatio, ["update", "param"], "layer"), ("update", "param"), ("layer",),
          "||Δθ|| / ||θ|| over the layer's updated tensors (θ after the step)", "ratio",
          "about 1e-3 per step with Adam; 1e-2 and above is unstable, 1e-5 stalled", _ALL),
        e("layer-optimizer-state-rms", _state_rms, ("exp_avg", "exp_avg_sq"), ("layer",),
          "sqrt(sum m_i^2 / N) for exp_avg and exp_avg_sq (stats)",
          "gradient units / squared", "exp_avg near the gradient RMS, exp_avg_sq near its square", _ALL,
          options=(SELECT, MOMENTS)),
        e("dp-replica-drift", lambda **o: ReplicaDrift(source_kinds=("param",), scope="global", **o),
          ("param",), ("global",),
          "max - min over dp replicas: bit hash (stat tensors-differing), sum(x) (max-sum-diff), "
          "sampled elements (sampled-max-diff)", "count / parameter units", "all 0", _DRIFT,
          options=(SELECT, SAMPLE)),
    ]


def _activation_entries() -> list[CatalogueEntry]:
    """The residual stream, the output logits and chosen modules' outputs."""
    e = CatalogueEntry
    return [
        e("layer-residual-accumulator-l2", made(L2Norm, ["residual_accumulator"], "layer"),
          ("residual_accumulator",), ("layer",),
          "sqrt(sum over tokens and features of h^2), h = block output (residual stream)", "activation units",
          "grows with depth and token count; compare with the -rms form", _ALL),
        e("layer-residual-contribution-l2", made(L2Norm, ["residual_contribution"], "layer"),
          ("residual_contribution",), ("layer",),
          "sqrt(sum over tokens and features of (h_out - h_in)^2)", "activation units",
          "well below the accumulator L2; a layer near 0 is bypassed", _ALL),
        e("layer-residual-accumulator-rms", made(Rms, ["residual_accumulator"], "layer"),
          ("residual_accumulator",), ("layer",), "sqrt(mean over tokens and features of h^2)",
          "activation units", "order 1 after normalization; steady growth with depth", _ALL),
        e("layer-residual-contribution-rms", made(Rms, ["residual_contribution"], "layer"),
          ("residual_contribution",), ("layer",), "sqrt(mean over tokens and features of (h_out - h_in)^2)",
          "activation units", "below the accumulator RMS", _ALL),
        e("global-output-logits-l2", made(L2Norm, ["logits"], "global"), ("logits",), ("global",),
          "sqrt(sum over tokens and vocabulary of z^2)", "logit units", "grows with token count; no spikes",
          _ALL),
        e("output-logits-max", made(Max, ["logits"], "global"), ("logits",), ("global",),
          "max over tokens and vocabulary of z", "logit units", "tens at most; hundreds risk softmax round-off",
          _ALL),
        e("output-entropy", made(OutputEntropy, ["logits"], "global"), ("logits",), ("global",),
          "(1/T) sum_t -sum_v p_tv log p_tv, p_t = softmax(z_t)", "nats",
          "falls from log V as the model learns; collapse to 0 is overconfidence", _ROWS),
        e("layer-activation-rms", lambda **o: ModuleRms(source_kinds=("activation",), scope="tensor", **o),
          ("activation",), ("tensor",),
          f"sqrt(mean of y^2) of each chosen module's output y (modules default {list(DEFAULT_MODULES)})",
          "activation units", "order 1; steady across steps", _ALL,
          options=(SELECT, MODULES)),
    ]


def _router_entries() -> list[CatalogueEntry]:
    """Router logits, expert load and the router diagnostic families."""
    e = CatalogueEntry
    return [
        e("layer-router-logits-l2", made(L2Norm, ["router_logits"], "layer"), ("router_logits",), ("layer",),
          "sqrt(sum over tokens and experts of z^2)", "logit units", "grows with tokens; no spikes", _ALL),
        e("layer-router-logits-max", made(Max, ["router_logits"], "layer"), ("router_logits",), ("layer",),
          "max over tokens and experts of z", "logit units", "small (under 10s); growth precedes collapse", _ALL),
        e("layer-router-logits-median", made(QuantileMetric, ["router_logits"], "layer"), ("router_logits",),
          ("layer",), "lower median of z from a merged log2 histogram (1024 bins/sign over 2^-20..2^12: "
          "relative error <= 1.1%)", "logit units", "near 0, stable", _COUNTS,
          options=(SELECT, BINS), aliases=("layer-router-logits-sampled-median",)),
        e("layer-router-decision-entropy", made(DecisionEntropy, ["router_scores", "router_logits"], "layer"),
          ("router_scores", "router_logits"), ("layer",),
          "(1/T) sum_t H(p_t) / log E (scores, or softmax of logits)", "fraction of log E",
          "well inside (0, 1); 1 = no decision, 0 = collapsed", _ROWS),
        e("layer-expert-tokens", made(ExpertTokens, ["router_topk"], "layer"), ("router_topk",), ("layer",),
          "tokens dispatched to each global expert (vector of length E)", "tokens", "about k T / E each", _TOPK),
        e("layer-expert-load-imbalance", made(ExpertLoadImbalance, ["router_topk"], "layer"), ("router_topk",),
          ("layer",), "max_e n_e / mean_e n_e (stat max-over-mean); std_e n_e / mean_e n_e (stat cv)", "ratio",
          "max-over-mean near 1, cv near 0", _TOPK),
        e("layer-dead-experts", made(DeadExperts, ["router_topk"], "layer"), ("router_topk",), ("layer",),
          "#{experts with no dispatched token in the step}", "experts", "0", _TOPK),
        e("layer-router-z-loss", made(RouterZLoss, ["router_logits"], "layer"), ("router_logits",), ("layer",),
          "(1/T) sum_t (logsumexp_e z_te)^2 (ST-MoE)", "logit units squared", "small and stable", _ROWS),
        e("layer-router-health", lambda **o: RouterHealth(**o), ("router_topk", "router_scores", "router_logits",
          "expert_bias"), ("global",),
          "cross-layer roll-up and worst layer of sequence aux loss E sum a_i s_i, imbalances "
          "E sum (x_i - 1/E)^2, whole-batch loss and gap, max-over-mean, top-k boundary margin",
          "dimensionless", "losses and max-over-mean 1, imbalances and gap 0, margin large", _ROUTER_ROWS),
        e("layer-router-routing-balance", lambda **o: RoutingBalance(**o), ("router_topk", "router_scores",
          "router_logits", "expert_bias"), ("layer", "global"),
          "dispatched vs unbiased top-k: E sum (c_i - 1/E)^2, 1/2 sum |a_i - c_i|, overlap, E max c, "
          "inactive fraction; per sequence and whole batch", "dimensionless",
          "imbalance 0, tv 0, overlap 1, max-over-mean 1, inactive 0", _ROUTER_ROWS),
        e("layer-router-seq-aux-decomposition", lambda **o: SeqAuxDecomposition(**o),
          ("router_topk", "router_scores", "router_logits", "expert_bias"), ("layer", "global"),
          "E sum a_i s_i = 1 + coupling; assignment and score imbalance E sum (x_i - 1/E)^2; alignment",
          "dimensionless", "loss 1, imbalances 0", _ROUTER_ROWS),
        e("layer-router-expert-bias", lambda **o: ExpertBias(**o), ("router_topk", "router_scores",
          "router_logits", "expert_bias"), ("layer", "global"),
          "mean, std, rms, range, max|b| of the expert bias; corr(b, scores / aux load / dispatched load)",
          "bias units / correlation", "bounded bias; negative correlation with scores", _ROUTER_ROWS),
    ]


_QUANT = ("Replica, Shard(d), Shard(None), Owned; FlatShard and shards that cut scale blocks only with "
          "fp8-tensorwise; Partial materialized")


def _quant_entries() -> list[CatalogueEntry]:
    """``layer-{param,grad,activation,activation-grad}-quant`` (docs/low-precision.md). Cost per recipe and due
    step: one read of each tensor and a float64 pass over its elements; tensorwise and nvfp4 on
    a tensor cut across ranks add one MAX round and a copy of the local shard until it runs."""
    out = []
    for kind, word in (("param", "param"), ("grad", "grad"), ("activation", "activation"),
                       ("activation_grad", "activation-grad")):
        options = (SELECT, RECIPE, FORMAT, SCALE_MODE) + ((MODULES,) if kind.startswith("activation") else ())
        out.append(CatalogueEntry(
            f"layer-{word}-quant", made(QuantMetric, [kind], "layer"), (kind,), ("layer",),
            f"per recipe (default mxfp8): {', '.join(QUANT_STATS)} of x vs dq(x) (stats <recipe>.<quantity>); "
            "cost per recipe and due step: one read and ~30 float64 passes per element, plus a MAX round and a "
            "shard copy for fp8-tensorwise/nvfp4 on sharded tensors (docs/low-precision.md)",
            "fraction / dB / x units / binades", "underflow and overflow near 0; sqnr-db above 30 for fp8",
            _QUANT, options=options))
    channels = "token rows split (Shard(None)), features split (Shard(1)), Owned, Replica; not FlatShard"
    out.append(CatalogueEntry(
        "layer-activation-channel-kurtosis", made(ChannelKurtosis, ["activation"], "tensor"), ("activation",),
        ("tensor",), "Pearson kurtosis over features c of r_c = sqrt(mean_t y_tc^2), per chosen module",
        "dimensionless", "near 1.8-3; tens and above mean outlier channels", channels,
        options=(SELECT, MODULES)))
    out.append(CatalogueEntry(
        "layer-activation-outlier-ratio", made(OutlierRatio, ["activation"], "tensor"), ("activation",),
        ("tensor",), "max_c r_c / median_c r_c, r_c = sqrt(mean_t y_tc^2), per chosen module", "ratio",
        "a few; 100 and above defeats per-tensor and per-row scales", channels,
        options=(SELECT, MODULES)))
    return out


def _cotangent_entries() -> list[CatalogueEntry]:
    e = CatalogueEntry
    g = "residual_grad"
    unit = "loss units per activation unit"
    return [
        e("layer-residual-grad-l2", made(L2Norm, [g], "layer"), (g,), ("layer",),
          "sqrt(sum over tokens and features of g^2), g at the block output" + _COTANGENT, unit,
          "smooth across steps; grows going down (lower layers) slowly; spikes flag instability", _GRADS),
        e("layer-residual-grad-rms", made(Rms, [g], "layer"), (g,), ("layer",),
          "sqrt(mean over tokens and features of g^2), g at the block output" + _COTANGENT, unit,
          "scales as 1/T (T tokens of the global batch) for a mean loss; within 10x across layers; steady", _GRADS),
        e("layer-residual-grad-absmax", made(AbsMax, [g], "layer"), (g,), ("layer",),
          "max |g| over the layer's tokens and features, g at the block output" + _COTANGENT, unit,
          "a few times to ~100x the RMS; far larger means a few tokens carry the gradient", _GRADS),
        e("layer-residual-grad-nonfinite", made(NonFinite, [g], "layer"), (g,), ("layer",),
          "#{g = NaN}, #{g = +Inf}, #{g = -Inf} (stats nan, posinf, neginf, total), g at the block output"
          + _COTANGENT, "count",
          "all 0 (with a loss scaler: non-zero on the steps it skips)", _GRADS),
        e("layer-residual-grad-histogram", made(HistogramMetric, [g], "layer"), (g,), ("layer",),
          "counts of g (at the block output) in fixed signed log2 bins (bins per sign over 2^-40..2^24), "
          "zeros/NaN/Inf apart" + _COTANGENT,
          "count", "a smooth bell in log-magnitude; mass near 2^-40 means the gradient underflows in low precision",
          _COUNTS, options=(SELECT, BINS)),
        e("layer-activation-grad-rms",
          lambda **o: ModuleRms(source_kinds=("activation_grad",), scope="tensor", **o), ("activation_grad",),
          ("tensor",), "sqrt(mean of g^2), g at each chosen module's output (modules "
          f"default {list(DEFAULT_MODULES)})" + _COTANGENT, unit, "same order across layers; steady across steps", _GRADS,
          options=(SELECT, MODULES)),
        e("output-logits-grad-l2", made(L2Norm, ["logits_grad"], "global"), ("logits_grad",), ("global",),
          "sqrt(sum over tokens and vocabulary of g^2), g = dL/dz at the output logits; for a mean "
          "cross-entropy over T tokens g_t = (softmax(z_t) - onehot(y_t)) / T" + _COTANGENT, "loss units per logit",
          "below sqrt(2/T) (T tokens); falls as the model learns", _GRADS),
        e("layer-backward-gain", lambda **o: BackwardGain(source_kinds=(g, "residual_input_grad"), scope="layer", **o),
          (g, "residual_input_grad"), ("layer",),
          "RMS(g_in) / RMS(g_out): the RMS of g at the block's input over that at its output" + _COTANGENT,
          "ratio", "near 1 (pre-norm residual); >> 1 layer after layer explodes, << 1 vanishes", _GRADS),
    ]


_HEADS = ("global heads: split on tp (Shard(0)) fill their slots; queries split (Shard(None)) merge by MAX and "
          "SUM; keys split over AttentionSpec.key_split merge exactly by MAX then SUM; Owned (pipeline stages)")


def _attention_entries() -> list[CatalogueEntry]:
    """The attention metrics (``attn_qk`` sites): a vector over global heads (stat ``heads``) and
    roll-ups per layer."""
    return [CatalogueEntry(cls.name, made(cls, ["attn_qk"], "layer"), ("attn_qk",), ("layer",),
                           cls.formula, cls.unit, cls.baseline, _HEADS)
            for cls in (AttentionLogitMax, AttentionEntropy, AttentionSink, AttentionLse)]


FAMILIES: tuple[tuple[str, Callable[[], Iterable[CatalogueEntry]]], ...] = (
    ("norms", _norm_entries), ("tensors", _tensor_entries), ("activations", _activation_entries),
    ("router", _router_entries), ("quant", _quant_entries), ("cotangents", _cotangent_entries),
    ("attention", _attention_entries),
)
"""The built-in families, in catalogue order: (family name, function returning its entries)."""
