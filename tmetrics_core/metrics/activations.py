"""Activation metrics: softmax entropy of the output and RMS of chosen module outputs.

Token sites reach metrics flattened to ``[tokens, features]`` with padding tokens already
removed, as a population split across the ranks that see different tokens (``dp``, ``fsdp``,
``ep``, ``cp``), replicated on ``tp`` unless the model passed ``shard_dim`` (then ``Shard(1)``),
and ``Owned`` by their pipeline stage on ``pp``. Every statistic here sums over tokens, so
micro-batches merge by adding their states and every rank's tokens count once.

The residual-stream and output-logit norms are the norm metrics of
:mod:`tmetrics_core.metrics.norms` on the ``residual_*`` and ``logits`` kinds (see the catalogue).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Sequence

import math

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.norms import Rms
from tmetrics_core.metrics.statistics import COUNT, SUMSQ
from tmetrics_core.metrics.softmax import RowSoftmax, RowSoftmaxMetric
from tmetrics_core.site import Site

__all__ = ["BackwardGain", "DEFAULT_MODULES", "ModuleRms", "OutputEntropy"]

DEFAULT_MODULES = ("layers.*.attn", "layers.*.mlp", "layers.*.moe")
"""Module globs observed by ``layer-activation-rms`` when the config names none: the outputs
of each layer's attention and MLP (or MoE) blocks, before they join the residual stream."""

class OutputEntropy(RowSoftmaxMetric):
    """Mean softmax entropy of the output distribution, in nats per token:
    ``(1/T) sum_t H(softmax(z_t))`` with ``H(p) = -sum_v p_v log p_v`` over the vocabulary.

    ``T`` counts every (non-padding) token of every rank and micro-batch. A vocab-parallel head
    (``Shard(1)`` on ``tp``) is handled exactly (see :mod:`tmetrics_core.metrics.softmax`). Between 0
    (every token certain) and ``log V`` (uniform over the vocabulary). NaN without tokens.
    """

    formula = "mean over tokens t of -sum_v p_tv log p_tv, p_t = softmax(z_t)"

    def __init__(self, **kwargs) -> None:
        self.statistics = (RowSoftmax(),)
        super().__init__(**kwargs)

    def from_rows(self, sums):
        return sums["entropy"] / sums["rows"] if sums["rows"] else float("nan")


class ModuleRms(Rms):
    """RMS of module outputs, one value per module: ``sqrt(sum x**2 / N)`` over every element
    of the module's output across tokens, ranks and micro-batches (units of the activation).

    Args:
        modules: ``fnmatch`` globs on canonical module names (``layers.*.mlp``: the activation
            site's name), or on module paths in the model (``model.layers.*.mlp``); default
            :data:`DEFAULT_MODULES`. Sources hook exactly these modules.
    """

    def __init__(self, *, modules: str | Sequence[str] | None = None, **kwargs) -> None:
        chosen = (modules,) if isinstance(modules, str) else tuple(modules or ())
        self.modules: tuple[str, ...] = chosen or DEFAULT_MODULES
        super().__init__(**kwargs)

    def accepts(self, site: Site) -> bool:
        """Activation sites of a chosen module (and of ``select``, when given): a glob matches the
        site's canonical module name or the module's path in the model (``meta["module"]``)."""
        path = dict(site.meta).get("module")
        return super().accepts(site) and any(fnmatchcase(site.name, m) or (isinstance(path, str) and fnmatchcase(path, m))
                                             for m in self.modules)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, modules={list(self.modules)})"


class BackwardGain(StatMetric):
    """How much a block amplifies the gradient going down, per layer (dimensionless):
    ``RMS(g_in) / RMS(g_out)``, with ``g_out`` the cotangent of the block's output (the
    ``residual_grad`` site) and ``g_in`` that of its input (``residual_input_grad``), each RMS
    over every element of every token, rank and micro-batch.

    Near 1 in a healthy pre-norm residual network (the skip path carries the gradient through);
    well above 1 layer after layer, the gradient explodes going down; well below 1, it
    vanishes. NaN where ``g_out`` is 0; no record for a layer whose input has no cotangent
    (the first block over a frozen embedding).
    """

    statistics = (SUMSQ, COUNT)
    formula = "sqrt(sum g_in^2 / N_in) / sqrt(sum g_out^2 / N_out), g = cotangent at the block's input / output"

    def finalize(self, stats):
        if "residual_input_grad:count" not in stats or "residual_grad:count" not in stats:
            return None
        rms = {}
        for kind in ("residual_input_grad", "residual_grad"):
            n = stats[f"{kind}:count"][0]
            rms[kind] = math.sqrt(stats[f"{kind}:sumsq"][0] / n) if n else math.nan
        out = rms["residual_grad"]
        return rms["residual_input_grad"] / out if out else math.nan
