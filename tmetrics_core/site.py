"""Sites: the rank-symmetric description of one observed tensor.

A :class:`Site` says what a tensor is (canonical name, kind, layer, expert), its logical shape
and dtype, and its placement on every axis. Every rank knows every site of a plan, including
sites it does not hold (it then joins the collectives with a placeholder), so plans derived
from sites are the same on all ranks of an axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tmetrics_core.placements import Placement, Replica

__all__ = ["FROZEN", "Site", "SiteKey"]

SiteKey = tuple[str, str]
"""``(name, kind)``: a site's identity; the same parameter is one site per kind (param, grad)."""

FROZEN: tuple[tuple[str, object], ...] = (("frozen", True),)
""":attr:`Site.meta` of the sites of a parameter no rank trains (``requires_grad`` False on every
rank that holds it, as LoRA's base weights): no optimizer updates it."""


@dataclass(frozen=True, slots=True)
class Site:
    """One observed tensor, described identically on every rank.

    Attributes:
        name: canonical name (``"layers.3.attn.q.weight"``, ``"layers.3.moe.router_logits"``).
        kind: ``"param"``, ``"grad"``, ``"exp_avg"``, ``"exp_avg_sq"``, ``"update"``,
            ``"activation"``, ``"residual_accumulator"``, ``"residual_contribution"``,
            ``"logits"``, ``"router_logits"``, ``"router_topk"``...
        logical_shape: the unsharded shape; for population sites (tokens) the shape of one row
            is what is fixed: leading dims may be ``-1``.
        dtype: torch dtype name of the local tensor (``"bfloat16"``).
        placements: axis name -> placement; an axis absent here is ``Replica``.
        layer, expert: global indices, or None.
        family: the name with layer and expert indices replaced by ``*``.
        num_experts: for router sites, the global number of experts (sizes expert vectors).
    """

    name: str
    kind: str
    logical_shape: tuple[int, ...]
    dtype: str = "float32"
    placements: tuple[tuple[str, Placement], ...] = ()
    layer: int | None = None
    expert: int | None = None
    family: str = ""
    num_experts: int | None = None
    meta: tuple[tuple[str, object], ...] = field(default=(), compare=True)
    key: SiteKey = field(init=False, repr=False, compare=False)
    """``(name, kind)``; computed once (the hot path reads it per site and statistic)."""
    partial: bool = field(init=False, repr=False, compare=False)
    """Whether some placement is ``Partial``; computed once (checked per site and step)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.name, self.kind))
        object.__setattr__(self, "partial", any(p.is_partial() for _, p in self.placements))

    @property
    def placement_map(self) -> dict[str, Placement]:
        """Axis name -> placement, for the axes that are not Replica."""
        return dict(self.placements)

    def placement(self, axis: str) -> Placement:
        """The placement on ``axis`` (``Replica()`` when the site does not mention it)."""
        for name, placement in self.placements:
            if name == axis:
                return placement
        return Replica()

    def holds(self, coords: Mapping[str, int]) -> bool:
        """Whether the rank at axis coordinates ``coords`` holds (part of) this tensor: False
        exactly when some axis places it ``Owned`` by another axis rank."""
        return all(not p.is_owned() or coords.get(a, 0) == p.rank for a, p in self.placements)  # type: ignore[attr-defined]

    def local_shape(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The shape the rank at ``coords`` holds (or would hold, for a placeholder).

        Shard dims follow ``torch.chunk`` (a StridedShard its right-to-left chunks), applied in
        the order of ``placements``; a FlatShard gives ``(end - start,)``; Owned and Replica keep
        the logical shape. ``sizes`` maps axis names to axis sizes.
        """
        shape = list(self.logical_shape)
        for axis, placement in self.placements:
            if placement.is_flat_shard():
                return (placement.numel,)  # type: ignore[attr-defined]
            d = placement.shard_dim()
            if d is not None:  # Shard or StridedShard: both give local_length entries of dim d
                shape[d] = placement.local_length(shape[d], sizes[axis], coords.get(axis, 0))  # type: ignore[attr-defined]
        return tuple(shape)

    def describe(self) -> str:
        """``layers.3.attn.q.weight [grad] (4096, 1024) tp=S0 dp=R``: for error messages."""
        pl = " ".join(f"{a}={p}" for a, p in self.placements) or "replicated"
        return f"{self.name} [{self.kind}] {self.logical_shape} {pl}"
