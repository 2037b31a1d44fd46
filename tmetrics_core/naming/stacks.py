"""Block stacks found by structure: the lists of repeated blocks a model's parameter names show,
under any prefix (``gpt_neox.layers``, ``encoder.layer``, ``encoder.block`` and
``decoder.block``), so per-layer metrics need no layout that knows the family.

A *stack* is a dotted path ``P`` such that names ``P.{k}.{rest}`` exist for two or more integer
keys ``k`` (a ``ModuleList``, ``Sequential`` or integer-keyed ``ModuleDict``), each block holds a
parameter of a submodule (``rest`` has a dot: a block is a composite module, not one Linear of an
MLP ``Sequential``), and every block shares a parameter path with another one (like blocks; a
model whose first layers are dense and the rest MoE still shares its norms and attention). Only
lists outside every other stack count, and outside every named list of one entry: experts
inside a block (also the one block of a pipeline stage), or T5's ``block.{k}.layer.{j}``, are not
stacks of their own; the blocks of a model wrapped whole in an ``nn.Sequential`` are.

Layer ids are global and follow the stacks in the order their first parameter appears (the
registration order: an encoder before its decoder): stack ``s`` starts at ``base`` = the sum,
over earlier stacks, of their largest key plus one. A model with one stack numbers its blocks by
their keys. Pure functions of the names: every rank holding the same names finds the same stacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Stack", "describe_lists", "find_stacks", "locate"]


@dataclass(frozen=True, slots=True)
class Stack:
    """One list of repeated blocks.

    - ``path``: the list's cleaned module path (``"gpt_neox.layers"``; ``""`` when the model
      itself is the list, an ``nn.Sequential`` of blocks).
    - ``keys``: the blocks' keys as the names give them, ascending.
    - ``base``: the global layer id of key 0 (earlier stacks' blocks come first).
    """

    path: str
    keys: tuple[int, ...]
    base: int

    def __str__(self) -> str:
        return f"{self.path} ({len(self.keys)} blocks, layers {self.base + self.keys[0]}..{self.base + self.keys[-1]})"


def _candidates(names: Iterable[str]) -> dict[str, dict[int, set[str]]]:
    """Every ``prefix -> {key: {rest}}`` the names show, in first-appearance order."""
    found: dict[str, dict[int, set[str]]] = {}
    for name in names:
        pieces = name.split(".")
        for j in range(len(pieces) - 1):
            if pieces[j].isdigit():
                found.setdefault(".".join(pieces[:j]), {}).setdefault(int(pieces[j]), set()).add(
                    ".".join(pieces[j + 1:]))
    return found


def _is_stack(blocks: dict[int, set[str]]) -> bool:
    if len(blocks) < 2 or not all(any("." in rest for rest in rests) for rests in blocks.values()):
        return False
    return all(rests & set().union(*(other for k, other in blocks.items() if k != key))
               for key, rests in blocks.items())


def find_stacks(names: Sequence[str]) -> tuple[Stack, ...]:
    """The outermost block stacks among cleaned parameter ``names``, with their layer bases."""
    candidates = _candidates(names)
    chosen: list[tuple[str, tuple[int, ...]]] = []
    # Lists that enclose others: stacks, and named lists of one entry (a pipeline stage's one
    # layer holding its experts); not a model wrapped whole in an nn.Sequential.
    enclosing = [(outer, entries) for outer, entries in candidates.items()
                 if _is_stack(entries) or (outer and len(entries) == 1)]
    for path, blocks in candidates.items():
        inside = any(path.startswith(f"{outer}.{key}." if outer else f"{key}.")
                     for outer, entries in enclosing for key in entries)
        if _is_stack(blocks) and not inside:
            chosen.append((path, tuple(sorted(blocks))))
    out, base = [], 0
    for path, keys in chosen:
        out.append(Stack(path=path, keys=keys, base=base))
        base += keys[-1] + 1
    return tuple(out)


def locate(stacks: Sequence[Stack], clean: str) -> tuple[Stack, int, str] | None:
    """``(stack, key, rest)`` when ``clean`` lies in a block of one of ``stacks``, else None."""
    for stack in stacks:
        head = f"{stack.path}." if stack.path else ""
        if clean.startswith(head):
            key, _, rest = clean[len(head):].partition(".")
            if key.isdigit() and int(key) in stack.keys:
                return stack, int(key), rest
    return None


def describe_lists(names: Sequence[str]) -> str:
    """What a model without stacks holds, for errors: the integer-keyed lists its names show
    and why none is a stack, or that it has none."""
    candidates = _candidates(names)
    if not candidates:
        return ("no ModuleList, Sequential or integer-keyed ModuleDict holds parameters (top-level modules: "
                f"{sorted({n.split('.')[0] for n in names})[:8]})")
    lists = []
    for path, blocks in list(candidates.items())[:6]:
        why = ("one block" if len(blocks) < 2 else
               "its entries are single modules, not blocks" if not all(any("." in r for r in rests)
                                                                       for rests in blocks.values())
               else "its entries share no parameter")
        lists.append(f"{path or 'the model itself'} ({len(blocks)} entries: {why})")
    return "lists found, none a stack of two or more like blocks: " + "; ".join(lists)
