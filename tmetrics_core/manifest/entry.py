"""``TensorEntry``: one logical model tensor of the manifest, as every rank sees it (no data),
and :data:`ORIGINS`, the words for where each of its placements came from
(:mod:`tmetrics_core.manifest.table` says how they are chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tmetrics_core.placements import Placement
from tmetrics_core.site import FROZEN, Site

__all__ = ["ORIGINS", "TensorEntry"]

ORIGINS = ("declared", "framework", "dtensor", "covered", "inferred")
"""Where a placement came from, highest precedence first (``covered``: the axis lies inside the
DTensor's own mesh and has no placement of its own)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One logical model tensor as every rank sees it (no tensor data)."""

    name: str
    original: str
    layer: int | None
    expert: int | None
    component: str
    family: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[tuple[str, Placement], ...]
    holders: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(axis, coordinates)`` for every axis on which some coordinates do not hold the tensor
    (an Owned layer: ``(("pp", (1,)),)``); empty when every rank holds it."""
    origins: tuple[tuple[str, str], ...] = ()
    """``(axis, origin)`` for every axis with a placement claim, ``Replica`` claims included (an
    axis absent from :attr:`placements` but listed here is a Replica claim); origins are the
    words of :data:`ORIGINS`."""
    verified: tuple[tuple[str, str], ...] = ()
    """``(axis, source kind)`` pairs whose Replica claim was checked against the values on every
    rank of the axis (``param`` at start-up, ``grad``, ``exp_avg``... at their first due step)."""
    frozen: bool = False
    """``requires_grad`` is False on every rank that holds it (LoRA's base weights): no
    optimizer updates it. Its sites carry ``("frozen", True)`` in :attr:`Site.meta`."""

    def origin(self, axis: str) -> str | None:
        """Where the placement on ``axis`` came from, or None when nothing claimed it (an axis of
        size 1)."""
        return dict(self.origins).get(axis)

    def replica_axes(self) -> tuple[str, ...]:
        """Axes on which this tensor is claimed to be a Replica (of any origin; ``covered``
        axes are no claim)."""
        held = dict(self.placements)
        return tuple(a for a, o in self.origins if a not in held and o != "covered")

    def site(self, kind: str) -> Site:
        """The site of this tensor for source ``kind`` (``param``, ``grad``, ``exp_avg``...)."""
        return Site(name=self.name, kind=kind, logical_shape=self.shape, dtype=self.dtype,
                    placements=self.placements, layer=self.layer, expert=self.expert, family=self.family,
                    meta=FROZEN if self.frozen else ())

    def row(self) -> dict[str, Any]:
        """The ``tmetrics names`` row (keys of ``names_table.MANIFEST_KEYS``)."""
        numel = 1
        for s in self.shape:
            numel *= s
        return {
            "name": self.name, "original": self.original, "layer": self.layer, "expert": self.expert,
            "component": self.component, "shape": list(self.shape), "dtype": self.dtype, "numel": numel,
            "placements": {a: str(p) for a, p in self.placements},
            "owners": {a: list(c) for a, c in self.holders} or "all",
            "origins": dict(self.origins),
            "verified": {a: [k for ax, k in self.verified if ax == a] for a in dict.fromkeys(a for a, _ in self.verified)},
        }
