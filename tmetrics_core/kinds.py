"""The source kinds: one record per kind of tensor a metric reads, and the sets the sources ask for.

A metric names what it reads by kind (``TensorMetric.source_kinds``: ``"grad"``,
``"router_logits"``...); a site carries its kind (``Site.kind``). Each kind is declared here once,
as data: where tmetrics reads it (an optimizer step hook, a forward module hook, a backward tensor
hook, a ``tm.observe`` call), whether its rows are tokens, whether its tensor is kept to the
step's end, and the sentence said when a configured metric of the kind found nothing. The sets
the sources test against (:data:`TOKEN_KINDS`, :data:`KEPT_KINDS`...) are queries over these
records, so a new kind is its record here, the reader that hands its tensors to an observer,
and its test.

This module is on the bottom floor: it imports nothing of tmetrics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["AFTER_STEP_KINDS", "EXPERT_COLUMN_KINDS", "GRAD_KINDS", "KEPT_KINDS", "KINDS", "MODULE_GLOB_KINDS",
           "OBSERVED_KINDS", "OPTIMIZER_KINDS", "PARAM_KINDS", "RESIDUAL_KINDS", "ROUTER_OUTPUT_KINDS", "Reader",
           "SEQUENCE_CHECKED", "STATE_KINDS", "SourceKind", "TOKEN_KINDS", "kinds_where", "what_feeds"]


class Reader(enum.Enum):
    """Where a kind's tensors are read."""

    OPTIMIZER_PRE = "optimizer step pre-hook"
    OPTIMIZER_POST = "optimizer step post-hook"
    FORWARD = "forward module hook"
    BACKWARD = "backward tensor hook"
    OBSERVE = "tm.observe call"


@dataclass(frozen=True)
class SourceKind:
    """One kind of source tensor.

    Attributes:
        name: the kind as metrics and sites spell it.
        read: where its tensors are read (:class:`Reader`), first the usual place.
        token_rows: its rows are tokens: flattened to ``[tokens, features]`` and stripped of the
            step's padding (``token_mask``).
        kept: the observed tensor (not a copy) is kept until the step's end and prepared there
            with the step's other observations of the kind (router outputs: ``[tokens, experts]``,
            small next to a layer's activations); an in-place change before then fails the
            metrics that read it.
        router_output: a router's output (logits, scores, top-k choices).
        expert_columns: its columns are the experts (router logits and scores ``[tokens, experts]``):
            the site's width is its number of experts.
        residual: of the residual stream (a block's output, its contribution, their cotangents).
        sequence_checked: a plain tensor of it may hold each tensor-parallel rank's part of the
            sequence with nothing to say so: checked when first seen
            (:mod:`tmetrics_core.sources.sequence_split`).
        module_globs: observed at the modules a metric's ``modules:`` globs pick.
        feeds: where tmetrics looks for it: the warning for a configured metric that found
            nothing (``{kinds}``: the metric's kinds sharing this sentence; ``{modules}``: its
            module globs). Empty: said by the fallback sentence.
        feeds_alone: the sentence is said only when no other kind of the metric said one.
        optimizer_state: read from the optimizer's state of each parameter (``optimizer.state[p]``).
    """

    name: str
    read: tuple[Reader, ...]
    token_rows: bool = False
    kept: bool = False
    router_output: bool = False
    expert_columns: bool = False
    residual: bool = False
    sequence_checked: bool = False
    module_globs: bool = False
    feeds: str = ""
    feeds_alone: bool = False
    optimizer_state: bool = False

    @property
    def cotangent(self) -> bool:
        """Read in backward: the cotangent of a tensor a forward hook tapped
        (:mod:`tmetrics_core.sources.cotangents` gives its scale)."""
        return Reader.BACKWARD in self.read

    @property
    def observed(self) -> bool:
        """Read from observations (forward or backward hooks, ``tm.observe``), not from the optimizer."""
        return not {Reader.OPTIMIZER_PRE, Reader.OPTIMIZER_POST} & set(self.read)

    @property
    def before_step(self) -> bool:
        """Read in the optimizer's step pre-hook (or at the step's end without an optimizer)."""
        return Reader.OPTIMIZER_PRE in self.read

    @property
    def after_step(self) -> bool:
        """Read in the optimizer's step post-hook."""
        return Reader.OPTIMIZER_POST in self.read


_ROUTER_FEEDS = ("{kinds} sites come only from tm.observe(module, name, tensor, kind=...) calls that run inside the "
                 "step scope, e.g. tm.observe(self, 'router_logits', logits, kind='router_logits') in the MoE block's "
                 "forward; none ran")
_RESIDUAL_FEEDS = ("residual sites are the outputs of transformer blocks under layers, h, blocks or decoder.layers; no "
                   "block ran in the step scope")
_COTANGENT_FEEDS = ("cotangent sites are observed when backward reaches a tensor a forward hook tapped in the step "
                    "scope (blocks' outputs and inputs, the head's output, modules: globs, tm.observe(..., grad=True)); "
                    "no backward reached one: backward() outside the step scope, or outputs that do not require grad")
_STATE_FEEDS = ("the optimizer held no Adam state (exp_avg, exp_avg_sq) for the parameters it selects after its "
                "step")
_PARAM_FEEDS = "no rank holds a parameter it selects"
_FORWARD = (Reader.FORWARD, Reader.OBSERVE)
_BACKWARD = (Reader.BACKWARD,)

KINDS: tuple[SourceKind, ...] = (
    SourceKind("router_logits", _FORWARD, token_rows=True, kept=True, router_output=True, expert_columns=True,
               feeds=_ROUTER_FEEDS),
    SourceKind("router_topk", _FORWARD, token_rows=True, kept=True, router_output=True, feeds=_ROUTER_FEEDS),
    SourceKind("router_scores", _FORWARD, token_rows=True, kept=True, router_output=True, expert_columns=True,
               feeds=_ROUTER_FEEDS),
    SourceKind("activation", _FORWARD, token_rows=True, module_globs=True, feeds=(
        "activation sites are the outputs of modules matching {modules} (the metric's modules: globs on module "
        "paths) or tm.observe(..., kind='activation'); none ran in the step scope")),
    SourceKind("residual_accumulator", (Reader.FORWARD,), token_rows=True, residual=True, sequence_checked=True,
               feeds=_RESIDUAL_FEEDS),
    SourceKind("residual_contribution", (Reader.FORWARD,), token_rows=True, residual=True, sequence_checked=True,
               feeds=_RESIDUAL_FEEDS),
    SourceKind("logits", _FORWARD, token_rows=True, feeds=(
        "logits are the output of the head (head, lm_head, output or output_layer); it did not run in the step "
        "scope")),
    SourceKind("residual_grad", _BACKWARD, token_rows=True, residual=True, sequence_checked=True,
               feeds=_COTANGENT_FEEDS),
    SourceKind("residual_input_grad", _BACKWARD, token_rows=True, residual=True, sequence_checked=True,
               feeds=_COTANGENT_FEEDS),
    SourceKind("logits_grad", _BACKWARD, token_rows=True, feeds=_COTANGENT_FEEDS),
    SourceKind("activation_grad", _BACKWARD, token_rows=True, sequence_checked=True, module_globs=True,
               feeds=_COTANGENT_FEEDS),
    SourceKind("attn_qk", (Reader.OBSERVE, Reader.FORWARD), token_rows=True, feeds=(
        "attn_qk sites are the queries and keys of Hugging Face attention (wrapped in its attention table) or of "
        "tm.observe(self, 'qk', (q, k), kind='attn_qk', attention=tm.AttentionSpec(...)) calls in an attention's "
        "forward, with q and k after RoPE; none ran in the step scope")),
    SourceKind("grad", (Reader.OPTIMIZER_PRE,), feeds=(
        "no parameter it selects had a gradient (.grad or .main_grad) when gradients were read: in the optimizer's "
        "step pre-hook, or where metrics.observe_gradients() is called (after backward(), before zero_grad())")),
    SourceKind("exp_avg", (Reader.OPTIMIZER_POST,), feeds=_STATE_FEEDS, optimizer_state=True),
    SourceKind("exp_avg_sq", (Reader.OPTIMIZER_POST,), feeds=_STATE_FEEDS, optimizer_state=True),
    SourceKind("param", (Reader.OPTIMIZER_PRE, Reader.OPTIMIZER_POST), feeds=_PARAM_FEEDS, feeds_alone=True),
    # The parameter's change over the step: its snapshot is taken before, the update read after.
    SourceKind("update", (Reader.OPTIMIZER_POST,), feeds=_PARAM_FEEDS, feeds_alone=True),
    SourceKind("token_mask", (Reader.OBSERVE, Reader.FORWARD)),
    SourceKind("expert_bias", _FORWARD),
)
"""Every source kind, in the order :func:`what_feeds` speaks of them."""

_BY_NAME = {k.name: k for k in KINDS}


def kinds_where(**properties: bool) -> frozenset[str]:
    """The names of the kinds whose attributes (or properties) equal ``properties``, e.g.
    ``kinds_where(token_rows=True, kept=False)``.

    Raises:
        AttributeError: a property :class:`SourceKind` does not have.
    """
    return frozenset(k.name for k in KINDS if all(getattr(k, p) == v for p, v in properties.items()))


TOKEN_KINDS = kinds_where(token_rows=True)
"""Kinds whose rows are tokens."""

OBSERVED_KINDS = kinds_where(observed=True)
"""Every kind the catalogue's metrics read from observations (``tm.observe``, hooks)."""

GRAD_KINDS = kinds_where(cotangent=True)
"""Cotangent kinds: of each block's output (the residual stream) and input, of the output logits,
and of the output of modules a ``modules:`` glob picks (or ``tm.observe(..., grad=True)``)."""

RESIDUAL_KINDS = kinds_where(residual=True)
"""The residual stream's kinds: a block's output, its output less its input, and the cotangents of
its output and input."""

SEQUENCE_CHECKED = kinds_where(sequence_checked=True)
"""Kinds whose plain tensors may hold each tensor-parallel rank's part of the sequence."""

KEPT_KINDS = kinds_where(kept=True)
"""Kinds whose observed tensor (or a view of it) outlives the call, until the step's end."""

ROUTER_OUTPUT_KINDS = kinds_where(router_output=True)
"""A router's outputs: logits, scores and top-k choices ``[tokens, experts]``."""

MODULE_GLOB_KINDS = kinds_where(module_globs=True)
"""Kinds observed at modules that ``modules:`` globs pick."""

EXPERT_COLUMN_KINDS = kinds_where(expert_columns=True)
"""Kinds whose columns are the experts."""

PARAM_KINDS = kinds_where(before_step=True)
"""Read in the optimizer's step pre-hook (or at the end of the step without an optimizer)."""

OPTIMIZER_KINDS = kinds_where(after_step=True, before_step=False)
"""Read only in the optimizer's step post-hook: Adam state exists only after the first step, and
an update is the parameter's change over it."""

AFTER_STEP_KINDS = kinds_where(after_step=True)
"""Read in the optimizer's step post-hook: :data:`OPTIMIZER_KINDS` and the parameter after the step."""

STATE_KINDS = kinds_where(optimizer_state=True)
"""The optimizer state kinds, by meaning: first and second moment of the gradient."""


def what_feeds(kinds: Iterable[str], modules: Sequence[str] = ()) -> str:
    """One sentence per group of a metric's source kinds: where tmetrics looks for them (the
    records' ``feeds``), for the warning about a metric whose sites exist on no rank.

    Args:
        kinds: the metric's source kinds (``grad``, ``router_logits``...).
        modules: the metric's module globs (``activation`` metrics), if any.
    """
    wanted = set(kinds)
    groups: dict[str, list[str]] = {}
    alone: set[str] = set()
    for kind in KINDS:
        if kind.name in wanted and kind.feeds:
            groups.setdefault(kind.feeds, []).append(kind.name)
            if kind.feeds_alone:
                alone.add(kind.feeds)
    said = [text.format(kinds=", ".join(sorted(names)), modules=list(modules))
            for text, names in groups.items() if text not in alone]
    if not said:
        said = list(alone)
    return "; ".join(said) or f"no rank produced a site of kinds {sorted(wanted)}"
