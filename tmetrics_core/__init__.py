"""tmetrics: training-time tensor metrics for sharded PyTorch models, per layer and per expert.

The public surface is this module only::

    import tmetrics_core as tm
    metrics = tm.TensorMetrics.from_config("tmetrics.yaml", model=model, optimizer=optimizer,
                                          mesh=device_mesh)
"""

from __future__ import annotations

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
