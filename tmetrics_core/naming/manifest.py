"""The manifest: every model tensor under its canonical name, with placements and owners.

Built once per run. Each rank lists the parameters it holds (canonical name, logical shape,
dtype, DTensor and framework placements, its axis coordinates) as :class:`Holdings`; the caller's
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
and records the check in :attr:`TensorEntry.verified`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterable, Mapping, cast, overload

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.naming.canonical import CanonicalName, canonicalize, qkv_views
from tmetrics_core.naming.layouts.torchtitan import fused_qkv_geometry
from tmetrics_core.naming.dtensor import dtensor_placements
from tmetrics_core.naming.hand_split import global_shape, shard_tag
from tmetrics_core.naming.holdings import Holdings, Row
from tmetrics_core.naming.nearest import nearest
from tmetrics_core.naming.slices import SliceView, place_slice
from tmetrics_core.placements import Owned, Placement, Replica, parse_placement
from tmetrics_core.site import FROZEN, Site

__all__ = ["ORIGINS", "Manifest", "TensorEntry", "dtensor_placements"]

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
            covered = _covered_axes(cn.original, p, topology)
            if cn.region:
                placements, view = _slice_of(cn, p, topology)
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
        entries = _merge(everything, topology, overrides or {})
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
        placements, view = _slice_of(cn, tensor, topology)
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


def _slice_of(cn: CanonicalName, p: torch.Tensor, topology: Topology
              ) -> tuple[tuple[tuple[str, Placement], ...], SliceView | None]:
    """Placements of the expert slice ``cn`` of stored parameter ``p`` and its view here (None
    when another rank holds it); see `tmetrics_core.naming.slices.place_slice`."""
    from torch.distributed.tensor import DTensor

    mesh_axes: tuple[tuple[str, Any], ...] = ()
    if isinstance(p, DTensor):
        mesh_axes = tuple(zip(p.device_mesh.mesh_dim_names or (), p.placements))
    squeeze = cn.expert_dim if cn.expert is not None else None
    sizes = {a: topology.axes[a].size for a in topology.names}
    return place_slice(cn.name, cn.original, cn.region, squeeze, cn.transposed, tuple(p.shape), mesh_axes,
                       topology.coords(), sizes, cn.groups)


def _merge(everything: Holdings, topology: Topology,
           overrides: Mapping[str, Mapping[str, str]]) -> list[TensorEntry]:
    entries = []
    by_name = cast(dict[str, dict[Row, int]], everything.rows)  # keyed by canonical name in build
    for pattern in overrides:
        if not any(fnmatchcase(name, pattern) for name in by_name):
            raise ConfigError(f"{pattern!r} matches no tensor of the model on any rank; placements: globs take "
                              f"canonical names (see `tmetrics names`); nearest: {nearest([pattern], by_name)!r}",
                              path=f"placements.{pattern}")
    for name in sorted(by_name):
        variants = sorted(by_name[name].items(), key=lambda item: item[1])
        row = variants[0][0]
        from_dtensor = {a: parse_placement(p) for a, p in row[8]}
        from_framework = {a: parse_placement(p) for a, p in row[9]}
        override = _override(name, tuple(row[6]), overrides, topology)
        covered = set(row[10]) - set(override) - set(from_framework)
        if not from_dtensor and not override and not from_framework:
            _same_everywhere(name, variants, topology)
        held = everything.held[name]
        placements = []
        origins = []
        for axis in topology.names:
            size = topology.axes[axis].size
            for origin, known in (("declared", override), ("framework", from_framework), ("dtensor", from_dtensor)):
                if axis in known:
                    placements.append((axis, known[axis]))
                    origins.append((axis, origin))
                    break
            else:
                if axis in covered:
                    origins.append((axis, "covered"))
                elif size > 1:
                    placements.append((axis, _infer(name, axis, size, held.get(axis, {0}))))
                    origins.append((axis, "inferred"))
        holders = tuple((a, tuple(sorted(held[a]))) for a in topology.names
                        if a in held and len(held[a]) < topology.axes[a].size)
        shape = tuple(row[6]) if not row[11] else global_shape(
            name, {r[11]: tuple(r[6]) for r, _ in variants}, placements, dict(origins), topology)
        entries.append(TensorEntry(
            name=name, original=row[1], layer=row[2], expert=row[3], component=row[4], family=row[5],
            shape=shape, dtype=row[7], placements=tuple(p for p in placements if not p[1].is_replica()),
            holders=holders, origins=tuple(origins), frozen=all(r[12] for r, _ in variants),
        ))
    return entries


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


def _covered_axes(name: str, p: torch.Tensor, topology: Topology) -> tuple[str, ...]:
    """Axes of size > 1 outside the mesh of DTensor ``p`` whose ranks all lie in that mesh
    (empty for a plain tensor).

    Raises:
        PlacementError: an axis whose ranks lie partly in the mesh: the tensor's layout on it
            is neither the DTensor's nor independent of it.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ()
    dims = set(p.device_mesh.mesh_dim_names or ())
    mesh_ranks = set(p.device_mesh.mesh.flatten().tolist())
    out = []
    for axis in topology.names:
        ranks = set(topology.axes[axis].ranks)
        if axis in dims or len(ranks) < 2:
            continue
        inside = ranks & mesh_ranks
        if inside == ranks:
            out.append(axis)
        elif inside != {topology.global_rank}:
            raise PlacementError(
                f"parameter {name!r} is a DTensor on mesh {tuple(p.device_mesh.mesh_dim_names or ())} over ranks "
                f"{sorted(mesh_ranks)}; axis {axis!r} (ranks {sorted(ranks)}) lies partly inside that mesh, so "
                "the tensor's placement on it is neither the DTensor's nor independent of it. Build the axes "
                "from meshes that nest (torchtitan's ParallelDims does)")
    return tuple(out)


def _same_everywhere(name: str, variants: list[tuple[Row, int]], topology: Topology) -> None:
    """A plain tensor without declared placements is a replica or owned: the same shape and
    dtype wherever it is held. Different ones mean a tensor split by hand (tensor parallel
    without DTensor), which inferring Replica would measure from one shard per rank.

    Raises:
        ConfigError: naming the tensor, two ranks that disagree and the placements to declare.
    """
    first, first_rank = variants[0]
    for row, rank in variants[1:]:
        if row[6] == first[6] and row[7] != first[7]:
            raise ConfigError(
                f"tensor {name!r} is {first[7]} on rank {first_rank} but {row[7]} on rank {rank} (same shape "
                f"{list(row[6])}): every rank must hold the model in the same dtype. Cast the model on every "
                "rank (or on none) before creating TensorMetrics",
            )
        if row[6] != first[6]:
            split = [a for a in topology.names if topology.axes[a].size > 1] or ["tp"]
            raise ConfigError(
                f"tensor {name!r} is {first[7]} {list(first[6])} on rank {first_rank} but {row[7]} "
                f"{list(row[6])} on rank {rank}: a plain tensor (not a DTensor) split by hand across ranks. "
                "tmetrics cannot tell how it is split; declare its placement in the config, e.g. "
                f"placements: {{'{name}': {{'{split[-1]}': 'S0'}}}} (Shard along dim 0 of the full tensor)",
                path="placements",
            )


def _infer(name: str, axis: str, size: int, coords: set[int]) -> Placement:
    seen = sorted(coords)
    if len(seen) == size:
        return Replica()
    if len(seen) == 1:
        return Owned(seen[0])
    raise ConfigError(
        f"tensor {name!r} is held on coordinates {seen} of axis {axis!r} (size {size}): neither all of "
        "them (Replica) nor one (Owned). Declare its placement in the config, e.g. placements: "
        f"{{'{name}': {{'{axis}': 'S0'}}}}",
        path="placements",
    )


def _override(name: str, shape: tuple[int, ...], overrides: Mapping[str, Mapping[str, str]],
              topology: Topology) -> dict[str, Placement]:
    """The config's placements for tensor ``name``, each checked against its shape and axis."""
    out: dict[str, Placement] = {}
    for pattern, spec in overrides.items():
        if not fnmatchcase(name, pattern):
            continue
        for axis, text in spec.items():
            if axis not in topology.axes:
                raise ConfigError(f"axis {axis!r} is not in the topology {list(topology.names)}",
                                  path=f"placements.{pattern}")
            try:
                placement = parse_placement(text)
            except PlacementError as exc:
                raise ConfigError(str(exc), path=f"placements.{pattern}.{axis}") from exc
            where = f"placements.{pattern}.{axis}"
            size = topology.axes[axis].size
            dim = placement.shard_dim()
            if dim is not None and dim >= len(shape):
                raise ConfigError(f"{placement} on tensor {name!r} of shape {shape}: a {len(shape)}-dim tensor "
                                  f"has dims 0..{len(shape) - 1}; fix the dim or the glob", path=where)
            if placement.is_owned() and getattr(placement, "rank") >= size:
                raise ConfigError(f"{placement} on tensor {name!r}: axis {axis!r} has {size} rank(s), "
                                  f"0..{size - 1}; fix the rank or the glob", path=where)
            out[axis] = placement
    return out
