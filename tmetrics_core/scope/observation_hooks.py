"""The hooks of every source kind the configured metrics read, installed by the kinds' installers.

Each kind's record names its installers (``SourceKind.installers`` in :mod:`tmetrics_core.kinds`,
as ``"package.module:function"``); this module imports those of the kinds read, in the declared
order (:func:`~tmetrics_core.kinds.installers_of`), and hands each one
:class:`~tmetrics_core.sources.hook_context.HookContext`. A new hook-read kind therefore needs no
line here. Installed once by :class:`~tmetrics_core.tensor_metrics.TensorMetrics` and kept until
its ``close()``: on steps with no due metric of their kind they pass their tensors to
``tmetrics_core.observe``, which drops them; and a compiled model sees the same hooks on every
step (a hook added or removed is a recompile).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence, cast

import torch

from tmetrics_core.kinds import TOKEN_KINDS, declared, installers_of
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.hook_context import HookContext, Installer
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.topology import Topology

__all__ = ["install_observation_hooks", "resolve_installer"]


def install_observation_hooks(model: torch.nn.Module, metrics: Sequence[TensorMetric], *, index: ModuleIndex,
                              routers: Sequence[Any], topology: Topology, modules: Mapping[str, Sequence[str]],
                              token_modules: Mapping[str, Sequence[str]], owner: int,
                              reporter: Reporter) -> list[Any]:
    """Hook every source kind that ``metrics`` read; returns the handles (``.remove()`` each). On
    an error no hook stays installed.

    Args:
        metrics: the configured metrics (those without a token source kind are passed over).
        index: the model's modules, blocks and head.
        routers: the model's MoE routers (:func:`~tmetrics_core.sources.routers.find_routers`).
        modules: metric name -> module globs of ``activation`` metrics.
        token_modules: metric name -> module globs of cotangent (``activation_grad``) metrics.
        owner: the number of the ``TensorMetrics`` whose observer takes these hooks' calls.
        reporter: says a padding mask's warnings on the logging rank.

    Raises:
        ConfigError: ``attn_qk`` read from a Hugging Face attention implementation it cannot reach.
        ImportError: a kind's installer that cannot be imported (:func:`resolve_installer`).
    """
    token_metrics = tuple(m for m in metrics if set(m.source_kinds) & TOKEN_KINDS)
    kinds = frozenset(k for m in token_metrics for k in m.source_kinds)
    hooks = HookContext(model=model, index=index, metrics=token_metrics, kinds=kinds, routers=tuple(routers),
                        topology=topology, modules=modules, token_modules=token_modules, owner=owner,
                        reporter=reporter)
    handles: list[Any] = []
    try:
        for path in installers_of(kinds):
            handles += resolve_installer(path)(hooks)
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def resolve_installer(path: str) -> Installer:
    """The installer that ``path`` (``"package.module:function"``, as a record names it) names.

    Raises:
        ImportError: the module cannot be imported or has no such function; the message names
            the path and the kinds that name it.
    """
    module, _, name = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"the installer {path!r}, named by source kinds "
                          f"{sorted(k.name for k in declared() if path in k.installers)}, cannot be imported: "
                          f"{type(exc).__name__}: {exc}. Spell it 'package.module:function'") from exc
    return cast(Installer, found)
