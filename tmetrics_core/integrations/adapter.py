"""The one extension point for training frameworks: :class:`FrameworkAdapter`.

``TensorMetrics.from_config`` (:mod:`tmetrics_core.build`) has every adapter of
:data:`tmetrics_core.integrations.frameworks.FRAMEWORKS`, in order, take the user's model and
optimizer out of its framework's wrappers (:meth:`~FrameworkAdapter.unwrap`), then asks each
whether they come from its framework (:meth:`~FrameworkAdapter.detect`); the first adapter that knows the
topology gives it (:meth:`~FrameworkAdapter.topology`); then each detected adapter, in order,
hands over what it knows (:meth:`~FrameworkAdapter.prepare`): the model and optimizer as
tmetrics reads them, placements of parameters, global layer and expert offsets, flat buffers,
router observation and the step hooks of a framework optimizer. The no-framework case is an
adapter too (:mod:`tmetrics_core.integrations.generic`, always detected, last).

An adapter imports its framework lazily (``sys.modules``, type names), so tmetrics never
imports a framework the user did not; and it never imports ``tensor_metrics`` (the build
imports the adapters). Naming tables stay in :mod:`tmetrics_core.naming.layouts`, below the
integrations; an adapter names those of its framework in :attr:`~FrameworkAdapter.layouts`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Protocol

from tmetrics_core.integrations.megatron_shards import OwnedRanges
from tmetrics_core.placements import Placement
from tmetrics_core.topology import Topology

__all__ = ["BaseAdapter", "FrameworkAdapter", "Prepared"]


@dataclass
class Prepared:
    """What one adapter hands to ``TensorMetrics`` (see :meth:`FrameworkAdapter.prepare`).

    Attributes:
        model: the module tmetrics names and reads (inside the framework's wrappers).
        optimizer: the optimizer tmetrics hooks (a framework optimizer adapted to torch's step
            hooks, e.g. :class:`~tmetrics_core.integrations.step_hooks.StepHooks`).
        placements: ``{parameter name: {axis: placement}}`` the framework states (the config's
            ``placements:`` win over them); empty when it states none.
        offsets: ``(first global layer, first global expert)`` of this rank's model, or None
            when the framework does not number them (tmetrics' own inference then).
        flat_buffers: flat shards of gradients and optimizer state the framework's optimizer
            keeps (ZeRO, Megatron's ``DistributedOptimizer``).
        handles: things with ``remove()`` (router observation, the optimizer adapter), removed
            by ``TensorMetrics.close()``, or at once when building it fails.
        constructing: entered around ``TensorMetrics(...)`` (ZeRO 3 gathers its parameters
            there so the manifest sees their shapes).
        attach: called with the built ``TensorMetrics``; returns more handles (step hooks that
            need the tracker, such as ZeRO 3's partition copies).
    """

    model: Any
    optimizer: Any
    placements: dict[str, dict[str, Placement]] = field(default_factory=dict)
    offsets: tuple[int, int] | None = None
    flat_buffers: list[OwnedRanges] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    constructing: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    attach: Callable[[Any], list[Any]] | None = None


class FrameworkAdapter(Protocol):
    """A training framework as tmetrics reads it. Adding a framework is one module implementing
    this (and its test), listed in :data:`~tmetrics_core.integrations.frameworks.FRAMEWORKS`.

    Attributes:
        name: the framework's name, as messages and ``tmetrics`` commands say it.
        layouts: the names of the naming tables (:data:`tmetrics_core.naming.layouts.LAYOUTS`)
            that name this framework's parameters; empty when the model's own names serve.
    """

    name: str
    layouts: tuple[str, ...]

    def unwrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        """``(model, optimizer)`` outside this framework's wrappers, as the next adapters and
        tmetrics read them; both as given when they are not this framework's. Called on every
        adapter, in order, before any :meth:`detect`."""
        ...

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        """Whether the objects given to ``from_config`` come from this framework (or its
        global state is initialized). Raises ``ConfigError`` for objects of the framework given
        in a way it cannot read (say how to pass them)."""
        ...

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        """The topology this framework knows, or None to leave it to the next adapter (a user's
        ``mesh=``/``axes=`` usually win). Called on a detected adapter only; collectives bounded by
        ``timeout_s``. Raises ``ConfigError`` for a layout tmetrics cannot read."""
        ...

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        """What this framework tells about ``model`` and ``optimizer`` (the previous adapter's
        :attr:`Prepared.model` and :attr:`Prepared.optimizer`). Called on a detected adapter
        only, after every check of the adapter passed: what it installs (hooks, wrappers) is
        undone by the handles. Raises ``ConfigError`` for what the framework does that tmetrics
        does not read."""
        ...


class BaseAdapter:
    """The defaults of a :class:`FrameworkAdapter`: unwraps nothing, detects nothing, states no
    topology, and prepares the model and optimizer as given (no placements, offsets or hooks).
    A framework that only wraps the user's objects (accelerate's optimizer, a LightningModule)
    overrides :meth:`unwrap`; one that tells something about a model overrides :meth:`detect`
    and what it tells. A subclass sets ``name`` (and ``layouts``, its naming tables)."""

    name = "base"
    layouts: tuple[str, ...] = ()

    def unwrap(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        return model, optimizer

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return False

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        return None

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        return Prepared(model=model, optimizer=optimizer)
