"""tmetrics: training-time tensor metrics for sharded PyTorch models, per layer and per expert.

The public surface is this module only::

    import tmetrics_core as tm
    metrics = tm.TensorMetrics.from_config("tmetrics.yaml", model=model, optimizer=optimizer,
                                          mesh=device_mesh)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tmetrics_core.attention_spec import AttentionSpec
    from tmetrics_core.topology import Axis
    from tmetrics_core.topology import Topology
    from tmetrics_core.config.schema import Config
    from tmetrics_core.config.schema import load_config
    from tmetrics_core.errors import ConfigError
    from tmetrics_core.errors import PlacementError
    from tmetrics_core.errors import PlanMismatchError
    from tmetrics_core.errors import SinkError
    from tmetrics_core.errors import TMetricsError
    from tmetrics_core.metrics.base import MetricResult
    from tmetrics_core.metrics.base import StatMetric
    from tmetrics_core.metrics.base import TensorMetric
    from tmetrics_core.observe import observe
    from tmetrics_core.placements import FlatShard
    from tmetrics_core.placements import Owned
    from tmetrics_core.placements import Partial
    from tmetrics_core.placements import Replica
    from tmetrics_core.placements import Shard
    from tmetrics_core.placements import StridedShard
    from tmetrics_core.records import Histogram
    from tmetrics_core.records import Labels
    from tmetrics_core.records import MetricRecord
    from tmetrics_core.records import RunInfo
    from tmetrics_core.sinks.registry import MetricSink
    from tmetrics_core.sources.flat import FlatBuffer
    from tmetrics_core.site import Site
    from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = [
    "AttentionSpec",
    "Axis",
    "Config",
    "ConfigError",
    "FlatBuffer",
    "FlatShard",
    "Histogram",
    "Labels",
    "MetricRecord",
    "MetricResult",
    "MetricSink",
    "Owned",
    "Partial",
    "PlacementError",
    "PlanMismatchError",
    "Replica",
    "RunInfo",
    "Shard",
    "SinkError",
    "Site",
    "StatMetric",
    "StridedShard",
    "TMetricsError",
    "TensorMetric",
    "TensorMetrics",
    "Topology",
    "load_config",
    "observe",
]
__version__ = "0.1.0"

_HOMES = {
    "AttentionSpec": "tmetrics_core.attention_spec",
    "Axis": "tmetrics_core.topology",
    "Config": "tmetrics_core.config.schema",
    "ConfigError": "tmetrics_core.errors",
    "FlatBuffer": "tmetrics_core.sources.flat",
    "FlatShard": "tmetrics_core.placements",
    "Histogram": "tmetrics_core.records",
    "Labels": "tmetrics_core.records",
    "MetricRecord": "tmetrics_core.records",
    "MetricResult": "tmetrics_core.metrics.base",
    "MetricSink": "tmetrics_core.sinks.registry",
    "Owned": "tmetrics_core.placements",
    "Partial": "tmetrics_core.placements",
    "PlacementError": "tmetrics_core.errors",
    "PlanMismatchError": "tmetrics_core.errors",
    "Replica": "tmetrics_core.placements",
    "RunInfo": "tmetrics_core.records",
    "Shard": "tmetrics_core.placements",
    "SinkError": "tmetrics_core.errors",
    "Site": "tmetrics_core.site",
    "StatMetric": "tmetrics_core.metrics.base",
    "StridedShard": "tmetrics_core.placements",
    "TMetricsError": "tmetrics_core.errors",
    "TensorMetric": "tmetrics_core.metrics.base",
    "TensorMetrics": "tmetrics_core.tensor_metrics",
    "Topology": "tmetrics_core.topology",
    "load_config": "tmetrics_core.config.schema",
    "observe": "tmetrics_core.observe",
}
"""Each public name's module. A name is imported when first used (PEP 562), so ``tmetrics
--help`` and the torch-free modules (config, records, sinks) do not import torch."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tmetrics_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """This package, keeping ``tmetrics_core.observe`` the function: importing the submodule of
    that name sets the package attribute to the module, which the eager imports used to
    overwrite with the function. ``from tmetrics_core.observe import ...`` is unchanged."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "observe" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
