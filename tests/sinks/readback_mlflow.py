"""Read an MLflow run back through ``MlflowClient``: metric histories, params, tags, artifacts."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

__all__ = ["artifact_json", "histories", "run_by_id"]


def run_by_id(tracking_uri: str, run_id: str) -> tuple[MlflowClient, Any]:
    client = MlflowClient(tracking_uri=tracking_uri)
    return client, client.get_run(run_id)


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric key of the run -> its full history ``[(step, value)]`` in logging order."""
    keys = client.get_run(run_id).data.metrics
    return {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))]
        for key in keys
    }


def artifact_json(client: MlflowClient, run_id: str, path: str) -> Any:
    """Download one JSON artifact (works for local and proxied server artifact stores)."""
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        return json.loads(Path(local).read_text())
