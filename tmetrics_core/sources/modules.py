"""The module index: paths, blocks, head and layer indices of a model's modules.

Blocks are the entries of the stacks of repeated blocks the parameter names show, under any
prefix (`tmetrics_core.naming.stacks`), with the usual list names (``layers``, ``h``,
``blocks``, ``decoder.layers``) as hints for a model of one block; the head under ``head``,
``lm_head``, ``output`` or ``output_layer``. One block object at several positions of its list
(ALBERT-style sharing) is observed at each call depth as the layer of that position
(`tmetrics_core.sources.depths`), its cotangents too. The forward hooks on blocks, the head and
the modules ``modules:`` globs pick are :mod:`tmetrics_core.sources.module_hooks`'.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Sequence

import torch

from tmetrics_core import torch_private

from tmetrics_core.naming.canonical import canonicalize, strip_wrappers
from tmetrics_core.naming.stacks import find_stacks
from tmetrics_core.observe import register_modules
from tmetrics_core.sources.depths import Depths

__all__ = ["ModuleIndex"]

_BLOCK_LISTS = ("layers", "h", "blocks", "decoder.layers", "transformer.h", "model.layers")
_HEADS = ("head", "lm_head", "output", "output_layer")


class ModuleIndex:
    """Paths, blocks and layer indices of a model's modules, computed once.

    ``layer_offset`` is added to list positions of ``nn.ModuleList`` blocks (a pipeline stage
    holding layers 8..15 passes 8); ``nn.ModuleDict`` blocks keyed by integers keep their keys.
    A block of a model's second stack (a decoder after its encoder) adds the stack's base.
    """

    def __init__(self, model: torch.nn.Module, *, layer_offset: int = 0) -> None:
        self.paths: dict[int, str] = {}
        self.named: list[tuple[str, torch.nn.Module]] = []
        self.blocks: list[tuple[str, int, torch.nn.Module]] = []
        self.head: tuple[str, torch.nn.Linear] | None = None
        self.canonical: dict[str, str] = {}
        """Module path -> canonical module name (see :func:`_canonical_modules`), where it has one."""
        renamed: dict[str, str] = {}  # local block path -> global one (pipeline stages' ModuleLists)
        by_raw = _canonical_modules(model, layer_offset)
        stacks = find_stacks([strip_wrappers(name) for name, _ in model.named_parameters()])
        bases = {stack.path: stack.base for stack in stacks}
        lists = set(_BLOCK_LISTS) | set(bases)
        block_paths: set[str] = set()
        layers: dict[str, int] = {}  # global block path -> layer id
        shared: list[tuple[torch.nn.Module, list[tuple[str, int]]]] = []
        for raw, module in model.named_modules():
            path = strip_wrappers(raw) if raw else ""
            parent, _, key = path.rpartition(".")
            if parent in lists and key.isdigit() and raw:
                offset = layer_offset if isinstance(_parent(model, raw), torch.nn.ModuleList) else 0
                renamed[path] = f"{parent}.{int(key) + offset}".lstrip(".")  # "" : the model is the list
                layers[renamed[path]] = bases.get(parent, 0) + int(key) + offset
            path = _global_path(path, renamed)
            self.paths[id(module)] = path
            self.named.append((path, module))
            if raw in by_raw:
                self.canonical[path] = by_raw[raw]
            if path in layers and path.rpartition(".")[0] in lists and path not in block_paths:
                # A wrapper (checkpoint_wrapper, torch.compile's OptimizedModule, FSDP) and the
                # block it wraps share one path: the outermost, listed first, is the block.
                self.blocks.append((path, layers[path], module))
                block_paths.add(path)
                at = _positions(_parent(model, raw), module)
                if len(at) > 1:
                    listed, _, number = path.rpartition(".")
                    shift = int(number) - int(key)  # the list's layer offset
                    shared.append((module, [(f"{listed}.{k + shift}".lstrip("."), layers[path] - int(key) + k)
                                            for k in at]))
            if path in _HEADS and isinstance(module, torch.nn.Linear) and self.head is None:
                self.head = (path, module)
        self.depths = Depths(model, shared, {id(m): p for p, _, m in self.blocks})
        """Blocks at several positions of their list: a stand-in module per later position."""
        for path, stand_in, layer in self.depths.stand_ins():
            self.paths[id(stand_in)] = path
            self.named.append((path, stand_in))
            self.blocks.append((path, layer, stand_in))
        self._block_paths = sorted(((p, i) for p, i, _ in self.blocks), key=lambda pi: -len(pi[0]))
        register_modules(m for _, m in self.named)  # observations under torch.compile name them by id

    def path(self, module: torch.nn.Module) -> str:
        """The cleaned module path (``layers.3.moe``); ``?`` for a module not in the model."""
        return self.paths.get(id(module), "?")

    def layer_of(self, path: str) -> int | None:
        """Global layer index of the block containing ``path``; else the layer of its canonical
        name (``layers.3.moe``: blocks in lists named otherwise, as Switch Transformers'
        ``encoder.block``); else None."""
        for block, index in self._block_paths:
            if path == block or path.startswith(block + "."):
                return index
        named = re.match(r"layers\.(\d+)(?:\.|$)", self.canonical.get(path, ""))
        return int(named.group(1)) if named else None

    def family_of(self, path: str) -> str:
        """The module's name (`name_of`) with the layer index replaced by ``*``."""
        canonical = self.canonical.get(path)
        if canonical is not None:
            return re.sub(r"^layers\.\d+(?=\.|$)", "layers.*", canonical)
        for block, _ in self._block_paths:
            if path == block or path.startswith(block + "."):
                return re.sub(r"\.\d+$", ".*", block) + path[len(block):]
        return path

    def matching(self, patterns: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
        """Modules whose canonical name or cleaned path matches one of the globs, one per path
        (of a wrapper and the module it wraps, the wrapper: hooking both would observe every
        output twice)."""
        if not patterns:  # the common case, on every due step: no scan of the model
            return []
        out: dict[str, torch.nn.Module] = {}
        for p, m in self.named:  # a wrapper and what it wraps share a path: the outermost only
            if p and p not in out and self.matches(p, patterns):
                out[p] = m
        return list(out.items())

    def matches(self, path: str, patterns: Sequence[str]) -> bool:
        """Whether a glob matches module ``path``'s canonical name (``layers.3.mlp``) or the path
        itself (``model.layers.3.mlp``)."""
        name = self.canonical.get(path)
        return any(fnmatchcase(path, g) or (name is not None and fnmatchcase(name, g)) for g in patterns)

    def name_of(self, path: str) -> str:
        """The canonical name of module ``path``, or the path where it has none."""
        return self.canonical.get(path, path)


def _canonical_modules(model: torch.nn.Module, layer_offset: int) -> dict[str, str]:
    """Raw module path -> canonical module name: the longest common prefix (in dotted pieces) of
    the canonical names, leaf dropped, of the parameters below it. A Hugging Face
    ``model.layers.3.self_attn`` holds ``layers.3.attn.{q,k,v,o}.weight``, so it is
    ``layers.3.attn``; its ``mlp`` of a Mixtral block (router and experts) is ``layers.3.moe``.
    Modules without parameters, whose parameters share no prefix, or whose parameters all lie in
    one child (which has that name) have none."""
    below: dict[str, list[list[str]]] = {}
    for cn in canonicalize(model.named_parameters(), layer_offset=layer_offset):
        pieces = cn.name.split(".")[:-1]
        for original in (cn.original, *cn.tied):
            parts = original.split(".")[:-1]
            for depth in range(len(parts) + 1):
                below.setdefault(".".join(parts[:depth]), []).append(pieces)
    out: dict[str, str] = {}
    for raw, names in sorted(below.items(), key=lambda item: -item[0].count(".") - bool(item[0])):
        common = names[0]
        for pieces in names[1:]:
            n = 0
            while n < min(len(common), len(pieces)) and common[n] == pieces[n]:
                n += 1
            common = common[:n]
        name = ".".join(common)
        # A module whose parameters all lie in one child would take the child's name: it has none.
        if common and not any(other == name and below_path.startswith(raw + "." if raw else "")
                              for below_path, other in out.items()):
            out[raw] = name
    return out


def _positions(parent: torch.nn.Module | None, module: torch.nn.Module) -> list[int]:
    """The integer keys under which ``parent`` (a list) holds ``module``: several when one block
    object is reused (``named_modules`` lists it once, under its first key)."""
    if parent is None:
        return []
    return [int(k) for k, m in torch_private.child_modules(parent).items() if m is module and k.isdigit()]


def _parent(model: torch.nn.Module, raw: str) -> torch.nn.Module | None:
    parent_path = raw.rpartition(".")[0]
    try:
        return model.get_submodule(parent_path)
    except AttributeError:
        return None


def _global_path(path: str, renamed: dict[str, str]) -> str:
    """``path`` with its block prefix replaced by the block's global path (same names on every
    pipeline stage would otherwise merge different layers into one site)."""
    for local, global_ in renamed.items():
        if path == local or path.startswith(local + "."):
            return global_ + path[len(local):]
    return path
