"""The manifest table: every model tensor under its canonical name, with placements and owners.

Built once per run. Each rank lists the parameters it holds (canonical name, logical shape,
dtype, DTensor and framework placements, its axis coordinates) as :class:`~tmetrics_core.manifest.holdings.Holdings`; the caller's
``share`` (``tmetrics_core.distributed.manifest_exchange``, through the collectives seam) turns
them into the union over all ranks, exchanging only over the axes whose ranks list different
tensors, and every rank derives the same table. Each axis of a tensor takes its placement from
the first of these that gives one, and the entry records which (its *origin*):

1. ``declared``: the config's ``placements:`` (glob on the canonical name);
2. ``framework``: a framework integration (Megatron parameter attributes, a known layout),
   passed as ``framework_placements`` keyed by the original parameter name;
3. ``dtensor``: the parameter is a DTensor (mesh dim names become axes);
4. ``inferred``: from who holds the canonical name on the axis:

* held on every coordinate of an axis -> ``Replica`` (DDP, or a tensor outside a stage's
  ownership split);
* held on one coordinate only -> ``Owned(coordinate)`` (an expert under expert parallelism, a
  layer under pipeline parallelism, both with global indices in the canonical name);
* anything else is ambiguous and must be declared in the config's ``placements:``.

An axis that is not a dim of a DTensor parameter's mesh but whose ranks all lie in that mesh
(torchtitan's expert mesh ``(efsdp, ep)`` and dense mesh ``(fsdp, tp)`` span the same ranks) is
``covered``: the DTensor's own placements already say how the tensor lies on those ranks, so the
axis gets no placement, no reduction and no Replica claim. An axis whose ranks lie partly in
the mesh is a :class:`~tmetrics_core.errors.PlacementError`.

Every rank then knows every tensor, including those held elsewhere, and joins their collectives
with placeholders: the plan is the same on every rank of an axis. A ``Replica`` claim, whatever
its origin, is only a claim: ``tmetrics_core.distributed.replicas`` checks it against the values
and records the check in :attr:`~tmetrics_core.manifest.entry.TensorEntry.verified`.
"""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterable, Mapping, overload

import torch

from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.manifest.dtensor import dtensor_placements
from tmetrics_core.manifest.entry import TensorEntry
from tmetrics_core.manifest.hand_split import shard_tag
from tmetrics_core.manifest.holdings import Holdings, Row
from tmetrics_core.manifest.placing import covered_axes, merge, slice_of
from tmetrics_core.manifest.slices import SliceView
from tmetrics_core.naming.canonical import canonicalize
from tmetrics_core.naming.name import CanonicalName
from tmetrics_core.naming.pieces import qkv_views
from tmetrics_core.naming.layouts.torchtitan import fused_qkv_geometry
from tmetrics_core.placements import Placement
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["Manifest"]


@dataclass
class Manifest:
    """Every tensor of the model by canonical name, identical on every rank.

    ``entries`` holds every tensor of every rank; ``local`` maps canonical names to this rank's
    parameter objects (absent for tensors held elsewhere, and for those its placements say are
    held elsewhere: a copy here of a tensor declared ``Owned`` by another rank). A stacked
    expert tensor is one entry per expert (and fused part), each mapped in ``local`` to the
    stored parameter and in ``views`` to how its slice is read from that parameter's local
    tensor (see `viewed`).
    """

    entries: list[TensorEntry]
    local: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    stacked_experts: int = 0
    """Experts along the expert dim of the largest tensor that stacks them and is named whole
    (not split per expert); its global shape under expert parallelism."""
    views: dict[str, SliceView] = field(default_factory=dict)
    slices: dict[str, CanonicalName] = field(default_factory=dict)
    """Canonical names of the expert slices held here (regions in global coordinates)."""

    @classmethod
    def build(cls, model: torch.nn.Module, topology: Topology, *,
              overrides: Mapping[str, Mapping[str, str]] | None = None,
              framework_placements: Mapping[str, Mapping[str, Placement]] | None = None,
              layer_offset: int = 0, expert_offset: int = 0, layout: str | None = None,
              qkv_select: Iterable[str] = (),
              share: Callable[[Holdings], Holdings] | None = None) -> "Manifest":
        """Canonicalize ``model``'s parameters, share them across ranks and infer placements.

        Args:
            overrides: the config's ``placements:``, glob on canonical names -> ``{axis: tag}``.
            framework_placements: placements a framework integration knows, keyed by the
                ORIGINAL parameter name (as ``model.named_parameters()`` gives it) ->
                ``{axis: Placement}``; below ``overrides``, above DTensor and inference.
            qkv_select: the metrics' ``select`` globs. A fused q/k/v tensor (torchtitan's
                ``wqkv``) is listed as its ``attn.q``, ``attn.k`` and ``attn.v`` views instead of
                whole when a glob matches a view's name and not the whole tensor's
                (``layers.*.attn.k.*``); the views partition it, so layer sums are unchanged.
            share: this rank's holdings -> the union over all ranks (called once, on every rank
                alike); needed when ``topology`` has more than one rank.

        Raises:
            ValueError: several ranks and no ``share``.
            ConfigError: a DTensor or framework axis that is not in ``topology``; an override
                naming an unknown axis or an unreadable placement; a tensor held on some but not
                all coordinates of an axis without an override saying how.
        """
        params = dict(model.named_parameters())
        names = canonicalize(params.items(), layer_offset=layer_offset, expert_offset=expert_offset, layout=layout,
                             split_stacked=True)
        split = _qkv_split(model, names, params, tuple(qkv_select))
        if split:
            names = canonicalize(params.items(), layer_offset=layer_offset, expert_offset=expert_offset,
                                 layout=layout, split_stacked=True, qkv_groups=split)
        coords = topology.coords()
        local_rows: list[Row] = []
        local: dict[str, torch.nn.Parameter] = {}
        views: dict[str, SliceView] = {}
        slices: dict[str, CanonicalName] = {}
        for cn in names:
            p = params[cn.original]
            placements = dtensor_placements(p, cn.original) or ()
            for axis, _ in placements:
                if axis not in topology.axes:
                    raise ConfigError(
                        f"parameter {cn.original!r} is a DTensor on mesh dim {axis!r}, which is not an axis "
                        f"of the topology {list(topology.names)}; pass mesh= with the full DeviceMesh"
                    )
            framework = dict((framework_placements or {}).get(cn.original, {}))
            for axis, placement in framework.items():
                if axis not in topology.axes or not isinstance(placement, Placement):
                    raise ConfigError(
                        f"framework placement {axis}={placement!r} of parameter {cn.original!r}: need an axis "
                        f"of the topology {list(topology.names)} and a tmetrics Placement"
                    )
            shape = tuple(p.shape)
            covered = covered_axes(cn.original, p, topology)
            if cn.region:
                placements, view = slice_of(cn, p, topology)
                if view is None:
                    continue  # an expert slice held by other ranks only: they list it
                views[cn.name] = view
                slices[cn.name] = cn
                shape = tuple(cn.view(torch.empty(p.shape, device="meta")).shape)
            local[cn.name] = p
            tag = shard_tag(cn.name, framework, overrides or {}, topology) if not placements else ()
            local_rows.append((cn.name, cn.original, cn.layer, cn.expert, cn.component, cn.family,
                               shape, str(p.dtype).replace("torch.", ""),
                               tuple((a, repr(pl)) for a, pl in placements),
                               tuple((a, repr(pl)) for a, pl in framework.items()), covered, tag,
                               not p.requires_grad))
        stacked = max((int(params[cn.original].shape[cn.expert_dim]) for cn in names
                       if cn.expert_dim is not None and cn.expert is None), default=0)
        mine = Holdings.local(local_rows, coords, topology.global_rank, stacked)
        if topology.world_size > 1 and share is None:
            raise ValueError(f"{topology} has several ranks: pass share= (tmetrics_core.distributed."
                             "manifest_exchange.share_holdings) so every rank learns what the others hold")
        everything = share(mine) if share is not None and topology.world_size > 1 else mine
        entries = merge(everything, topology, overrides or {})
        # A copy on a rank that a declared Owned(r) says does not hold it (a stale replica on a
        # non-owner) is not read: that rank joins with a placeholder, like any rank without it.
        for entry in entries:
            if entry.name in local and not entry.site("param").holds(coords):
                del local[entry.name]
        return cls(entries, local, stacked_experts=everything.stacked, views=views, slices=slices)

    def mark_verified(self, kind: str, checked: Iterable[tuple[str, str]]) -> None:
        """Record that the Replica claims ``(canonical name, axis)`` in ``checked`` held for the
        values of source ``kind`` on every rank of the axis."""
        by_name: dict[str, list[str]] = {}
        for name, axis in checked:
            by_name.setdefault(name, []).append(axis)
        self.entries = [
            e if e.name not in by_name else dataclasses.replace(
                e, verified=e.verified + tuple((a, kind) for a in by_name[e.name] if (a, kind) not in e.verified))
            for e in self.entries
        ]

    def slice_placements(self, name: str, tensor: torch.Tensor, topology: Topology
                         ) -> tuple[tuple[str, Placement], ...] | None:
        """The non-Replica placements of expert slice ``name`` of ``tensor`` (a DTensor of its
        stored parameter's global shape, e.g. its gradient, whose placements may differ from the
        parameter's: ``Partial``), or None when ``name`` is not a slice or ``tensor`` no DTensor.

        Raises:
            PlacementError: ``tensor`` is sharded otherwise than the parameter (its slice would
                lie elsewhere than the view reads), or as `place_slice` raises.
        """
        cn = self.slices.get(name)
        if cn is None or dtensor_placements(tensor) is None:
            return None
        placements, view = slice_of(cn, tensor, topology)
        if view != self.views.get(name):
            raise PlacementError(f"{name}: {cn.original!r} is sharded as {tuple(tensor.placements)} "  # type: ignore[attr-defined]
                                 "here but its parameter otherwise; tmetrics reads the slice where the parameter "
                                 "holds it, so it cannot read this tensor's slice")
        return tuple(p for p in placements if not p[1].is_replica())

    @overload
    def viewed(self, name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    @overload
    def viewed(self, name: str, tensor: None) -> None: ...

    def viewed(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` (a local tensor of the stored parameter's local shape: the parameter, its
        gradient, optimizer state or snapshot) as entry ``name`` reads it: the expert slice's
        view for a stacked tensor, else ``tensor`` itself. None stays None."""
        view = self.views.get(name)
        return tensor if view is None or tensor is None else view(tensor)

    def sites(self, kind: str) -> list[Site]:
        """One site per tensor for ``kind``, in manifest order (sorted by canonical name)."""
        return [e.site(kind) for e in self.entries]

    def rows(self) -> list[dict[str, Any]]:
        """Rows for ``tmetrics names`` and the manifest artifact."""
        return [e.row() for e in self.entries]

    @property
    def num_layers(self) -> int:
        """Highest global layer index + 1 (0 without layers)."""
        return 1 + max((e.layer for e in self.entries if e.layer is not None), default=-1)

    @property
    def num_experts(self) -> int:
        """Highest global expert index + 1, or the experts of a stacked tensor (0 without experts)."""
        return max(self.stacked_experts, 1 + max((e.expert for e in self.entries if e.expert is not None), default=-1))


def _qkv_split(model: torch.nn.Module, names: list[CanonicalName], params: Mapping[str, torch.Tensor],
               select: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The fused q/k/v tensors some glob of ``select`` asks to see as q/k/v views."""
    if not select:
        return {}
    geometry = fused_qkv_geometry(model)
    out = {}
    for cn in names:
        if cn.original not in geometry or cn.component != "attn.qkv":
            continue
        views = qkv_views(cn, tuple(params[cn.original].shape), *geometry[cn.original])
        if any(fnmatchcase(v.name, g) and not fnmatchcase(cn.name, g) for v in views for g in select):
            out[cn.original] = geometry[cn.original]
    return out
