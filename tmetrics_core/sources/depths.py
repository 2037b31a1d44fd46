"""One block object at several depths: ALBERT-style sharing, where a list holds the same block at
positions 0..n-1 (``nn.ModuleList([block] * n)``) and a forward calls it once per position.

``named_modules()`` lists such a block once, under its first key, so a residual hook on it saw
every depth as layer 0: the record summed all depths (an L2 of 5.13 where layer 0's is 2.12)
and the other layers wrote nothing. Here each later position gets a stand-in module (no
parameters, its own path ``layers.{k}``); a forward pre-hook on the block counts its calls
since the model's forward began, and call ``c`` is observed as position ``c``'s stand-in, so
each depth is its own site with its own layer id.

A forward calling the block more often than the list holds it (a loop over the list twice) goes
round the positions again (call ``c`` is position ``c mod n``), pooling those depths; each rank
says so once. Parameters are unaffected: the shared weight is one tensor, named once at its
first position, and its gradient is the sum over depths that autograd gives.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from tmetrics_core import torch_private

__all__ = ["Depths"]

log = logging.getLogger("tmetrics")


class Depths:
    """Stand-ins and call counters for the blocks held at several positions of their list.

    Args:
        model: the model whose forward starts a new count (a forward pre-hook resets it).
        shared: ``(block, [(path, layer) per position in key order])`` for each block held at
            two or more positions; the first position is the block itself.
        paths: ``id(block) -> path`` of every block, for the word below.

    A block held at one position and run more than once in one forward (a loop over one block,
    or a list entry called twice) is one layer: its record pools the calls, and each
    rank says so once (counted uncompiled only, and not during backward recomputation).
    """

    def __init__(self, model: torch.nn.Module, shared: list[tuple[torch.nn.Module, list[tuple[str, int]]]],
                 paths: dict[int, str]) -> None:
        self._model = model
        self._at: dict[int, list[torch.nn.Module]] = {}
        self._paths: list[tuple[str, torch.nn.Module, int]] = []
        self._calls: dict[int, int] = {}
        self._current: dict[int, int] = {}
        self._said = self._said_pooled = self._forwards = False
        self._paths_of = dict(paths)
        for block, positions in shared:
            stand_ins = [block]
            for path, layer in positions[1:]:
                stand_in = torch.nn.Module()
                stand_ins.append(stand_in)
                self._paths.append((path, stand_in, layer))
            self._at[id(block)] = stand_ins
        self._stand_in_ids = {id(m) for _, m, _ in self._paths}

    def stand_ins(self) -> list[tuple[str, torch.nn.Module, int]]:
        """``(path, stand-in, layer)`` for every later position of every shared block."""
        return list(self._paths)

    def is_stand_in(self, module: torch.nn.Module) -> bool:
        return id(module) in self._stand_in_ids

    def wrap(self, block: torch.nn.Module, record_residual: Callable[..., None]) -> Callable[..., None]:
        """``record_residual`` for ``block``'s hook: the module passed on is the stand-in of the
        current call's position (the block itself when it is not shared)."""
        stand_ins = self._at.get(id(block))
        key = id(block)
        if stand_ins is None:
            def once_per_forward(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *,
                                 accumulator: bool) -> None:
                if not (self._said_pooled or torch.compiler.is_compiling()
                        or torch_private.in_backward()):  # not recomputation in backward
                    calls = self._calls[key] = self._calls.get(key, 0) + 1
                    if calls == 2 and self._forwards:
                        self._said_pooled = True
                        log.warning("tmetrics: block %s ran more than once in one forward: its residual record "
                                    "pools every call (one record for the layer, not one per depth). Hold the block "
                                    "at one list position per depth (nn.ModuleList([block] * n)) for a record per "
                                    "depth. Said once.", self._paths_of.get(key, "?"))
                record_residual(module, h, x, accumulator=accumulator)
            return once_per_forward

        def at_depth(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *, accumulator: bool) -> None:
            record_residual(stand_ins[self._current.get(key, 0) % len(stand_ins)], h, x, accumulator=accumulator)
        return at_depth

    def current(self, block: torch.nn.Module) -> torch.nn.Module:
        """The stand-in of ``block``'s current call position (``block`` when it is not shared)."""
        stand_ins = self._at.get(id(block))
        return block if stand_ins is None else stand_ins[self._current.get(id(block), 0) % len(stand_ins)]

    def install(self) -> list[Any]:
        """The counting hooks: the model's forward starts a count; returns their handles."""
        handles = [self._model.register_forward_pre_hook(self._new_forward)]
        for key, stand_ins in self._at.items():
            handles.append(stand_ins[0].register_forward_pre_hook(self._counter(key, len(stand_ins))))
        return handles

    def _new_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() and not self._at:
            return  # only the word counts: nothing to trace into a graph
        self._calls.clear()
        self._forwards = True

    def _counter(self, key: int, positions: int) -> Callable[..., None]:
        def count(module: torch.nn.Module, args: Any) -> None:
            call = self._calls.get(key, 0)
            self._calls[key] = call + 1
            self._current[key] = call
            if call == positions and not self._said:
                self._said = True
                log.warning("tmetrics: a block held at %d positions of its list was called more often in one "
                            "forward; calls beyond the %dth are observed as positions again (call c as position "
                            "c mod %d), so those depths are pooled in one record per position", positions,
                            positions, positions)
        return count
