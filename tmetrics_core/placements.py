"""Placements: how one observed tensor is laid out along one named parallel axis.

Each observed local tensor carries one placement per axis (an axis missing from the mapping is
:class:`Replica`). The vocabulary follows DTensor's ``Replicate``/``Shard``/``Partial`` and adds
the three layouts training frameworks use outside DTensor:

=================  =====================================================  ====================
placement          what axis rank ``r`` of ``n`` holds                     counted as
=================  =====================================================  ====================
``Replica()``      the whole tensor, identical on every rank               once
``Shard(d)``       ``torch.chunk(t, n, dim=d)[r]`` (trailing may be empty)  sum over ranks
``Shard(None)``    its own part of a population (tokens, micro-batches)    sum over ranks
``StridedShard``   ``Shard(d)`` applied right-to-left (FSDP2 over TP)     sum over ranks
``FlatShard``      ``t.flatten()[start:end]`` (ranges may cut rows)         sum over ranks
``Owned(o)``       the whole tensor if ``r == o``, else nothing             the owner's only
``Partial(op)``    a partial value; the tensor is ``op`` over all ranks     reduced first
=================  =====================================================  ====================

This module is torch-free: placements are plain frozen values, compared and hashed by value.
``repr`` round-trips; ``str`` is a short tag for logs and tables (``S0``, ``R``, ``F[0:512)``,
``O3``, ``P(sum)``). :func:`parse_placement` reads either form back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Union

from tmetrics_core.errors import PlacementError

__all__ = [
    "FlatShard",
    "Owned",
    "Partial",
    "Placement",
    "ReduceOpName",
    "Replica",
    "Shard",
    "StridedShard",
    "chunk_range",
    "parse_placement",
]

ReduceOpName = Literal["sum", "max", "min"]
"""Reductions the executor issues (gloo supports them for every float dtype)."""

_PARTIAL_OPS = ("sum", "max", "min", "avg")


class Placement:
    """Base of the placement variants; carries only predicates, so callers need no isinstance."""

    __slots__ = ()

    def is_replica(self) -> bool:
        """True for :class:`Replica`: every rank of the axis holds the same values."""
        return False

    def is_shard(self, dim: int | None | Literal["any"] = "any") -> bool:
        """True for :class:`Shard` (on ``dim`` when given; ``None`` is the population split)."""
        return False

    def is_strided_shard(self) -> bool:
        """True for :class:`StridedShard` (a sibling of :class:`Shard`, not a kind of it: its
        pieces interleave, so code that assumes ``torch.chunk`` pieces must ask for it)."""
        return False

    def shard_dim(self) -> int | None:
        """The tensor dim a :class:`Shard` or :class:`StridedShard` splits (None for the
        population split ``Shard(None)`` and for every other placement). Either holds
        ``local_length`` entries of that dim; only ``Shard`` holds one contiguous piece."""
        return None

    def is_flat_shard(self) -> bool:
        """True for :class:`FlatShard`."""
        return False

    def is_owned(self) -> bool:
        """True for :class:`Owned`."""
        return False

    def is_partial(self) -> bool:
        """True for :class:`Partial`."""
        return False

    def splits(self) -> bool:
        """True when ranks hold disjoint pieces whose statistics merge across the axis
        (Shard, FlatShard, Owned); False for Replica and Partial."""
        return False


@dataclass(frozen=True, slots=True)
class Replica(Placement):
    """Every rank of the axis holds the whole tensor, identical (DTensor ``Replicate``)."""

    def is_replica(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split along tensor dim ``dim`` as ``torch.chunk`` splits it: axis rank ``r`` holds chunk
    ``r``; chunks are ``ceil(size / n)`` long, so trailing ranks may hold less or nothing.

    ``dim=None`` is a population split: each rank holds different rows of a population whose
    size is not fixed (tokens of different micro-batches, sequences split across data-parallel
    ranks). Negative dims are rejected: the logical rank is not known here.
    """

    dim: int | None

    def __post_init__(self) -> None:
        if self.dim is not None and (not isinstance(self.dim, int) or self.dim < 0):
            raise PlacementError(
                f"Shard(dim={self.dim!r}): dim must be a non-negative int (the tensor dim that is "
                "split) or None (a population split across ranks)"
            )

    def is_shard(self, dim: int | None | Literal["any"] = "any") -> bool:
        return dim == "any" or dim == self.dim

    def shard_dim(self) -> int | None:
        return self.dim

    def splits(self) -> bool:
        return True

    def runs(self, size: int, parts: int, index: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` runs of dim ``dim`` (of current size ``size``) that axis rank
        ``index`` of ``parts`` holds, in the order its local tensor stores them: one
        ``torch.chunk`` piece (possibly empty)."""
        return (chunk_range(size, parts, index),)

    def local_length(self, size: int, parts: int, index: int) -> int:
        """How many of ``size`` entries along ``dim`` axis rank ``index`` of ``parts`` holds."""
        return sum(length for _, length in self.runs(size, parts, index))

    def __str__(self) -> str:
        return "S*" if self.dim is None else f"S{self.dim}"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """DTensor's ``_StridedShard(dim, split_factor)``: ``Shard(dim)`` as if applied after the
    ``split_factor`` shards of the placements to its right (FSDP2 ``fully_shard`` over a
    tensor-parallel DTensor shards each TP piece again, along the same dim).

    Axis rank ``r`` of ``n`` holds, of the current ``size`` entries along ``dim``: piece ``r`` of
    ``torch.chunk(c, n)`` for each ``c`` in ``torch.chunk(range(size), split_factor)``,
    concatenated. Example, 8 rows, ``split_factor=2``, 2 ranks: rank 0 holds rows 0-1 and 4-5,
    rank 1 rows 2-3 and 6-7; a following ``Shard(0)`` on the TP axis then leaves rank (fsdp 0,
    tp 1) rows 4-5, as FSDP2 over TP stores them. For statistics over elements (sums, maxima,
    counts) it is a disjoint split like ``Shard``; row positions come from :meth:`runs`.

    A sibling of :class:`Shard`, not a subclass: ``is_shard()`` is False, so no code treats its
    interleaved pieces as one ``torch.chunk`` piece without asking ``is_strided_shard()``.
    """

    dim: int
    split_factor: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise PlacementError(f"StridedShard(dim={self.dim!r}): dim must be a non-negative int")
        if not isinstance(self.split_factor, int) or isinstance(self.split_factor, bool) or self.split_factor < 1:
            raise PlacementError(f"StridedShard(split_factor={self.split_factor!r}): need an int >= 1")

    def is_strided_shard(self) -> bool:
        return True

    def shard_dim(self) -> int | None:
        return self.dim

    def splits(self) -> bool:
        return True

    def runs(self, size: int, parts: int, index: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` runs of dim ``dim`` (of current size ``size``) that axis rank
        ``index`` of ``parts`` holds, in the order its local tensor stores them: one piece of
        each of the ``split_factor`` chunks."""
        out = []
        for j in range(self.split_factor):
            start, length = chunk_range(size, self.split_factor, j)
            inner, held = chunk_range(length, parts, index)
            if held:
                out.append((start + inner, held))
        return tuple(out)

    def local_length(self, size: int, parts: int, index: int) -> int:
        """How many of ``size`` entries along ``dim`` axis rank ``index`` of ``parts`` holds."""
        return sum(length for _, length in self.runs(size, parts, index))

    def __str__(self) -> str:
        return f"S{self.dim}/{self.split_factor}"


@dataclass(frozen=True, slots=True)
class FlatShard(Placement):
    """A contiguous range ``[start, end)`` of the row-major flattening of a tensor of shape
    ``logical_shape`` (ZeRO / distributed-optimizer buffers, FSDP1 flat parameters).

    Ranges may start and end inside a row; an empty range (``start == end``) is allowed.
    Example, ``logical_shape=(3, 4)`` split over 2 ranks as 6 + 6 elements:

    ====  ===========  ================================
    rank  range        rows touched
    ====  ===========  ================================
    0     ``[0, 6)``   row 0 whole, row 1 columns 0-1
    1     ``[6, 12)``  row 1 columns 2-3, row 2 whole
    ====  ===========  ================================
    """

    logical_shape: tuple[int, ...]
    start: int = field(kw_only=True)
    end: int = field(kw_only=True)

    def __post_init__(self) -> None:
        shape = tuple(self.logical_shape)
        object.__setattr__(self, "logical_shape", shape)
        numel = 1
        for size in shape:
            if not isinstance(size, int) or size < 0:
                raise PlacementError(f"{self!r}: logical_shape must hold non-negative ints")
            numel *= size
        if not (0 <= self.start <= self.end <= numel):
            raise PlacementError(
                f"{self!r}: need 0 <= start <= end <= numel = {numel} of logical_shape {shape}"
            )

    @property
    def numel(self) -> int:
        """Elements this rank holds: ``end - start``."""
        return self.end - self.start

    def is_flat_shard(self) -> bool:
        return True

    def splits(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"F[{self.start}:{self.end})"


@dataclass(frozen=True, slots=True)
class Owned(Placement):
    """Axis rank ``rank`` holds the whole tensor; the other ranks of the axis hold nothing and
    join the collectives with a neutral placeholder (an expert under expert parallelism, a layer
    under pipeline parallelism)."""

    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise PlacementError(f"Owned(rank={self.rank!r}): rank must be an axis rank >= 0")

    def is_owned(self) -> bool:
        return True

    def splits(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"O{self.rank}"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Unreduced partial values: the logical tensor is ``op`` applied elementwise over the
    ranks' local tensors (DTensor ``Partial``, outputs of a row-parallel linear)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in _PARTIAL_OPS:
            raise PlacementError(f"Partial(op={self.op!r}): op must be one of {_PARTIAL_OPS}")

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"P({self.op})"


PlacementLike = Union[Placement, str]

_STRIDED = re.compile(r"^(?:S(?P<d>\d+)/(?P<f>\d+)|StridedShard\(dim=(?P<ld>\d+), split_factor=(?P<lf>\d+)\))$")
_SHORT = re.compile(
    r"^(?:(?P<r>R)|S(?P<s>\d+|\*)|O(?P<o>\d+)|P\((?P<p>\w+)\)|F\[(?P<fs>\d+):(?P<fe>\d+)\))$"
)
_LONG = re.compile(r"^(?P<cls>Replica|Replicate|Shard|Owned|Partial)\((?P<arg>[^)]*)\)$")


def parse_placement(text: PlacementLike, *, logical_shape: tuple[int, ...] | None = None) -> Placement:
    """Read a placement from its ``str`` tag (``"S0"``, ``"R"``, ``"O1"``, ``"P(sum)"``) or its
    ``repr`` (``"Shard(dim=0)"``, ``"Shard(0)"``, ``"S0/2"`` or
    ``"StridedShard(dim=0, split_factor=2)"``, ``"Replica()"``, ``"Owned(1)"``,
    ``"Partial('sum')"``); a Placement is returned as is. A ``F[start:end)`` tag needs
    ``logical_shape``. Raises :class:`PlacementError` naming the accepted forms.
    """
    if isinstance(text, Placement):
        return text
    s = str(text).strip()
    strided = _STRIDED.match(s)
    if strided:
        return StridedShard(int(strided["d"] or strided["ld"]), split_factor=int(strided["f"] or strided["lf"]))
    m = _SHORT.match(s)
    if m:
        if m["r"]:
            return Replica()
        if m["s"]:
            return Shard(None if m["s"] == "*" else int(m["s"]))
        if m["o"]:
            return Owned(int(m["o"]))
        if m["p"]:
            return Partial(m["p"])
        if logical_shape is None:
            raise PlacementError(f"placement {s!r}: a FlatShard tag needs the tensor's logical_shape")
        return FlatShard(tuple(logical_shape), start=int(m["fs"]), end=int(m["fe"]))
    m = _LONG.match(s)
    if m:
        arg = m["arg"].split("=")[-1].strip().strip("'\"")
        cls = m["cls"]
        if cls in ("Replica", "Replicate"):
            return Replica()
        if cls == "Partial":
            return Partial(arg or "sum")
        if cls == "Shard" and arg in ("", "None"):
            return Shard(None)
        if arg.isdigit():
            return Shard(int(arg)) if cls == "Shard" else Owned(int(arg))
    raise PlacementError(
        f"cannot read placement {s!r}; use one of: 'R' or 'Replica()', 'S0' or 'Shard(0)', "
        "'S*' or 'Shard(None)' (population split), 'O1' or 'Owned(1)', 'P(sum)' or 'Partial(sum)'"
    )


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` into ``parts``.

    Chunks are ``ceil(size / parts)`` long; trailing chunks may be shorter or empty, e.g.
    ``size=5, parts=4`` gives lengths 2, 2, 1, 0.
    """
    step = -(-size // parts) if parts else 0
    start = min(step * index, size)
    return start, min(step, size - start)
