"""Routers found with no user code (`tmetrics_core.sources.routers`), on tiny transformers 5 models
built from configs: the router scores fed to ``router_scores`` are the router's own score
function of its logits (softmax for Mixtral and Qwen2-MoE, sigmoid for DeepSeek-V3), verified
against the top-k weights it returns, so the decision entropy and the score-side balance
figures equal float64 references computed from the router's own outputs; tokens per expert equal
counts of its own top-k ids. A router whose weights fit no score function fails the step's
metrics reading scores with the reason instead of reporting scores it cannot vouch for; its
top-k choices still count."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integrations.test_hf_moe import EXPERTS, VOCAB, _model, _routers
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

pytest.importorskip("transformers")

NAMES = ("layer-expert-tokens", "layer-router-decision-entropy", "layer-router-seq-aux-decomposition")
SCORE_FUNCTION = {"mixtral": "softmax", "qwen2_moe": "softmax", "deepseek_v3": "sigmoid"}


def _scores(logits: torch.Tensor, function: str) -> torch.Tensor:
    """Score rows normalized to sum 1, float64 ``[tokens, E]``."""
    x = logits.detach().double()
    p = torch.softmax(x, dim=-1) if function == "softmax" else torch.sigmoid(x)
    return p / p.sum(dim=-1, keepdim=True)


def _entropy(p: torch.Tensor) -> float:
    return float((-(p * p.clamp_min(1e-300).log()).sum(dim=-1) / math.log(EXPERTS)).mean())


def _run(model: torch.nn.Module, names: tuple[str, ...], rewrite=None):
    """Two steps; returns the second's records by (metric, layer, stat), the failures and each router
    layer's outputs in it."""
    seen: dict[int, list] = {}

    def keep(i):
        def hook(module, args, out):
            out = rewrite(out) if rewrite is not None else out
            seen.setdefault(i, []).append(out)
            return out
        return hook

    # Before tmetrics' own router hooks (installed with the metrics object): they run in order.
    hooks = [r.register_forward_hook(keep(i)) for i, r in _routers(model).items()]
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in names])
    for step in (1, 2):  # the score function found on step 1 is kept for step 2
        seen.clear()
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        with metrics.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    records = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
    failures = list(metrics.failures)
    metrics.close()
    return records, failures, seen


@pytest.mark.parametrize("family", sorted(SCORE_FUNCTION))
def test_router_scores_are_the_routers_own_score_function_of_its_logits(family: str) -> None:
    records, failures, seen = _run(_model(family), NAMES)
    assert not failures and seen
    for layer, outs in seen.items():
        logits, weights, chosen = (torch.cat([o[j] for o in outs]) for j in range(3))
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()
        assert list(records[("layer-expert-tokens", layer, None)]) == counts
        p = _scores(logits, SCORE_FUNCTION[family])
        assert math.isclose(records[("layer-router-decision-entropy", layer, None)], _entropy(p), rel_tol=1e-6)
        # The returned weights are the scores at the chosen ids, up to each token's normalization.
        at = p.gather(1, chosen)
        ratio = weights.double() / at
        assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4)
        # Switch-style balance loss of the layer's one observation (one sequence, as no sequence
        # length is known): s = mean score row, a = share of the unbiased top-k of the scores.
        k = chosen.shape[1]
        s = p.mean(dim=0)
        a = torch.bincount(p.topk(k, dim=-1).indices.flatten(), minlength=EXPERTS).double() / (p.shape[0] * k)
        loss = float(EXPERTS * (a * s).sum())
        assert math.isclose(records[("layer-router-seq-aux-decomposition", layer, "loss-mean")], loss, rel_tol=1e-6)
        imbalance = float(EXPERTS * (s - 1 / EXPERTS).pow(2).sum())
        assert math.isclose(records[("layer-router-seq-aux-decomposition", layer, "score-imbalance-mean")], imbalance,
                            rel_tol=1e-6)
        other = _scores(logits, "sigmoid" if SCORE_FUNCTION[family] == "softmax" else "softmax")
        assert abs(_entropy(other) - _entropy(p)) > 1e-3  # the reference tells the functions apart


def test_weights_that_fit_no_score_function_fail_the_score_metrics_with_the_reason() -> None:
    noise = torch.Generator().manual_seed(7)

    def rewrite(out):
        logits, weights, chosen = out
        return logits, weights * torch.rand(weights.shape, generator=noise) + 0.5, chosen

    records, failures, seen = _run(_model("mixtral"), NAMES, rewrite)
    reasons = {f.metric: f.error for f in failures}
    assert set(reasons) == {"layer-router-decision-entropy", "layer-router-seq-aux-decomposition"}
    assert all("fit neither of the score functions softmax, sigmoid" in r for r in reasons.values())
    assert not any(key[0] in reasons for key in records)
    for layer, outs in seen.items():
        chosen = torch.cat([o[2] for o in outs])
        assert list(records[("layer-expert-tokens", layer, None)]) == torch.bincount(
            chosen.flatten(), minlength=EXPERTS).tolist()


def test_without_scores_wanted_no_score_function_is_needed() -> None:
    noise = torch.Generator().manual_seed(7)

    def rewrite(out):
        logits, weights, chosen = out
        return logits, weights * torch.rand(weights.shape, generator=noise) + 0.5, chosen

    records, failures, seen = _run(_model("mixtral"), ("layer-expert-tokens",), rewrite)
    assert not failures
    for layer, outs in seen.items():
        chosen = torch.cat([o[2] for o in outs])
        assert list(records[("layer-expert-tokens", layer, None)]) == torch.bincount(
            chosen.flatten(), minlength=EXPERTS).tolist()
