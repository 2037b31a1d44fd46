"""MLflow sink for tmetrics (explicit run ids, batched metrics, config as params) and run comparison."""

from __future__ import annotations

from tmetrics_mlflow.compare import compare_runs
from tmetrics_mlflow.params import flatten_params
from tmetrics_mlflow.sink import MlflowSink, check_tracking_uri

__all__ = [
    "MlflowSink",
    "check_tracking_uri",
    "compare_runs",
    "flatten_params",
]
