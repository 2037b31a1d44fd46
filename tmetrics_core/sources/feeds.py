"""What feeds each source kind: the text of the warning for a metric that found nothing.

A configured metric whose sites exist on no rank (router metrics on a model whose router outputs
are never observed, an activation metric whose module globs match modules that never run) or
whose tensors are all missing (no gradient anywhere) would otherwise write no record or zeros,
step after step, with no word. ``TensorMetrics`` warns once per such metric with this text.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["what_feeds"]

_ROUTER = ("router_logits", "router_topk", "router_scores")


def what_feeds(kinds: Iterable[str], modules: Sequence[str] = ()) -> str:
    """One sentence per source kind of a metric: where tmetrics looks for it.

    Args:
        kinds: the metric's source kinds (``grad``, ``router_logits``...).
        modules: the metric's module globs (``activation`` metrics), if any.
    """
    kinds = set(kinds)
    said = []
    router = sorted(kinds & set(_ROUTER))
    if router:
        said.append(f"{', '.join(router)} sites come only from tm.observe(module, name, tensor, kind=...) calls that "
                    "run inside the step scope, e.g. tm.observe(self, 'router_logits', logits, kind='router_logits') "
                    "in the MoE block's forward; none ran")
    if "activation" in kinds:
        said.append(f"activation sites are the outputs of modules matching {list(modules)} (the metric's modules: "
                    "globs on module paths) or tm.observe(..., kind='activation'); none ran in the step scope")
    if kinds & {"residual_accumulator", "residual_contribution"}:
        said.append("residual sites are the outputs of transformer blocks under layers, h, blocks or decoder.layers; "
                    "no block ran in the step scope")
    if "logits" in kinds:
        said.append("logits are the output of the head (head, lm_head, output or output_layer); it did not run in "
                    "the step scope")
    if kinds & {"residual_grad", "residual_input_grad", "logits_grad", "activation_grad"}:
        said.append("cotangent sites are observed when backward reaches a tensor a forward hook tapped in the step "
                    "scope (blocks' outputs and inputs, the head's output, modules: globs, tm.observe(..., grad=True)); "
                    "no backward reached one: backward() outside the step scope, or outputs that do not require grad")
    if "attn_qk" in kinds:
        said.append("attn_qk sites are the queries and keys of Hugging Face attention (wrapped in its attention "
                    "table) or of tm.observe(self, 'qk', (q, k), kind='attn_qk', attention=tm.AttentionSpec(...)) "
                    "calls in an attention's forward, with q and k after RoPE; none ran in the step scope")
    if "grad" in kinds:
        said.append("no parameter it selects had a gradient (.grad or .main_grad) when gradients were read: in the "
                    "optimizer's step pre-hook, or where metrics.observe_gradients() is called (after backward(), "
                    "before zero_grad())")
    if kinds & {"exp_avg", "exp_avg_sq"}:
        said.append("the optimizer held no Adam state (exp_avg, exp_avg_sq) for the parameters it selects after its "
                    "step")
    if kinds & {"param", "update"} and not said:
        said.append("no rank holds a parameter it selects")
    return "; ".join(said) or f"no rank produced a site of kinds {sorted(kinds)}"
