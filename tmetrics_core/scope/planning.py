"""The plan of a :class:`~tmetrics_core.tensor_metrics.TensorMetrics`: its model's placed
tensors, modules and routers, made at construction and made anew when the parameters change.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.manifest_exchange import share_holdings
from tmetrics_core.hub.sink_hub import NullHub
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.naming.signature import parameter_signature
from tmetrics_core.records import RunInfo
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.sources.routers import find_routers
from tmetrics_core.topology import Topology

__all__ = ["Planning", "write_manifest"]


class Planning:
    """Planning and re-planning the model, mixed into
    :class:`~tmetrics_core.tensor_metrics.TensorMetrics` (whose state they set)."""

    model: torch.nn.Module
    optimizer: Any
    topology: Topology
    executor: Executor
    reporter: Reporter
    metrics: list[tuple[TensorMetric, int]]
    flat: dict[str, list[FlatBuffer]]
    hub: Any
    run: RunInfo | None
    manifest: Manifest
    index: ModuleIndex
    routers: list[Any]
    params: ParamObserver
    _manifest_options: dict[str, Any]
    _signature: Any
    _num_experts: int
    _verify_replicas: str
    _replan_due: bool
    _checked: set[str]
    _observed: list[Any]
    _observation_hooks: Callable[[], list[Any]]
    """Installs the token sources' hooks (``TensorMetrics._observation_hooks``)."""

    def _plan_model(self) -> None:
        """The manifest (shared across ranks: a collective), the parameters' signature, the
        module index and the routers of the model as it is now."""
        self.manifest = Manifest.build(self.model, self.topology, **self._manifest_options,
                                       share=lambda mine: share_holdings(mine, self.executor))
        self._signature = parameter_signature(self.model)
        self.index = ModuleIndex(self.model, layer_offset=self._manifest_options["layer_offset"])
        self.routers = find_routers(self.model, self.index)  # routers of the frameworks sources/routers.py knows
        self._num_experts = self.manifest.num_experts or max((r.num_experts for r in self.routers), default=0)

    def _param_observer(self) -> ParamObserver:
        return ParamObserver(self.manifest, self.topology, self.executor, optimizer=self.optimizer, flat=self.flat,
                             metrics=[m for m, _ in self.metrics], verify_replicas=self._verify_replicas,
                             on_verified=self._rewrite_manifest)

    def _replan(self, step: int) -> None:
        """Plan the model again as it is now: its parameters changed after the last plan on some
        rank (:func:`~tmetrics_core.naming.signature.parameter_signature`), which the last due
        step's agreement told every rank, so every rank re-plans here, at the same due step,
        with the same collectives: the manifest shared again, the parameter side and the
        forward hooks made anew, Replica claims of the parameters checked, plans compared again."""
        self._replan_due = False
        before = len(self.manifest.entries)
        self._plan_model()
        self.params = self._param_observer()
        self.params.verify_startup()
        for handle in self._observed:
            handle.remove()
        self._observed = self._observation_hooks()
        self._checked = set()
        self._rewrite_manifest()
        self.reporter.warning("tmetrics: the model's parameters changed after they were planned; re-planned at step "
                              "%d: %d tensors (were %d). Said at every re-plan", step, len(self.manifest.entries),
                              before)

    def _rewrite_manifest(self) -> None:
        """``manifest.json`` again after a verification past start-up marked claims in it."""
        if self.run is not None and self.hub is not None and not isinstance(self.hub, NullHub):
            write_manifest(dataclasses.replace(self.run, manifest=tuple(self.manifest.rows())))


def write_manifest(run: RunInfo) -> None:
    """``<run dir>/manifest.json``: the manifest rows, for people and for ``tmetrics names``."""
    path = Path(run.dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps(list(run.manifest), indent=1))
