"""Canonical tensor names: one scheme for every framework, so runs from different codebases
compare (`tmetrics names` lists a model's; docs/architecture.md).

===========================================  ============================================
canonical name                               what it is
===========================================  ============================================
``embed.weight``, ``pos_embed.weight``       token and learned position embeddings
``layers.{i}.attn_norm.weight``              norm before attention
``layers.{i}.attn.{q,k,v,qkv,o}.weight``     attention projections (``qkv`` when fused)
``layers.{i}.attn.{q,k,kv}_norm.weight``     query/key norms; MLA latent norms
``layers.{i}.attn.{q,kv}_{down,up}.weight``  multi-head latent attention projections
``layers.{i}.mlp_norm.weight``               norm before the MLP or MoE
``layers.{i}.mlp.{gate,up,down}.weight``     gated MLP; ``fc1``/``fc2`` when not split
``layers.{i}.moe.router.weight``             router; ``.expert_bias`` its balancing bias
``layers.{i}.moe.experts.{e}.{...}.weight``  routed expert ``e`` (``gate,up,down,fc1,fc2``)
``layers.{i}.moe.shared.{...}.weight``       shared experts; ``moe.shared_gate`` their gate
``final_norm.weight``, ``head.weight``       final norm and output projection
===========================================  ============================================

Layer ``i`` and expert ``e`` are global: ``layer_offset`` (the pipeline stage's first layer)
and ``expert_offset`` (the expert-parallel rank's first expert) are added to the numbers in
the framework's names. Wrapper prefixes are dropped first: ``module.`` at the front (DDP,
Megatron's ``Float16Module``) and ``_orig_mod.``, ``_fsdp_wrapped_module.``,
``_checkpoint_wrapped_module.`` anywhere (PEFT's pieces too: `strip_wrappers`). Names no layout
knows keep their cleaned path; inside a known block they keep their path below it, under
``layers.{i}.``.

Blocks are found by structure as well (`tmetrics_core.naming.stacks`): a name inside a list of
repeated blocks no layout knows (``gpt_neox.layers.3.attention.dense.weight``) is
``layers.3.attention.dense.weight``. A model with several stacks (an encoder and a decoder)
numbers them one after the other: the decoder's first block follows the encoder's last, and
the family of a structurally named tensor keeps its stack's path
(``decoder.block.*.layer.0.SelfAttention.q.weight``), so an encoder's and a decoder's tensors
never share one. PEFT adapter tensors are named below the module they adapt
(`tmetrics_core.naming.adapters`): ``layers.3.attn.q.lora_A.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.naming.adapters import split_adapter
from tmetrics_core.naming.layouts import LAYOUTS, Layout, RuleMatch, component_of
from tmetrics_core.naming.name import CanonicalName
from tmetrics_core.naming.pieces import qkv_views, stacked_pieces
from tmetrics_core.naming.stacks import Stack, find_stacks, locate

__all__ = [
    "COMPONENTS",
    "KNOWN_LAYOUTS",
    "canonical_name",
    "canonicalize",
    "detect_layout",
    "strip_wrappers",
]

KNOWN_LAYOUTS: tuple[str, ...] = tuple(LAYOUTS)
"""Layout names accepted by ``layout=``, in the order detection breaks ties."""

_PROJECTIONS = ("gate", "up", "down", "fc1", "fc2")
COMPONENTS: frozenset[str] = frozenset(
    {"embed", "pos_embed", "final_norm", "head", "attn_norm", "mlp_norm"}
    | {f"attn.{p}" for p in ("q", "k", "v", "qkv", "o", "q_norm", "k_norm", "kv_norm")}
    | {f"attn.{p}" for p in ("q_down", "q_up", "kv_down", "kv_up", "rel_bias")}
    | {f"mlp.{p}" for p in (*_PROJECTIONS, "gate_up")}
    | {"moe.router", "moe.shared_gate"}
    | {f"moe.experts.{p}" for p in (*_PROJECTIONS, "gate_up")}
    | {f"moe.shared.{p}" for p in _PROJECTIONS}
)
"""Every component a layout table can produce (the canonical vocabulary)."""

_WRAPPERS_ANYWHERE = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                                "base_layer", "original_module"})
_WRAPPER_AT_FRONT = "module"
_PEFT_AT_FRONT = ("base_model", "model")


def strip_wrappers(original: str) -> str:
    """``original`` without wrapper path pieces.

    ``module`` is dropped at the front only (DDP, nested ``module.module.``), since a user
    module may be called ``module``; ``_orig_mod`` (``torch.compile``),
    ``_fsdp_wrapped_module`` (FSDP1) and ``_checkpoint_wrapped_module`` (checkpoint wrapper)
    anywhere, since they wrap inner blocks too. PEFT's ``base_model.model.`` (a ``PeftModel``)
    goes at the front, after those, and its ``base_layer`` and ``original_module`` (the module an
    adapter wraps) anywhere: the base weights keep the unwrapped model's names.
    """
    if (_WRAPPER_AT_FRONT not in original and "_orig_mod" not in original and "base_" not in original):
        return original
    kept: list[str] = []
    for piece in original.split("."):
        if piece in _WRAPPERS_ANYWHERE or (piece == _WRAPPER_AT_FRONT and not kept):
            continue
        if [*kept, piece] == list(_PEFT_AT_FRONT):
            kept.clear()
            continue
        kept.append(piece)
    return ".".join(kept) if kept else original


def detect_layout(names: Iterable[str]) -> str | None:
    """The layout whose rules match the most of ``names`` (wrappers stripped first).

    Ties go to the layout listed first in `KNOWN_LAYOUTS`. When no rule matches any name, the
    first layout (canonical first) that recognises a block path (``layers.{i}.``...) in some
    name; else None.
    """
    cleaned = [strip_wrappers(name) for name in names]
    best, best_count = None, 0
    for layout in LAYOUTS.values():
        count = sum(1 for clean in cleaned if layout.match(clean) is not None)
        if count > best_count:
            best, best_count = layout.name, count
    if best is None:
        # No known tensor name (a model of plain blocks, e.g. layers.3.fc.weight): the first
        # layout that recognises the block path still gives every tensor its layer.
        plain_first = sorted(LAYOUTS.values(), key=lambda layout: layout.name != "canonical")
        best = next((layout.name for layout in plain_first
                     if any(layout.match_block(clean) is not None for clean in cleaned)), None)
    return best


def canonical_name(
    original: str, *, layer_offset: int = 0, expert_offset: int = 0, layout: str | None = None
) -> CanonicalName:
    """The canonical name of the parameter called ``original``.

    Args:
        original: a name from ``named_parameters()`` (or ``named_buffers()``).
        layer_offset: global index of the first layer this process holds (pipeline stage).
        expert_offset: global index of the first expert this process holds (expert parallel).
        layout: one of `KNOWN_LAYOUTS`, or None to use the first layout with a rule for this
            name. A whole model is better named with `canonicalize`, which detects the layout
            from every name at once.

    Stacked tensors are named whole here (``expert`` None, ``expert_dim`` set); see
    `canonicalize` with ``split_stacked=True`` for one entry per expert.

    Raises:
        ConfigError: an unknown ``layout`` or a negative offset.
    """
    _check_offsets(layer_offset, expert_offset)
    clean = strip_wrappers(original)
    chosen = _layout(layout) if layout is not None else _layout_of(clean)
    found = chosen.match(clean) if chosen is not None else None
    return _entry(original, clean, chosen, found, layer_offset, expert_offset)


def canonicalize(
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    layer_offset: int = 0,
    expert_offset: int = 0,
    layout: str | None = None,
    split_stacked: bool = False,
    qkv_groups: Mapping[str, tuple[int, int]] | None = None,
) -> list[CanonicalName]:
    """Canonical names for a whole model, in input order, each stored tensor once.

    Args:
        named_params: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``; DTensor
            parameters are fine (their global shape is used).
        layer_offset, expert_offset: as in `canonical_name`.
        layout: one of `KNOWN_LAYOUTS`, or None to detect it with `detect_layout`.
        split_stacked: name each expert (and each fused part) of a stacked tensor separately:
            one entry per slice, with ``region`` set and ``view`` giving the slice. Expert
            ``j`` of the stored tensor gets global index ``j + expert_offset`` (keep the offset
            0 for a DTensor, whose shape is already global).
        qkv_groups: original name of a fused ``attn.qkv`` tensor -> ``(heads_per_kv,
            head_dim)``: name its q, k and v rows separately (`tmetrics_core.naming.pieces.qkv_views`) instead of whole.

    Tied parameters (the same tensor object, or the same storage, offset, shape, stride and
    dtype) appear once, under the first name seen; the later names go to ``tied``.

    Raises:
        ConfigError: two parameters map to one canonical name (both originals are named; pass
            ``layout=`` when detection chose wrongly, or rename one of them); an unknown
            ``layout``; a negative offset; a fused tensor whose size does not split evenly.
    """
    _check_offsets(layer_offset, expert_offset)
    kept: list[tuple[str, torch.Tensor]] = []
    tied: dict[int, list[str]] = {}
    seen: dict[tuple[object, ...], int] = {}
    for original, tensor in named_params:
        keys = _identity_keys(tensor)
        first = next((seen[key] for key in keys if key in seen), None)
        if first is not None:
            tied.setdefault(first, []).append(original)
            continue
        for key in keys:
            seen[key] = len(kept)
        kept.append((original, tensor))

    cleaned = [strip_wrappers(original) for original, _ in kept]
    chosen = _layout(layout) if layout is not None else _layout(detect_layout(cleaned))
    stacks = find_stacks(cleaned)
    owners: dict[str, str] = {}
    entries: list[CanonicalName] = []
    for index, ((original, tensor), clean) in enumerate(zip(kept, cleaned)):
        adapter = split_adapter(clean)
        named = adapter[0] if adapter is not None else clean
        found = chosen.match(named) if chosen is not None else None
        entry = _entry(original, named, chosen, found, layer_offset, expert_offset, stacks)
        if adapter is not None:
            entry = _adapter_entry(entry, adapter[1])
        if index in tied:
            entry = replace(entry, tied=tuple(tied[index]))
        pieces = [entry]
        if split_stacked and found is not None and found.rule.each and adapter is None:
            pieces = stacked_pieces(entry, found, tuple(tensor.shape), expert_offset)
        if qkv_groups and original in qkv_groups:
            pieces = qkv_views(entry, tuple(tensor.shape), *qkv_groups[original])
        for piece in pieces:
            if piece.name in owners:
                raise ConfigError(
                    f"parameters {owners[piece.name]!r} and {piece.original!r} both map to the canonical name "
                    f"{piece.name!r} (layout {entry.layout!r}). Pass layout= with the right one of "
                    f"{list(KNOWN_LAYOUTS)} if detection chose wrongly, or rename one of the parameters."
                )
            owners[piece.name] = piece.original
            entries.append(piece)
    return entries


def _check_offsets(layer_offset: int, expert_offset: int) -> None:
    for label, value in (("layer_offset", layer_offset), ("expert_offset", expert_offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"got {value!r}; need an integer >= 0 (the first global index held here)", path=label)


def _layout(name: str | None) -> Layout | None:
    if name is None:
        return None
    if name not in LAYOUTS:
        raise ConfigError(
            f"unknown layout {name!r}; valid: {list(KNOWN_LAYOUTS)}, or None to detect it from the names",
            path="layout",
        )
    return LAYOUTS[name]


def _layout_of(clean: str) -> Layout | None:
    return next((layout for layout in LAYOUTS.values() if layout.match(clean) is not None), None)


def _identity_keys(tensor: torch.Tensor) -> list[tuple[object, ...]]:
    """Keys under which two entries are one tensor: the object, and for plain tensors with
    real memory the exact storage view (meta and empty tensors all share address 0)."""
    keys: list[tuple[object, ...]] = [("object", id(tensor))]
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
    if plain and tensor.device.type != "meta" and tensor.numel() > 0:
        storage = tensor.untyped_storage().data_ptr()
        keys.append(("storage", storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype))
    return keys


def _entry(
    original: str,
    clean: str,
    layout: Layout | None,
    found: RuleMatch | None,
    layer_offset: int,
    expert_offset: int,
    stacks: Sequence[Stack] = (),
) -> CanonicalName:
    """The entry for ``clean`` given what ``layout`` matched (``found``), offsets applied; inside
    a block of ``stacks``, the stack's base is added to the layer (0 for a model's only stack)."""
    where = locate(stacks, clean)
    base = where[0].base if where is not None else 0
    if layout is None or (found is None and layout.match_block(clean) is None):
        return _unknown(original, clean) if where is None else _stacked(original, where, layer_offset, len(stacks))
    if found is not None:
        rule = found.rule
        layer = None if found.layer is None else found.layer + layer_offset + base
        expert = None if found.expert is None else found.expert + expert_offset
        name = rule.target.format(L=layer, E=expert, P=found.leaf)
        return CanonicalName(
            name=name,
            original=original,
            layer=layer,
            expert=expert,
            component=component_of(rule.target),
            family=rule.target.format(L="*", E="*", P=found.leaf),
            transposed=rule.transposed and name.endswith(".weight"),
            expert_dim=rule.expert_dim,
            layout=layout.name,
        )
    inside = layout.match_block(clean)
    assert inside is not None, clean
    layer, rest = inside
    layer += layer_offset + base
    return CanonicalName(
        name=f"layers.{layer}.{rest}",
        original=original,
        layer=layer,
        expert=None,
        component=component_of(rest),
        family=f"layers.*.{rest}",
        layout=layout.name,
    )


def _stacked(original: str, where: tuple[Stack, int, str], layer_offset: int, stacks: int) -> CanonicalName:
    """A name inside a structurally found block: ``layers.{i}.{path below the block}``."""
    stack, key, rest = where
    layer = stack.base + key + layer_offset
    return CanonicalName(
        name=f"layers.{layer}.{rest}",
        original=original,
        layer=layer,
        expert=None,
        component=component_of(rest),
        family=f"layers.*.{rest}" if stacks == 1 else f"{stack.path}.*.{rest}",
    )


def _adapter_entry(base: CanonicalName, suffix: str) -> CanonicalName:
    """An adapter tensor's entry: ``suffix`` below the canonical module of the weight it adapts."""
    module, family = base.name.rpartition(".")[0], base.family.rpartition(".")[0]
    piece = suffix.split(".")[0]
    return replace(base, name=f"{module}.{suffix}", family=f"{family}.{suffix}",
                   component=f"{base.component}.{piece}", transposed=False)


def _unknown(original: str, clean: str) -> CanonicalName:
    return CanonicalName(
        name=clean,
        original=original,
        layer=None,
        expert=None,
        component=component_of(clean),
        family=clean,
    )
