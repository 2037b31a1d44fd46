"""Token sources: the step's observer for activations, logits and router outputs.

Every observation is flattened to ``[tokens, features]`` and stripped of padding tokens (the
last ``token_mask`` observed in the step, when its length matches). Activations, residuals and
logits are prepared at once by every due metric that accepts the site, and released: only the
small prepared states outlive the call. Router
outputs (``[tokens, experts]`` logits, scores and top-k choices, a small fraction of a layer's
activations) are kept, not copied, until the step's end and prepared there for every layer at
once: one batch instead of a few small calls in each layer's forward. A model must not change
them in place after observing them: one that does (the tensor's version counter moved by the
step's end) gets the metrics reading that site reported as failed, never values of the changed
tensor.
Recomputation under activation checkpointing runs inside backward and is skipped, so each
forward is observed exactly once. Cotangents (``*_grad`` kinds) take the same path from the
tensor hooks :meth:`TokenObserver.tap` registers in the forward (their scale:
:mod:`tmetrics_core.sources.cotangents`; ``docs/backward.md``). A metric that raises here is
recorded, never raised into the model; the executor then skips it on every rank.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.executor import DeviceCheck
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.placements import Placement, Shard
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.cotangents import GRAD_KINDS, CotangentScale
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.sources.attention import observe_attention
from tmetrics_core import torch_private

__all__ = ["OBSERVED_KINDS", "RESIDUAL_KINDS", "SEQUENCE_CHECKED", "TOKEN_KINDS", "Route", "TokenObserver",
           "TokenSites"]

TOKEN_KINDS = frozenset({
    "residual_accumulator", "residual_contribution", "logits", "activation",
    "router_logits", "router_topk", "router_scores",
    "attn_qk",  # an attention layer's queries and keys (sources/attention.py)
}) | GRAD_KINDS
"""Site kinds whose rows are tokens."""

OBSERVED_KINDS = TOKEN_KINDS | {"token_mask", "expert_bias"}
"""Every kind the catalogue's metrics read from observations (``tm.observe``, hooks)."""

log = logging.getLogger("tmetrics")

RESIDUAL_KINDS = frozenset({"residual_accumulator", "residual_contribution", "residual_grad", "residual_input_grad"})
"""The residual stream's kinds: a block's output, its output less its input, and the
cotangents of its output and input."""

SEQUENCE_CHECKED = RESIDUAL_KINDS | {"activation_grad"}
"""Kinds whose plain tensors may hold each tensor-parallel rank's part of the sequence
(sequence parallelism) with nothing to say so: checked when first seen
(:mod:`tmetrics_core.sources.sequence_split`)."""


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
    each with whether it is prepared at the step's end (:func:`_joint`)."""
    routes: dict[tuple, Route] = field(default_factory=dict)
    """``(module, name, kind, shard_dim, dtype, width, with minus, due metric names)`` -> the
    :class:`Route` of a plain-tensor observation: later calls skip the site and reader lookups."""
    configured: frozenset[str] = frozenset()
    """The kinds some configured metric reads (due or not); with :data:`OBSERVED_KINDS`, the
    kinds an observation may have without a word."""
    unread: set[str] = field(default_factory=set)
    """Kinds observed that no metric reads, said once each."""


@dataclass(frozen=True)
class Route:
    """Where the observations of one hook call go, found on its first call per run and due set:
    the ``site`` and its ``readers`` (as :meth:`TokenObserver._readers`)."""

    site: Site
    readers: tuple[tuple[TensorMetric, bool], ...]


@dataclass(slots=True)
class Padding:
    """The non-padding rows of the step's last ``token_mask``, found once per micro-batch.

    Attributes:
        rows: int64 ``[kept]``, the kept rows' indices in the flattened ``[tokens]`` order, on
            the mask's device (finding them is one host sync where the mask is on an
            accelerator, none where it is on the host).
        length: the mask's length; only token observations of this many rows are stripped.
    """

    rows: torch.Tensor
    length: int
    _moved: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def on(self, device: torch.device) -> torch.Tensor:
        """:attr:`rows` on ``device``, copied there once per micro-batch (without waiting: a
        host mask then costs no host sync at all)."""
        if self.rows.device == device:
            return self.rows
        moved = self._moved.get(device)
        if moved is None:
            moved = self._moved[device] = self.rows.to(device, non_blocking=self.rows.is_cpu)
        return moved


class TokenObserver:
    """Receives ``observe()`` calls and hook outputs for one step (see ``tmetrics_core.observe``).

    Attributes after the step: ``sites`` (key -> Site seen on this rank), ``states`` (metric
    name -> prepared state), ``errors`` (metric name -> first error text).
    """

    def __init__(self, metrics: Sequence[TensorMetric], topology: Topology, index: ModuleIndex,
                 *, num_experts: int | None = None, modules: Mapping[str, Sequence[str]] | None = None,
                 known: TokenSites | None = None, owner: int | None = None,
                 cotangent_scale: CotangentScale | None = None) -> None:
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
        self._checks: list[tuple[torch.Tensor, str, frozenset[str] | None]] = []
        self._padding: Padding | None = None
        self._deferred: dict[str, list[tuple[Site, torch.Tensor]]] = {}
        self._memos: list[dict] = []
        self._fresh: set[SiteKey] = set()
        """Keys of the sites first made in this step (no earlier step saw them)."""
        self._firsts: dict[SiteKey, torch.Tensor] = {}
        """Sum of squares of a fresh residual site's first observation (:meth:`first_sumsq`;
        the first observation of a site always takes the general path, :meth:`_record`)."""
        self._views: list[tuple[Site, torch.Tensor, int]] = []
        self.cotangent_scale = cotangent_scale or CotangentScale(1, None)
        """What each cotangent is multiplied by (data-parallel averaging, loss scale)."""

    def tap(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
            shard_dim: int | None) -> None:
        """Register a hook on ``tensor`` (in the forward of a due step) that observes its
        cotangent as :meth:`cotangent` does, with the token mask of this micro-batch (a
        pipeline schedule may run other micro-batches' forwards before this backward)."""
        tensor.register_hook(functools.partial(self._hooked, module, name, kind, shard_dim, self._padding))

    def _hooked(self, module: torch.nn.Module, name: str, kind: str, shard_dim: int | None,
                padding: Padding | None, grad: torch.Tensor) -> None:
        kept = self._padding
        self._padding = padding
        try:
            self.cotangent(module, name, grad, kind=kind, shard_dim=shard_dim)
        finally:
            self._padding = kept

    def cotangent(self, module: torch.nn.Module, name: str, grad: torch.Tensor, *, kind: str,
                  shard_dim: int | None) -> None:
        """Observe ``grad``, a cotangent of the local loss, as that of the loss the optimizer
        applies (times :attr:`cotangent_scale`), with the step's other token observations."""
        self._observe(module, name, grad, kind, shard_dim, None, self.cotangent_scale.factor(grad))

    def fail(self, reason: str, kinds: frozenset[str] | None = None) -> None:
        """Fail this step's metrics that read any of ``kinds`` (router outputs by default) with
        ``reason`` (an automatically found router whose output is not what it was recognised
        as); the first reason is kept."""
        for metric in self.metrics:
            if set(metric.source_kinds) & (ROUTER_KINDS if kinds is None else kinds):
                self.errors.setdefault(metric.name, reason)

    def fail_unless(self, ok: torch.Tensor, reason: str, kinds: frozenset[str] | None = None) -> None:
        """:meth:`fail` unless the 0-d bool tensor ``ok`` is true: kept on the device and handed
        to the executor (:meth:`device_checks`), which reads it with the step's other host
        reads (no synchronisation per call, none of its own)."""
        self._checks.append((ok.reshape(()), reason, kinds))

    def device_checks(self) -> list[DeviceCheck]:
        """The step's :meth:`fail_unless` checks, each with the due metrics it fails (those
        that read any of its kinds); the executor decides them (see ``Executor.run``)."""
        out = []
        for ok, reason, kinds in self._checks:
            names = frozenset(m.name for m in self.metrics
                              if set(m.source_kinds) & (ROUTER_KINDS if kinds is None else kinds))
            if names:
                out.append(DeviceCheck(ok, reason, names))
        return out

    def record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
               shard_dim: int | None, minus: torch.Tensor | None = None) -> None:
        """Observe ``tensor`` (``tensor - minus`` when ``minus`` is given: same shape, local)."""
        self._observe(module, name, tensor, kind, shard_dim, minus)

    def record_attention(self, module: torch.nn.Module, name: str, q: torch.Tensor, k: torch.Tensor, *,
                         spec: AttentionSpec | None, shard_dim: int | None) -> None:
        """Observe an attention layer's queries and keys (:mod:`tmetrics_core.sources.attention`)."""
        observe_attention(self, module, name, q, k, spec, shard_dim)

    def _observe(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, kind: str, shard_dim: int | None,
                 minus: torch.Tensor | None, factor: float | torch.Tensor | None = None) -> None:
        """:meth:`record` (also the fallback of :meth:`record_residual`, which does not call the
        public entry, so timing either entry never counts the other); ``factor`` multiplies
        the observation (a cotangent's scale)."""
        if kind not in GRAD_KINDS and torch_private.in_backward():
            return  # recomputation inside backward (activation checkpointing)
        if factor is not None and type(tensor) is torch.Tensor:
            tensor, factor = tensor * factor, None
        # Plain tensors of a call seen before, no padding to strip: the route found then.
        if (type(tensor) is torch.Tensor and (minus is None or type(minus) is torch.Tensor) and tensor.dim() > 1
                and (self._padding is None or kind not in TOKEN_KINDS)):
            key = (module, name, kind, shard_dim, tensor.dtype, tensor.shape[-1], minus is None, self._names)
            route = self.known.routes.get(key)
            if route is not None and self._follow(route, tensor, minus):
                return
        self._record(module, name, tensor, kind=kind, shard_dim=shard_dim, minus=minus, factor=factor)

    def record_residual(self, module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *,
                        accumulator: bool) -> None:
        """Observe a block's output ``h`` as the residual accumulator (when ``accumulator``) and
        ``h - x`` as its contribution (when ``x``, the block's input of the same shape, is given),
        as the two :meth:`record` calls would."""
        if accumulator:
            self._observe(module, "", h, "residual_accumulator", None, None)
        if x is not None:
            self._observe(module, "", h, "residual_contribution", None, x)

    def _follow(self, route: Route, tensor: torch.Tensor, minus: torch.Tensor | None) -> bool:
        """Observe along ``route``: keep a router output; False (nothing done) where the general
        path must run (every other kind)."""
        site = route.site
        if site.kind not in ROUTER_KINDS or minus is not None:
            return False
        self.sites[site.key] = site
        # Detached only when part of a graph (kept past backward, it would hold the graph's
        # saved tensors); viewed as rows only when not 2-D already: no op otherwise.
        x = tensor.detach() if tensor.requires_grad else tensor
        if x.dim() != 2:
            x = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # an empty shard too (width 0)
        if route.readers and not x.is_inference():
            self._views.append((site, x, x._version))
        for metric, _ in route.readers:  # all prepared at the step's end (router sites)
            if metric.name not in self.errors:
                self._deferred.setdefault(metric.name, []).append((site, x))
        return True

    @torch.no_grad()  # metric arithmetic builds no graph (and skips autograd's dispatch work)
    def _record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
                shard_dim: int | None, minus: torch.Tensor | None, factor: float | torch.Tensor | None = None) -> None:
        """The general path of :meth:`record`: every tensor, padding, DTensors; finds the route."""
        if kind == "token_mask":
            # The kept rows' indices, found once per micro-batch (not a boolean index per
            # observation: on an accelerator each one is a host sync); no padding: no index.
            mask = tensor.detach().reshape(-1).bool()
            kept = mask.nonzero().squeeze(1)
            self._padding = None if kept.numel() == mask.numel() else Padding(kept, mask.numel())
            return
        x, shard_dim, split_axes = _local_tokens(tensor.detach(), shard_dim)
        if factor is not None:  # a DTensor cotangent's scale, applied to its reduced local part
            x = x * factor
        x = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() > 1 else x.reshape(-1, 1)
        y = _local_tokens(minus.detach(), None)[0].reshape(x.shape) if minus is not None else None
        # Only token rows are padded: an expert_bias [E] as long as the micro-batch is not.
        masked = kind in TOKEN_KINDS and self._padding is not None and self._padding.length == x.shape[0]
        path = self.index.path(module)
        full = ".".join(p for p in (self.index.name_of(path), name) if p)  # canonical where it has one
        site = self._site(full, kind, x, shard_dim, path, split_axes)
        readers = self._readers(site, path)
        # A route is kept for the site built from this call's own width and dtype (a second
        # width of the same hook within one step gets the step's first site, not a route).
        if (type(tensor) is torch.Tensor and (minus is None or type(minus) is torch.Tensor) and tensor.dim() > 1
                and not masked and self.known.sites.get((full, kind, int(x.shape[1]), x.dtype, shard_dim, path,
                                                         split_axes)) is site):
            key = (module, name, kind, shard_dim, tensor.dtype, tensor.shape[-1], minus is None, self._names)
            self.known.routes[key] = Route(site, tuple(readers))
        if site.key in self._fresh and site.key not in self._firsts and kind in SEQUENCE_CHECKED:
            self._firsts[site.key] = torch.linalg.vector_norm(x if y is None else x - y, dtype=torch.float64).square()
        if y is not None:  # low precision widened first: the difference itself, not its rounding
            x = (x.float() if x.dtype in _LOW else x) - y
        if masked:
            assert self._padding is not None, "masked is only set with a mask"
            x = x.index_select(0, self._padding.on(x.device))
        if not masked and readers and site.kind in ROUTER_KINDS and not x.is_inference():
            # Kept, not copied, until finish(): its version tells there whether the model
            # changed it in place meanwhile (inference tensors have no version counter). An
            # expert_bias is left out: models update it in place within the step, by design.
            self._views.append((site, x, x._version))
        memo: dict = {}  # metrics of this observation share statistics (expert counts, sums of squares)
        for metric, joint in readers:
            if metric.name in self.errors:
                continue
            if joint:
                self._deferred.setdefault(metric.name, []).append((site, x))
                continue
            try:
                self._check(metric, site)
                state = metric.prepare([site], [x], self.topology, memo)
                previous = self.states.get(metric.name)
                self.states[metric.name] = state if previous is None else metric.merge(previous, state)
            except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
                self.errors[metric.name] = f"{type(exc).__name__}: {exc}"

    def first_sumsq(self, key: SiteKey) -> torch.Tensor | None:
        """The sum of squares of residual site ``key``'s first observation this step, where the
        site is new in this run (a 0-d float64 tensor on its device); else None."""
        return self._firsts.get(key)

    def unwatched(self, kind: str, module: torch.nn.Module) -> None:
        """An observation of ``kind`` that no due metric reads: dropped; the first of a kind that
        neither the catalogue nor a configured metric reads (a misspelled ``kind``) is said
        once, with the kinds observations feed."""
        known = self.known
        if kind not in known.configured and kind not in OBSERVED_KINDS and kind not in known.unread:
            known.unread.add(kind)
            if self.topology.global_rank == 0:
                log.warning("tmetrics: tm.observe(..., kind=%r) at %s: no metric reads this kind, so it is "
                            "dropped; observations feed %s. Check the kind's spelling", kind,
                            self.index.path(module), sorted(known.configured | OBSERVED_KINDS))

    @torch.no_grad()
    def finish(self) -> None:
        """Prepare the kept router observations (and every observation of a metric that needs
        a layer's top-k choices together with its logits or scores, the router diagnostic
        families): the k-th observation of every site forms micro-batch k, prepared in one
        call per metric; metrics share statistics (expert counts, moments rows) within a
        micro-batch. Metrics that read a kept observation changed in place since are failed.
        Device checks (:meth:`fail_unless`) are not read here: metrics they may fail are
        prepared, and the executor drops them if a check failed."""
        memos = self._memos
        # A family's layer summary depends on which of the layer's sites it reads (scores or
        # logits, the bias or not): families share it only when they read the same sites.
        joint_memos: dict[tuple, dict] = {}
        changed = {site.key: (version, x._version) for site, x, version in self._views if x._version != version}
        self._views = []
        for metric in self.metrics:
            observed = self._deferred.pop(metric.name, [])
            if not observed or metric.name in self.errors:
                continue
            moved = next((s for s, _ in observed if s.key in changed), None)
            if moved is not None:
                before, after = changed[moved.key]
                self.errors[metric.name] = (
                    f"{moved.name} ({moved.kind}) was changed in place after it was observed (tensor version "
                    f"{before} -> {after}); router observations are kept, not copied, until the step's end. "
                    "Observe a copy (tensor.clone()) or observe after the last in-place change")
                continue
            batches: list[list[tuple[Site, torch.Tensor]]] = []
            count: dict[SiteKey, int] = {}
            for site, x in observed:
                k = count.get(site.key, 0)
                count[site.key] = k + 1
                if k == len(batches):
                    batches.append([])
                batches[k].append((site, x))
            try:
                for k, batch in enumerate(batches):
                    for site, _ in batch:
                        self._check(metric, site)
                    if _joint(metric):
                        memo = joint_memos.setdefault((k, tuple(s.key for s, _ in batch)), {})
                    else:
                        while len(memos) <= k:
                            memos.append({})
                        memo = memos[k]
                    state = metric.prepare([s for s, _ in batch], [x for _, x in batch], self.topology, memo)
                    previous = self.states.get(metric.name)
                    self.states[metric.name] = state if previous is None else metric.merge(previous, state)
            except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
                self.errors[metric.name] = f"{type(exc).__name__}: {exc}"

    def _readers(self, site: Site, path: str) -> list[tuple[TensorMetric, bool]]:
        """The due metrics that read ``site`` observed at module ``path`` (``modules:`` patterns
        narrow activations), each with whether it is prepared at the step's end (router
        sites, :data:`ROUTER_KINDS`, and :func:`_joint` metrics), found once per run and due set."""
        key = (site, path, self._names)
        readers = self.known.readers.get(key)
        if readers is None:
            readers = []
            for metric in self.metrics:
                patterns = self.modules.get(metric.name)
                if not metric.accepts(site) or (site.kind in _MODULE_KINDS and patterns
                                                and not self.index.matches(path, patterns)):
                    continue
                readers.append((metric, site.kind in ROUTER_KINDS or _joint(metric)))
            self.known.readers[key] = readers
        return readers

    def _check(self, metric: TensorMetric, site: Site) -> None:
        """``metric.check`` once per run and site: token sites exist only once observed, so
        their placements are checked then (raises what the metric's check raises)."""
        if (metric.name, site) not in self.known.checked:
            metric.check(site, self.topology)
            self.known.checked.add((metric.name, site))

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
        if kind in ("router_logits", "router_scores"):
            experts = width
        site = Site(name=name, kind=kind, logical_shape=(-1, width), dtype=str(x.dtype).replace("torch.", ""),
                    placements=tuple(placements), layer=self.index.layer_of(path),
                    family=self.index.family_of(path) + (f".{name.rpartition('.')[2]}"
                                                          if name != self.index.name_of(path) else ""),
                    num_experts=experts, meta=(("module", path),))
        return site


_NO_AXES: frozenset[str] = frozenset()
_LOW = frozenset({torch.bfloat16, torch.float16})
_MODULE_KINDS = frozenset({"activation", "activation_grad"})
"""Kinds observed at modules that ``modules:`` globs pick."""
ROUTER_KINDS = frozenset({"router_logits", "router_topk", "router_scores"})
"""Token kinds kept until the step's end (``[tokens, experts]``: small next to activations)."""

KEPT_KINDS = ROUTER_KINDS
"""Kinds whose observed tensor (or a view of it) outlives the call: router outputs (the token
mask's kept-row indices are a new tensor, made in the call)."""


def _joint(metric: TensorMetric) -> bool:
    """Whether ``metric`` reads top-k choices together with router logits or scores."""
    kinds = set(metric.source_kinds)
    return "router_topk" in kinds and bool(kinds & {"router_logits", "router_scores"})


def _local_tokens(tensor: torch.Tensor, shard_dim: int | None
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
        sharded = p.is_shard() or type(p).__name__ == "_StridedShard"  # not a Shard in torch 2.13
        if sharded and getattr(p, "dim", None) in (-1, tensor.dim() - 1):
            shard_dim = tensor.dim() - 1
        elif sharded:
            split.add(axis)
    return tensor.to_local(), shard_dim, frozenset(split)
