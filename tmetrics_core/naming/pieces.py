"""Logical pieces of one stored tensor, each under its own canonical name: the experts and
fused parts of a stacked tensor (:func:`stacked_pieces`, transformers 5.x and torchtitan's
grouped experts) and the q/k/v views of a fused ``attn.qkv`` tensor (:func:`qkv_views`,
torchtitan's ``FusedQKVLinear``). Each piece is a :class:`~tmetrics_core.naming.name.CanonicalName`
with the ``region`` of the stored tensor that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tmetrics_core.errors import ConfigError
from tmetrics_core.naming.layouts import RuleMatch, component_of
from tmetrics_core.naming.name import CanonicalName

__all__ = ["QKV_PARTS", "qkv_views", "stacked_pieces"]


def stacked_pieces(whole: CanonicalName, found: RuleMatch, shape: Sequence[int],
                   expert_offset: int) -> list[CanonicalName]:
    """One entry per expert and fused part of the stacked tensor ``whole`` (stored ``shape``,
    matched by layout rule ``found``), in storage order; expert indices start at ``expert_offset``.

    Raises:
        ConfigError: ``shape`` has too few dims for the rule, or its fused parts do not split evenly.
    """
    rule = found.rule
    needed = max(d for d in (rule.expert_dim, rule.part_dim) if d is not None)
    if len(shape) <= needed:
        raise ConfigError(
            f"{whole.original!r} has shape {list(shape)}; layout {whole.layout!r} needs at least "
            f"{needed + 1} dims to split it (experts on dim {rule.expert_dim}, fused parts on dim "
            f"{rule.part_dim}). Pass the stored tensor, or split_stacked=False."
        )
    experts: Sequence[int | None] = range(shape[rule.expert_dim]) if rule.expert_dim is not None else (None,)
    parts: Sequence[tuple[int | None, str]] = tuple(enumerate(rule.parts)) or ((None, ""),)
    chunk = 0
    if rule.part_dim is not None:
        chunk, left = divmod(shape[rule.part_dim], len(rule.parts))
        if left:
            raise ConfigError(
                f"{whole.original!r} has shape {list(shape)}; dim {rule.part_dim} holds the fused parts "
                f"{list(rule.parts)} and must split into {len(rule.parts)} equal pieces."
            )
    layer = whole.layer
    pieces = []
    for local in experts:
        for part, part_name in parts:
            region: list[tuple[int, int, int]] = []
            if local is not None and rule.expert_dim is not None:
                region.append((rule.expert_dim, local, local + 1))
            if part is not None and rule.part_dim is not None:
                region.append((rule.part_dim, part * chunk, (part + 1) * chunk))
            expert = None if local is None else local + expert_offset
            template = rule.each.replace("{S}", part_name)
            pieces.append(
                replace(
                    whole,
                    name=template.format(L=layer, E=expert, P=found.leaf),
                    expert=expert,
                    component=component_of(template),
                    family=template.format(L="*", E="*", P=found.leaf),
                    part=part,
                    region=tuple(region),
                )
            )
    return pieces


QKV_PARTS = ("q", "k", "v")
"""The views of a fused ``attn.qkv`` tensor, in the order of their rows within a group."""


def qkv_views(whole: CanonicalName, shape: Sequence[int], heads_per_kv: int, head_dim: int) -> list[CanonicalName]:
    """``attn.q``, ``attn.k`` and ``attn.v`` entries for a fused ``attn.qkv`` tensor whose dim-0
    rows are grouped per key/value head: ``heads_per_kv`` query heads, then one key head, then
    one value head, ``head_dim`` rows each (torchtitan's ``FusedQKVLinear``). Each view keeps
    the group dim: q is ``[n_kv_heads, heads_per_kv * head_dim, ...]``, k and v
    ``[n_kv_heads, head_dim, ...]``, so group ``g`` of each is the rows key/value head ``g``
    and its query heads use (the stock ``wq``/``wk``/``wv`` rows, grouped).

    Raises:
        ConfigError: ``whole`` is not an ``attn.qkv`` tensor, or its rows are not a whole
            number of groups.
    """
    group = (heads_per_kv + 2) * head_dim
    if whole.component != "attn.qkv" or not shape or heads_per_kv < 1 or head_dim < 1 or shape[0] % group:
        raise ConfigError(
            f"{whole.original!r} ({whole.name}, shape {list(shape)}) is not a fused q/k/v tensor of "
            f"{heads_per_kv} query heads per key/value head of {head_dim} rows: its component must be attn.qkv "
            f"and its rows a multiple of {group}")
    bounds = {"q": (0, heads_per_kv * head_dim), "k": (heads_per_kv * head_dim, (heads_per_kv + 1) * head_dim),
              "v": ((heads_per_kv + 1) * head_dim, group)}
    out = []
    for part, name in enumerate(QKV_PARTS):
        start, stop = bounds[name]
        out.append(replace(whole, name=whole.name.replace(".attn.qkv.", f".attn.{name}."), component=f"attn.{name}",
                           family=whole.family.replace(".attn.qkv.", f".attn.{name}."), part=part,
                           region=((1, start, stop),), groups=(0, group)))
    return out
