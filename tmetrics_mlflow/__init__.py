"""MLflow sink for tmetrics (explicit run ids, batched metrics, config as params) and run comparison.

The names are imported when first used (PEP 562), so loading the ``tmetrics compare`` command
for ``tmetrics --help`` imports neither numpy nor mlflow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tmetrics_mlflow.compare import compare_runs
    from tmetrics_mlflow.params import flatten_params
    from tmetrics_mlflow.sink import MlflowSink, check_tracking_uri

__all__ = [
    "MlflowSink",
    "check_tracking_uri",
    "compare_runs",
    "flatten_params",
]

_HOMES = {
    "MlflowSink": "tmetrics_mlflow.sink",
    "check_tracking_uri": "tmetrics_mlflow.sink",
    "compare_runs": "tmetrics_mlflow.compare",
    "flatten_params": "tmetrics_mlflow.params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tmetrics_mlflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
