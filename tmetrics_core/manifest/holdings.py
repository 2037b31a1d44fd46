"""What ranks hold: the manifest's rows before placements are inferred, mergeable across ranks.

A rank starts with :meth:`Holdings.local` (its own parameters); holdings received from other
ranks are folded in with :meth:`Holdings.merge`, so after an exchange over every axis that
differs (``tmetrics_core.distributed.manifest_exchange``) every rank holds the same union. The
size of a ``Holdings`` grows with the number of distinct tensors and the axis sizes, never with
the world size: per tensor it keeps each distinct row (shape, dtype, placements...) with one
global rank that listed it (for messages), and per axis the coordinates that hold it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping

__all__ = ["Holdings", "Row"]

Row = tuple
"""One tensor as a rank lists it, its key first. The manifest's: ``(name, original, layer,
expert, component, family, shape, dtype, dtensor placements, framework placements, covered
axes, shard tag, frozen)``, placements as ``(axis, repr)`` pairs, the shard tag the listing rank's
coordinates on the axes where a framework or config ``Shard`` splits a plain tensor
(``tmetrics_core.manifest.hand_split``); the token plan's: ``(site key, site)``."""


@dataclass
class Holdings:
    """Tensors listed by a set of ranks.

    ``rows`` maps each key (a canonical name, a site key) to its distinct rows, each with the lowest global rank
    among those whose listing was merged in (several rows for one name mean ranks disagree: a tensor split by hand, or
    a model cast on some ranks only). ``held`` maps each key to ``{axis: coordinates}`` where
    a listing rank stands. ``stacked`` is the largest expert count of a stacked tensor named
    whole on any of these ranks.
    """

    rows: dict[Hashable, dict[Row, int]] = field(default_factory=dict)
    held: dict[Hashable, dict[str, set[int]]] = field(default_factory=dict)
    stacked: int = 0

    @classmethod
    def local(cls, rows: Iterable[Row], coords: Mapping[str, int], rank: int, stacked: int) -> "Holdings":
        """The holdings of one rank at ``coords`` (axis -> axis rank), global rank ``rank``."""
        out = cls(stacked=stacked)
        for row in rows:
            out.rows[row[0]] = {row: rank}
            out.held[row[0]] = {axis: {c} for axis, c in coords.items()}
        return out

    def merge(self, other: "Holdings") -> None:
        """Fold ``other`` in: union of rows (lowest rank kept) and of coordinates."""
        for name, rows in other.rows.items():
            mine = self.rows.setdefault(name, {})
            for row, rank in rows.items():
                mine[row] = min(rank, mine.get(row, rank))
        for name, axes in other.held.items():
            mine_held = self.held.setdefault(name, {})
            for axis, coords in axes.items():
                mine_held.setdefault(axis, set()).update(coords)
        self.stacked = max(self.stacked, other.stacked)

    def spread(self, axis: str, size: int) -> None:
        """Every tensor listed here is held on all ``size`` coordinates of ``axis``: what an
        exchange concludes for an axis whose ranks all list the same rows."""
        for axes in self.held.values():
            axes[axis] = set(range(size))

    def fingerprint(self) -> int:
        """56-bit hash of the rows and ``stacked`` (not of ranks or coordinates): equal on two
        ranks exactly when they list the same tensors the same way (up to hash collisions)."""
        text = repr((sorted(repr(row) for rows in self.rows.values() for row in rows), self.stacked))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
