"""The vocabulary of the naming tables: a `Rule` maps one parameter path to a canonical name, a
`Layout` is the ordered table of one framework, compiled into a single regular expression.

Paths in a rule are dotted module paths as ``named_parameters()`` prints them, below the
layout's root, with three placeholders:

==========  ===================================================================
``{L}``     the layer index as the framework numbers it (digits)
``{E}``     the expert index as the framework numbers it (digits)
``{P}``     the leaf: ``weight`` or ``bias``
==========  ===================================================================

Targets use the same placeholders; the layer and expert numbers written there are the global
ones (offsets applied by `tmetrics_core.naming.canonical`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "Layout",
    "Rule",
    "RuleMatch",
    "component_of",
]

_PLACEHOLDER = re.compile(r"\{([A-Z])\}")
_GROUP_REGEX = {"L": r"\d+", "E": r"\d+", "P": r"weight|bias"}


def _template_keys(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of a layout table.

    ``path`` is matched against the whole cleaned parameter name (below the layout root);
    ``target`` is the canonical name it renders to. The remaining fields describe tensors whose
    storage is not one ``[out, in]`` matrix:

    - ``transposed``: the weight is stored ``[in, out]`` (GPT-2 ``Conv1D``, Megatron's legacy
      grouped-GEMM ``weight1``/``weight2``); the logical weight is its transpose.
    - ``expert_dim``: the tensor stacks every expert of the layer along this dim
      (torchtitan ``moe.experts.w1`` is ``[E, hidden, dim]``, so 0); one slice per index.
    - ``parts``: logical tensors fused along ``part_dim``, in storage order, as equal
      ``torch.chunk`` pieces (Hugging Face ``gate_up_proj`` holds gate rows, then up rows).
    - ``each``: the canonical name of one slice, with ``{E}`` when ``expert_dim`` is set and
      ``{S}`` (the part name) when ``parts`` is set.

    Raises ``ValueError`` when the placeholders of ``path``, ``target`` and ``each`` disagree.
    """

    path: str
    target: str
    transposed: bool = False
    expert_dim: int | None = None
    parts: tuple[str, ...] = ()
    part_dim: int | None = None
    each: str = ""

    def __post_init__(self) -> None:
        path_keys = _template_keys(self.path)
        unknown = path_keys - set(_GROUP_REGEX)
        if unknown:
            raise ValueError(f"rule {self.path!r}: unknown placeholders {sorted(unknown)}; use L, E, P")
        if len(_PLACEHOLDER.findall(self.path)) != len(path_keys):
            raise ValueError(f"rule {self.path!r}: a placeholder appears twice")
        missing = _template_keys(self.target) - path_keys
        if missing:
            raise ValueError(f"rule {self.path!r}: target {self.target!r} uses {sorted(missing)}, not in the path")
        sliced = self.expert_dim is not None or bool(self.parts)
        if sliced != bool(self.each):
            raise ValueError(f"rule {self.path!r}: `each` is needed exactly when expert_dim or parts is set")
        if bool(self.parts) != (self.part_dim is not None):
            raise ValueError(f"rule {self.path!r}: parts and part_dim go together")
        if self.each:
            each_keys = _template_keys(self.each)
            stacked = {"E"} if self.expert_dim is not None else set()
            fused = {"S"} if self.parts else set()
            if each_keys - path_keys - stacked - fused or not (stacked | fused) <= each_keys:
                raise ValueError(
                    f"rule {self.path!r}: `each` {self.each!r} must use {sorted(stacked | fused)} "
                    f"and otherwise only placeholders of the path"
                )


def component_of(template: str) -> str:
    """The module path a canonical template names: no ``layers.{L}.`` prefix, no expert
    index, no leaf (``"layers.{L}.moe.experts.{E}.up.weight"`` -> ``"moe.experts.up"``)."""
    module = template.rsplit(".", 1)[0] if "." in template else template
    return module.removeprefix("layers.{L}.").replace(".{E}", "")


class RuleMatch(NamedTuple):
    """A rule that matched a cleaned name, with the numbers read from the name (not offset)."""

    rule: Rule
    layer: int | None
    expert: int | None
    leaf: str


def _path_regex(path: str, prefix: str) -> str:
    pieces: list[str] = []
    position = 0
    for token in _PLACEHOLDER.finditer(path):
        pieces.append(re.escape(path[position : token.start()]))
        key = token.group(1)
        pieces.append(f"(?P<{prefix}{key}>{_GROUP_REGEX[key]})")
        position = token.end()
    pieces.append(re.escape(path[position:]))
    return "".join(pieces)


@dataclass(frozen=True)
class Layout:
    """The naming table of one framework.

    ``roots`` are optional leading path pieces, each optional, in order (Hugging Face causal-LM
    models nest the decoder under ``model.``, vision-language ones under
    ``model.language_model.``). ``block`` is the path of one transformer block with ``{L}``; a
    name inside a block that no rule knows keeps its path below the block, renamed under
    ``layers.{i}.``. Rules are tried in table order; the first full match wins.
    """

    name: str
    roots: tuple[str, ...]
    block: str
    rules: tuple[Rule, ...]
    _rules_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _block_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _groups: dict[str, tuple[Rule, str | None, str | None, str | None]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        root = "".join(f"(?:{re.escape(piece)})?" for piece in self.roots)
        alternatives = "|".join(f"(?P<r{k}>{_path_regex(rule.path, f'r{k}_')})" for k, rule in enumerate(self.rules))
        object.__setattr__(self, "_rules_regex", re.compile(f"{root}(?:{alternatives})"))
        groups = {}
        for k, rule in enumerate(self.rules):
            keys = _template_keys(rule.path)
            groups[f"r{k}"] = (rule, *(f"r{k}_{key}" if key in keys else None for key in "LEP"))
        object.__setattr__(self, "_groups", groups)
        block = _path_regex(self.block, "b_")
        object.__setattr__(self, "_block_regex", re.compile(f"{root}{block}(?P<rest>.+)"))

    def match(self, clean: str) -> RuleMatch | None:
        """The first rule whose path matches all of ``clean``, or None."""
        found = self._rules_regex.fullmatch(clean)
        if found is None:
            return None
        # The outer group of a rule closes last, so it is the match's last group.
        rule, layer, expert, leaf = self._groups[found.lastgroup or ""]
        return RuleMatch(
            rule=rule,
            layer=None if layer is None else int(found.group(layer)),
            expert=None if expert is None else int(found.group(expert)),
            leaf="" if leaf is None else found.group(leaf),
        )

    def match_block(self, clean: str) -> tuple[int, str] | None:
        """``(layer, rest)`` when ``clean`` lies inside a block of this layout, else None."""
        found = self._block_regex.fullmatch(clean)
        if found is None:
            return None
        return int(found.group("b_L")), found.group("rest")
