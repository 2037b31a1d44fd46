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

__all__ = ["Depths"]

log = logging.getLogger("tmetrics")


class Depths:
    """Stand-ins and call counters for the blocks held at several positions of their list.

    Args:
        model: the model whose forward starts a new count (a forward pre-hook resets it).
        shared: ``(block, [(path, layer) per position in key order])`` for each block held at
            two or more positions; the first position is the block itself.
    """

    def __init__(self, model: torch.nn.Module, shared: list[tuple[torch.nn.Module, list[tuple[str, int]]]]) -> None:
        self._model = model
        self._at: dict[int, list[torch.nn.Module]] = {}
        self._paths: list[tuple[str, torch.nn.Module, int]] = []
        self._calls: dict[int, int] = {}
        self._current: dict[int, int] = {}
        self._said = False
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
        if stand_ins is None:
            return record_residual
        key = id(block)

        def at_depth(module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *, accumulator: bool) -> None:
            record_residual(stand_ins[self._current.get(key, 0) % len(stand_ins)], h, x, accumulator=accumulator)
        return at_depth

    def install(self) -> list[Any]:
        """The counting hooks (none when no block is shared); returns their handles."""
        if not self._at:
            return []
        handles = [self._model.register_forward_pre_hook(lambda module, args: self._calls.clear())]
        for key, stand_ins in self._at.items():
            handles.append(stand_ins[0].register_forward_pre_hook(self._counter(key, len(stand_ins))))
        return handles

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
