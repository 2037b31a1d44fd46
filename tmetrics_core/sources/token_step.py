"""The step's token sites: what the token and attention observers share.

:class:`TokenStep` holds one due step's view of the token sites (each observation's
:class:`~tmetrics_core.site.Site`, built once per run and kept in :class:`TokenSites` across
steps), the due metrics that read each site, and the states those metrics prepared. The
activation, logits, router and cotangent observations (:mod:`tmetrics_core.sources.tokens`) and
the attention observations (:mod:`tmetrics_core.sources.attention`) are both read into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core import torch_private

from tmetrics_core.kinds import EXPERT_COLUMN_KINDS, KEPT_KINDS, MODULE_GLOB_KINDS
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.placements import Placement, Shard
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.topology import Topology

__all__ = ["TokenSites", "TokenStep", "local_tokens", "prepared_jointly"]


@dataclass
class TokenSites:
    """What token observation learns once per run, kept across steps by ``TensorMetrics``:
    the site of each observation (keyed by everything the site is built from, so a change of
    width, dtype or split makes a new one) and the ``(metric name, site)`` pairs already
    checked. A due step then neither rebuilds sites nor re-checks placements."""

    sites: dict[tuple, Site] = field(default_factory=dict)
    checked: set[tuple[str, Site]] = field(default_factory=set)
    readers: dict[tuple, list[tuple[TensorMetric, bool]]] = field(default_factory=dict)
    """``(site, module path, due metric names)`` -> the due metrics that read the observation,
    each with whether it is prepared at the step's end (:func:`prepared_jointly`)."""
    configured: frozenset[str] = frozenset()
    """The kinds some configured metric reads (due or not); with :data:`OBSERVED_KINDS`, the
    kinds an observation may have without a word."""
    unread: set[str] = field(default_factory=set)
    """Kinds observed that no metric reads, said once each."""


class TokenStep:
    """One due step's token sites and the states their metrics prepared.

    Attributes after the step: ``sites`` (key -> Site seen on this rank), ``states`` (metric
    name -> prepared state), ``errors`` (metric name -> first error text).
    """

    def __init__(self, metrics: Sequence[TensorMetric], topology: Topology, index: ModuleIndex,
                 *, num_experts: int | None = None, modules: Mapping[str, Sequence[str]] | None = None,
                 known: TokenSites | None = None, owner: int | None = None) -> None:
        self.metrics = list(metrics)
        self.owner = owner
        """Owner number of the ``TensorMetrics`` whose hooks feed this observer (``tmetrics_core.observe.record``)."""
        self.known = known if known is not None else TokenSites()
        self._names = tuple(m.name for m in self.metrics)
        self.modules = dict(modules or {})
        self.topology = topology
        self.index = index
        self.num_experts = num_experts
        self.kinds = frozenset(k for m in self.metrics for k in m.source_kinds) | {"token_mask"}
        self.kept = KEPT_KINDS
        self.sites: dict[SiteKey, Site] = {}
        self.states: dict[str, dict[SiteKey, Any]] = {}
        self.errors: dict[str, str] = {}
        self._fresh: set[SiteKey] = set()
        """Keys of the sites first made in this step (no earlier step saw them)."""

    def readers(self, site: Site, path: str) -> list[tuple[TensorMetric, bool]]:
        """The due metrics that read ``site`` observed at module ``path`` (``modules:`` patterns
        narrow activations), each with whether it is prepared at the step's end (the kinds
        kept to the step's end, :data:`~tmetrics_core.kinds.KEPT_KINDS`, and :func:`prepared_jointly` metrics),
        found once per run and due set."""
        key = (site, path, self._names)
        readers = self.known.readers.get(key)
        if readers is None:
            readers = []
            for metric in self.metrics:
                patterns = self.modules.get(metric.name)
                if not metric.accepts(site) or (site.kind in MODULE_GLOB_KINDS and patterns
                                                and not self.index.matches(path, patterns)):
                    continue
                readers.append((metric, site.kind in self.kept or prepared_jointly(metric)))
            self.known.readers[key] = readers
        return readers

    def check(self, metric: TensorMetric, site: Site) -> None:
        """``metric.check`` once per run and site: token sites exist only once observed, so
        their placements are checked then (raises what the metric's check raises)."""
        if (metric.name, site) not in self.known.checked:
            metric.check(site, self.topology)
            self.known.checked.add((metric.name, site))

    def prepare(self, metric: TensorMetric, site: Site, x: Any, memo: dict) -> None:
        """Prepare ``metric``'s state of ``x`` observed at ``site`` now (checked first, merged
        into the step's earlier state of the metric); an exception is recorded in
        :attr:`errors`, never raised into the model (the executor skips the metric on every rank)."""
        try:
            self.check(metric, site)
            state = metric.prepare([site], [x], self.topology, memo)
            previous = self.states.get(metric.name)
            self.states[metric.name] = state if previous is None else metric.merge(previous, state)
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            self.errors[metric.name] = f"{type(exc).__name__}: {exc}"

    def _site(self, name: str, kind: str, x: torch.Tensor, shard_dim: int | None, path: str,
              split_axes: frozenset[str] = frozenset()) -> Site:
        key = (name, kind)
        site = self.sites.get(key)
        if site is not None:
            return site
        known = (name, kind, int(x.shape[1]), x.dtype, shard_dim, path, split_axes)
        site = self.known.sites.get(known)
        if site is None:
            site = self.known.sites[known] = self._new_site(name, kind, x, shard_dim, path, split_axes)
            self._fresh.add(site.key)
        self.sites[key] = site
        return site

    def _new_site(self, name: str, kind: str, x: torch.Tensor, shard_dim: int | None, path: str,
                  split_axes: frozenset[str]) -> Site:
        placements: list[tuple[str, Placement]] = []
        for axis in self.topology.names:
            if self.topology.axes[axis].size == 1:
                continue
            if axis in self.topology.population_axes or axis in split_axes:
                placements.append((axis, Shard(None)))
            elif axis == "tp" and shard_dim is not None:
                placements.append((axis, Shard(1)))
        width = int(x.shape[1])
        tp = self.topology.axes.get("tp")
        if shard_dim is not None and tp is not None and tp.size > 1:
            width *= tp.size  # features (vocabulary, experts) split evenly over tp: the row is wider
        experts = self.num_experts
        if kind in EXPERT_COLUMN_KINDS:
            experts = width
        site = Site(name=name, kind=kind, logical_shape=(-1, width), dtype=str(x.dtype).replace("torch.", ""),
                    placements=tuple(placements), layer=self.index.layer_of(path),
                    family=self.index.family_of(path) + (f".{name.rpartition('.')[2]}"
                                                          if name != self.index.name_of(path) else ""),
                    num_experts=experts, meta=(("module", path),))
        return site


_NO_AXES: frozenset[str] = frozenset()


def prepared_jointly(metric: TensorMetric) -> bool:
    """Whether ``metric`` reads top-k choices together with router logits or scores."""
    kinds = set(metric.source_kinds)
    return "router_topk" in kinds and bool(kinds & {"router_logits", "router_scores"})


def local_tokens(tensor: torch.Tensor, shard_dim: int | None
                  ) -> tuple[torch.Tensor, int | None, frozenset[str]]:
    """The local tensor of an observation, the dim it is split along on ``tp``, and the mesh
    axes over which it holds different tokens.

    A DTensor activation is made local here: ``Partial`` placements are reduced first (one
    collective, issued by every rank of the mesh since the forward is the same on each), a
    ``Shard`` of the last (feature) dim becomes ``shard_dim``, and a ``Shard`` of a leading
    dim (sequence parallel) makes that axis a population split, like the data axes.
    """
    if type(tensor) is torch.Tensor:  # the common case, before the import below
        return tensor, shard_dim, _NO_AXES
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor, shard_dim, _NO_AXES
    if any(p.is_partial() for p in tensor.placements):
        tensor = tensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in tensor.placements])
    names = tensor.device_mesh.mesh_dim_names or ()
    split: set[str] = set()
    for axis, p in zip(names, tensor.placements):
        sharded = p.is_shard() or type(p) is torch_private.strided_shard()  # not a Shard in torch 2.13
        if sharded and getattr(p, "dim", None) in (-1, tensor.dim() - 1):
            shard_dim = tensor.dim() - 1
        elif sharded:
            split.add(axis)
    return tensor.to_local(), shard_dim, frozenset(split)
