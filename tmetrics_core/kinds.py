"""The source kinds: one record per kind of tensor a metric reads, and the sets the sources ask for.

A metric names what it reads by kind (``TensorMetric.source_kinds``: ``"grad"``,
``"router_logits"``...); a site carries its kind (``Site.kind``). Each kind is declared here once,
as data: where tmetrics reads it (an optimizer step hook, a forward module hook, a backward tensor
hook, a ``tm.observe`` call), which installers hook it, whether its rows are tokens, whether its
tensor is kept to the step's end, and the sentence said when a configured metric of the kind
found nothing. The sets the sources test against (:data:`TOKEN_KINDS`, :data:`KEPT_KINDS`...)
are queries over these records, so a new kind is its record here, the reader that hands its
tensors to an observer (with its installer, where tmetrics hooks it), and its test.

An installer is named by its dotted path, ``"package.module:function"`` as entry points spell
it, and imported only when a configured metric reads one of its kinds
(:mod:`tmetrics_core.scope.observation_hooks`): so this module stays on the bottom floor, importing
nothing of tmetrics, installers live with their readers on any floor (the Hugging Face one
under ``integrations/``), and no table of installers has to import them all (transformers
among them) to know them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterable, Sequence

__all__ = ["EXPERT_COLUMN_KINDS", "GRAD_KINDS", "INSTALL_ORDER", "KEPT_KINDS", "KINDS",
           "MODULE_GLOB_KINDS", "OBSERVED_KINDS", "OPTIMIZER_KINDS", "PARAM_KINDS", "RESIDUAL_KINDS",
           "ROUTER_OUTPUT_KINDS", "Reader", "SEQUENCE_CHECKED", "STATE_KINDS", "SourceKind", "TOKEN_KINDS",
           "declared", "installers_of", "kinds_where", "register_kind", "what_feeds"]


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
        installers: the functions that install the hooks reading it, each as
            ``"package.module:function"``: a function taking a
            :class:`~tmetrics_core.sources.hook_context.HookContext` and returning the handles
            (``.remove()`` each) it installed. Empty: it comes from ``tm.observe`` calls or from
            the optimizer side only.
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
    installers: tuple[str, ...] = ()
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
_TAPPED = (Reader.BACKWARD, Reader.OBSERVE)  # also tm.observe(..., kind="activation" or "logits", grad=True)

_BLOCKS = "tmetrics_core.sources.module_hooks:install_blocks"
_HEAD = "tmetrics_core.sources.module_hooks:install_head"
_ACTIVATIONS = "tmetrics_core.sources.module_hooks:install_activations"
_ACTIVATION_GRADS = "tmetrics_core.sources.module_hooks:install_activation_grads"
_PADDING = "tmetrics_core.sources.padding:install"
_ROUTERS = "tmetrics_core.sources.routers:install"
_HF_ATTENTION = "tmetrics_core.integrations.hf_attention:install"
_INNER_ATTENTION = "tmetrics_core.sources.attention:install_inner_attention"

INSTALL_ORDER: tuple[str, ...] = (_BLOCKS, _HEAD, _ACTIVATIONS, _ACTIVATION_GRADS, _PADDING, _ROUTERS,
                                  _HF_ATTENTION, _INNER_ATTENTION)
"""The built-in installers, in the order they run; a registered kind's new installers run after
them, in the order registered. Hooks on one module run in the order they were added (a block's
residual hook before the activation hook a ``modules:`` glob puts on the same block), and a
compiled model must see the same hooks in every run: the order is declared, not found."""

KINDS: tuple[SourceKind, ...] = (
    SourceKind("router_logits", _FORWARD, (_ROUTERS,), token_rows=True, kept=True, router_output=True,
               expert_columns=True, feeds=_ROUTER_FEEDS),
    SourceKind("router_topk", _FORWARD, (_ROUTERS,), token_rows=True, kept=True, router_output=True,
               feeds=_ROUTER_FEEDS),
    SourceKind("router_scores", _FORWARD, (_ROUTERS,), token_rows=True, kept=True, router_output=True,
               expert_columns=True, feeds=_ROUTER_FEEDS),
    SourceKind("activation", _FORWARD, (_ACTIVATIONS,), token_rows=True, module_globs=True, feeds=(
        "activation sites are the outputs of modules matching {modules} (the metric's modules: globs on module "
        "paths) or tm.observe(..., kind='activation'); none ran in the step scope")),
    SourceKind("residual_accumulator", (Reader.FORWARD,), (_BLOCKS,), token_rows=True, residual=True,
               sequence_checked=True, feeds=_RESIDUAL_FEEDS),
    SourceKind("residual_contribution", (Reader.FORWARD,), (_BLOCKS,), token_rows=True, residual=True,
               sequence_checked=True, feeds=_RESIDUAL_FEEDS),
    SourceKind("logits", _FORWARD, (_HEAD,), token_rows=True, feeds=(
        "logits are the output of the head (head, lm_head, output or output_layer); it did not run in the step "
        "scope")),
    SourceKind("residual_grad", _BACKWARD, (_BLOCKS,), token_rows=True, residual=True, sequence_checked=True,
               feeds=_COTANGENT_FEEDS),
    SourceKind("residual_input_grad", _BACKWARD, (_BLOCKS,), token_rows=True, residual=True,
               sequence_checked=True, feeds=_COTANGENT_FEEDS),
    SourceKind("logits_grad", _TAPPED, (_HEAD,), token_rows=True, feeds=_COTANGENT_FEEDS),
    # Its metrics' modules: globs also hook those modules' outputs as activations, as they always
    # have (dropped unless an activation metric is due); the tap hooks are the second installer's.
    SourceKind("activation_grad", _TAPPED, (_ACTIVATIONS, _ACTIVATION_GRADS), token_rows=True,
               sequence_checked=True, module_globs=True, feeds=_COTANGENT_FEEDS),
    SourceKind("attn_qk", (Reader.OBSERVE, Reader.FORWARD), (_HF_ATTENTION, _INNER_ATTENTION), token_rows=True,
               feeds=(
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
    SourceKind("token_mask", (Reader.OBSERVE, Reader.FORWARD), (_PADDING,)),
    SourceKind("expert_bias", (Reader.OBSERVE,)),  # no hook of tmetrics reads it
)
"""The built-in source kinds, in the order :func:`what_feeds` speaks of them."""

_RECORDS: dict[str, SourceKind] = {k.name: k for k in KINDS}
"""Every declared kind by name: the built-in ones, then those :func:`register_kind` added."""
_ORDER: list[str] = list(INSTALL_ORDER)
"""Every installer a record names, in the order they run."""
_LIVE: list[tuple[set[str], dict[str, bool]]] = []
"""The observed kinds' sets and the properties that pick them: kept up to date by :func:`register_kind`."""


def declared() -> tuple[SourceKind, ...]:
    """Every declared kind: the built-in ones (:data:`KINDS`), then the registered ones in the order
    registered."""
    return tuple(_RECORDS.values())


def _matches(kind: SourceKind, properties: dict[str, bool]) -> bool:
    return all(getattr(kind, p) == v for p, v in properties.items())


def kinds_where(**properties: bool) -> frozenset[str]:
    """The names of the declared kinds whose attributes (or properties) equal ``properties``, e.g.
    ``kinds_where(token_rows=True, kept=False)``.

    Raises:
        AttributeError: a property :class:`SourceKind` does not have.
    """
    return frozenset(k.name for k in declared() if _matches(k, properties))


def _observed_where(**properties: bool) -> AbstractSet[str]:
    """:func:`kinds_where` of observed kinds, as a set :func:`register_kind` keeps up to date (the
    sources import it once, as a constant)."""
    names = set(kinds_where(**properties))
    _LIVE.append((names, properties))
    return names


TOKEN_KINDS = _observed_where(token_rows=True)
"""Kinds whose rows are tokens."""

OBSERVED_KINDS = _observed_where(observed=True)
"""Every kind the catalogue's metrics read from observations (``tm.observe``, hooks)."""

GRAD_KINDS = _observed_where(cotangent=True)
"""Cotangent kinds: of each block's output (the residual stream) and input, of the output logits,
and of the output of modules a ``modules:`` glob picks (or ``tm.observe(..., grad=True)``)."""

RESIDUAL_KINDS = _observed_where(residual=True)
"""The residual stream's kinds: a block's output, its output less its input, and the cotangents of
its output and input."""

SEQUENCE_CHECKED = _observed_where(sequence_checked=True)
"""Kinds whose plain tensors may hold each tensor-parallel rank's part of the sequence."""

KEPT_KINDS = _observed_where(kept=True)
"""Kinds whose observed tensor (or a view of it) outlives the call, until the step's end."""

ROUTER_OUTPUT_KINDS = _observed_where(router_output=True)
"""A router's outputs: logits, scores and top-k choices ``[tokens, experts]``."""

MODULE_GLOB_KINDS = _observed_where(module_globs=True)
"""Kinds observed at modules that ``modules:`` globs pick."""

EXPERT_COLUMN_KINDS = _observed_where(expert_columns=True)
"""Kinds whose columns are the experts."""

PARAM_KINDS = kinds_where(before_step=True)
"""Read in the optimizer's step pre-hook (or at the end of the step without an optimizer)."""

OPTIMIZER_KINDS = kinds_where(after_step=True, before_step=False)
"""Read only in the optimizer's step post-hook: Adam state exists only after the first step, and
an update is the parameter's change over it."""

STATE_KINDS = kinds_where(optimizer_state=True)
"""The optimizer state kinds, by meaning: first and second moment of the gradient."""


def installers_of(read: Iterable[str]) -> list[str]:
    """The installers (``"package.module:function"``) of the kinds ``read``, each once, in the
    order they run; kinds with token rows bring those of ``token_mask`` (their padding is
    stripped)."""
    wanted = set(read)
    if wanted & TOKEN_KINDS:
        wanted.add("token_mask")
    named = {i for name in wanted if name in _RECORDS for i in _RECORDS[name].installers}
    return [i for i in _ORDER if i in named]


def register_kind(kind: SourceKind) -> Callable[[], None]:
    """Declare ``kind`` besides the built-in ones (a plugin's kind): it joins every set its record
    matches (:data:`TOKEN_KINDS`...) and :func:`what_feeds`, and its installers not named before
    run after the others. Returns the undo: calling it removes the kind again.

    Raises:
        ValueError: a kind of that name is declared already; a kind without token rows (the
            observed side installs and prepares only token kinds); a kind read by the optimizer (the
            parameter side reads its five kinds itself, ``tmetrics_core.sources.params``); an
            installer not spelled ``"package.module:function"``.
    """
    if kind.name in _RECORDS:
        raise ValueError(f"source kind {kind.name!r} is declared already: {_RECORDS[kind.name]!r}; "
                         "register the new kind under another name")
    if not kind.observed:
        raise ValueError(f"source kind {kind.name!r} is read by the optimizer ({[r.name for r in kind.read]}): "
                         f"the parameter side reads only its own kinds {sorted(kinds_where(observed=False))}; "
                         "register kinds read by hooks or tm.observe")
    bad = [i for i in kind.installers if not re.fullmatch(r"[\w.]+:[\w.]+", i)]
    if bad:
        raise ValueError(f"source kind {kind.name!r}: installers {bad} are not spelled 'package.module:function'")
    if not kind.token_rows:
        raise ValueError(f"source kind {kind.name!r} has no token rows: the observed side hooks and prepares "
                         "a registered kind as token rows ([tokens, features], padding stripped); declare it "
                         "with token_rows=True")
    _RECORDS[kind.name] = kind
    new = [i for i in dict.fromkeys(kind.installers) if i not in _ORDER]
    _ORDER.extend(new)
    for names, properties in _LIVE:
        if _matches(kind, properties):
            names.add(kind.name)

    def undo() -> None:
        if _RECORDS.get(kind.name) is not kind:
            return
        del _RECORDS[kind.name]
        for names, _ in _LIVE:
            names.discard(kind.name)
        named = {i for k in _RECORDS.values() for i in k.installers}
        _ORDER[:] = [i for i in _ORDER if i in named or i in INSTALL_ORDER]
    return undo


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
    for kind in declared():
        if kind.name in wanted and kind.feeds:
            groups.setdefault(kind.feeds, []).append(kind.name)
            if kind.feeds_alone:
                alone.add(kind.feeds)
    said = [text.format(kinds=", ".join(sorted(names)), modules=list(modules))
            for text, names in groups.items() if text not in alone]
    if not said:
        said = list(alone)
    return "; ".join(said) or f"no rank produced a site of kinds {sorted(wanted)}"
