"""Token sources: the step's observer for activations, logits and router outputs.

Every observation is flattened to ``[tokens, features]`` and stripped of padding tokens (the
last ``token_mask`` observed in the step, when its length matches). Activations, residuals and
logits are prepared at once by every due metric that accepts the site, and released: only the
small prepared states outlive the call, on every device alike. The kinds whose records say
``kept`` (:data:`tmetrics_core.kinds.KEPT_KINDS`: router outputs, ``[tokens, experts]`` logits,
scores and top-k choices, a small fraction of a layer's activations) are kept, not copied, until
the step's end and prepared there for every layer at once: one batch instead of a few small
calls in each layer's forward. A model must not change
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
from typing import Mapping, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.agreement import DeviceCheck
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.reporter import Reporter
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.kinds import GRAD_KINDS, OBSERVED_KINDS, ROUTER_OUTPUT_KINDS, SEQUENCE_CHECKED, TOKEN_KINDS
from tmetrics_core.sources.cotangents import CotangentScale
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.token_step import TokenSites, TokenStep, local_tokens, prepared_jointly
from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.sources.attention import observe_attention
from tmetrics_core import torch_private

__all__ = ["TokenObserver"]

log = logging.getLogger("tmetrics")


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


class TokenObserver(TokenStep):
    """Receives ``observe()`` calls and hook outputs for one step (see ``tmetrics_core.observe``);
    the sites, states and errors are those of :class:`~tmetrics_core.sources.token_step.TokenStep`."""

    def __init__(self, metrics: Sequence[TensorMetric], topology: Topology, index: ModuleIndex,
                 *, num_experts: int | None = None, modules: Mapping[str, Sequence[str]] | None = None,
                 known: TokenSites | None = None, owner: int | None = None,
                 cotangent_scale: CotangentScale | None = None, reporter: Reporter) -> None:
        super().__init__(metrics, topology, index, num_experts=num_experts, modules=modules, known=known,
                         owner=owner)
        self.reporter = reporter
        self._checks: list[tuple[torch.Tensor, str, frozenset[str] | None]] = []
        self._padding: Padding | None = None
        self._deferred: dict[str, list[tuple[Site, torch.Tensor]]] = {}
        self._memos: list[dict] = []
        self._firsts: dict[SiteKey, torch.Tensor] = {}
        """Sum of squares of a fresh residual site's first observation (:meth:`first_sumsq`)."""
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
            if set(metric.source_kinds) & (ROUTER_OUTPUT_KINDS if kinds is None else kinds):
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
                              if set(m.source_kinds) & (ROUTER_OUTPUT_KINDS if kinds is None else kinds))
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
        """The body of :meth:`record`, :meth:`record_residual` and :meth:`cotangent` (none calls
        another's public entry, so timing one never counts the other); ``factor`` multiplies
        the observation (a cotangent's scale)."""
        if kind not in GRAD_KINDS and torch_private.in_backward():
            return  # recomputation inside backward (activation checkpointing)
        if factor is not None and type(tensor) is torch.Tensor:
            tensor, factor = tensor * factor, None
        self._record(module, name, tensor, kind=kind, shard_dim=shard_dim, minus=minus, factor=factor)

    def record_residual(self, module: torch.nn.Module, h: torch.Tensor, x: torch.Tensor | None, *,
                        accumulator: bool) -> None:
        """Observe a block's output ``h`` as the residual accumulator (when ``accumulator``) and
        ``h - x`` as its contribution (when ``x``, the block's input of the same shape, is given):
        the two :meth:`record` calls."""
        if accumulator:
            self._observe(module, "", h, "residual_accumulator", None, None)
        if x is not None:
            self._observe(module, "", h, "residual_contribution", None, x)

    @torch.no_grad()  # metric arithmetic builds no graph (and skips autograd's dispatch work)
    def _record(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, *, kind: str,
                shard_dim: int | None, minus: torch.Tensor | None, factor: float | torch.Tensor | None = None) -> None:
        """Observe one tensor: every device, padding, DTensors."""
        if kind == "token_mask":
            # The kept rows' indices, found once per micro-batch (not a boolean index per
            # observation: on an accelerator each one is a host sync); no padding: no index.
            mask = tensor.detach().reshape(-1).bool()
            kept = mask.nonzero().squeeze(1)
            self._padding = None if kept.numel() == mask.numel() else Padding(kept, mask.numel())
            return
        x, shard_dim, split_axes = local_tokens(tensor.detach(), shard_dim)
        if factor is not None:  # a DTensor cotangent's scale, applied to its reduced local part
            x = x * factor
        x = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() > 1 else x.reshape(-1, 1)
        y = local_tokens(minus.detach(), None)[0].reshape(x.shape) if minus is not None else None
        # Only token rows are padded: an expert_bias [E] as long as the micro-batch is not.
        masked = kind in TOKEN_KINDS and self._padding is not None and self._padding.length == x.shape[0]
        path = self.index.path(module)
        full = ".".join(p for p in (self.index.name_of(path), name) if p)  # canonical where it has one
        site = self._site(full, kind, x, shard_dim, path, split_axes)
        readers = self.readers(site, path)
        if y is not None:
            # Widened first where narrower than float32: the difference of two bfloat16 (or
            # float16) values is then exact in float32, not rounded to the inputs' precision.
            x = x.float() - y.float() if x.is_floating_point() and x.element_size() < 4 else x - y
        if site.key in self._fresh and site.key not in self._firsts and kind in SEQUENCE_CHECKED:
            self._firsts[site.key] = torch.linalg.vector_norm(x, dtype=torch.float64).square()
        if masked:
            assert self._padding is not None, "masked is only set with a mask"
            x = x.index_select(0, self._padding.on(x.device))
        if not masked and readers and site.kind in self.kept and not x.is_inference():
            # Kept, not copied, until finish(): its version tells there whether the model
            # changed it in place meanwhile (inference tensors have no version counter). An
            # expert_bias is left out: models update it in place within the step, by design.
            self._views.append((site, x, torch_private.version(x)))
        memo: dict = {}  # metrics of this observation share statistics (expert counts, sums of squares)
        for metric, joint in readers:
            if metric.name in self.errors:
                continue
            if joint:
                self._deferred.setdefault(metric.name, []).append((site, x))
                continue
            self.prepare(metric, site, x, memo)

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
            if self.reporter.speaks:
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
        changed = {site.key: (version, now) for site, x, version in self._views
                   if (now := torch_private.version(x)) != version}
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
                        self.check(metric, site)
                    if prepared_jointly(metric):
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

