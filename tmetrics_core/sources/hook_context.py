"""What an installer of observation hooks is handed (:mod:`tmetrics_core.scope.observation_hooks`).

A source kind's record names the functions that hook it (``SourceKind.installers``); each takes
one :class:`HookContext` and returns the handles it installed. The context holds the model, what
the configured metrics read, and the entries of :mod:`tmetrics_core.observe` bound to the owner
number of the ``TensorMetrics`` that installs them, so its observer takes these hooks' calls and
another's does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from tmetrics_core.observe import fail, fail_unless, record, record_attention, record_residual, tap
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.topology import Topology

__all__ = ["HookContext", "Installer"]


@dataclass(frozen=True)
class HookContext:
    """The model and the configured metrics' wants, for one ``TensorMetrics``' installers.

    Attributes:
        model: the measured model.
        index: its modules, blocks and head.
        metrics: the configured metrics that read a kind with token rows.
        kinds: the kinds those metrics read.
        routers: the model's MoE routers (:func:`~tmetrics_core.sources.routers.find_routers`).
        topology: the named axes.
        modules: metric name -> module globs of ``activation`` metrics.
        token_modules: metric name -> module globs of cotangent (``activation_grad``) metrics.
        owner: the number of the ``TensorMetrics`` whose observer takes these hooks' calls.
        reporter: says warnings on the logging rank.
    """

    model: torch.nn.Module
    index: ModuleIndex
    metrics: tuple[TensorMetric, ...]
    kinds: frozenset[str]
    routers: tuple[Any, ...]
    topology: Topology
    modules: Mapping[str, Sequence[str]]
    token_modules: Mapping[str, Sequence[str]]
    owner: int
    reporter: Reporter

    @property
    def record(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.record` for this owner: ``(module, name, tensor, *, kind, shard_dim)``."""
        return functools.partial(record, owner=self.owner)

    @property
    def record_residual(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.record_residual` for this owner: ``(module, h, x, *, accumulator)``."""
        return functools.partial(record_residual, owner=self.owner)

    @property
    def record_attention(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.record_attention` for this owner:
        ``(module, name, q, k, *, spec, shard_dim)``."""
        return functools.partial(record_attention, owner=self.owner)

    @property
    def tap(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.tap` for this owner: the cotangent of
        ``(module, name, tensor, *, kind, shard_dim)``."""
        return functools.partial(tap, owner=self.owner)

    @property
    def fail(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.fail` for this owner: ``(reason, kinds)``."""
        return functools.partial(fail, owner=self.owner)

    @property
    def fail_unless(self) -> Callable[..., None]:
        """:func:`tmetrics_core.observe.fail_unless` for this owner: ``(ok, reason, kinds)``."""
        return functools.partial(fail_unless, owner=self.owner)


Installer = Callable[[HookContext], list[Any]]
"""A source kind's installer: hooks the model for the kinds it reads; returns the handles."""
