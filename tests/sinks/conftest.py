"""Records of a small MoE model (3 layers, 4 experts) for every sink test."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Callable

import pytest

from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo

LAYERS = 3
EXPERTS = 4


def make_records(step: int) -> list[MetricRecord]:
    """One step of every record shape: global, per layer, per layer and stat, per layer and
    expert, per tensor, a family tensor name, vectors and histograms (with zeros and NaN)."""
    s = step
    out = [MetricRecord("global-grad-l2", s, 1.5 * s)]
    for i in range(LAYERS):
        out.append(MetricRecord("layer-grad-l2", s, s + i / 10, labels=Labels(layer=i)))
        out.append(MetricRecord("layer-expert-load-imbalance", s, 1 + i / 10 + s / 100, labels=Labels(layer=i, stat="max_over_mean")))
        out.append(MetricRecord("layer-expert-load-imbalance", s, i / 5 + s / 1000, labels=Labels(layer=i, stat="cv")))
        out.append(MetricRecord("layer-expert-tokens", s, tuple(float(10 * s + e + i) for e in range(EXPERTS)), labels=Labels(layer=i)))
        hist = Histogram(edges=(1e-3, 1e-2, 1e-1, 1.0), counts=(i, 2, 3 + s), zeros=1, nan=1 if i == 0 else 0)
        out.append(MetricRecord("layer-grad-histogram", s, hist, labels=Labels(layer=i)))
        out.append(MetricRecord("tensor-grad-l2", s, 2.0 * s + i, labels=Labels(tensor=f"layers.{i}.attn.q.weight")))
        for e in range(EXPERTS):
            out.append(MetricRecord("layer-router-expert-bias", s, s * 0.5 + e - i, labels=Labels(layer=i, expert=e)))
    out.append(MetricRecord("tensor-grad-l2", s, 0.25 * s, labels=Labels(tensor="embed.weight")))
    out.append(MetricRecord("family-grad-l2", s, 3.0 * s, labels=Labels(tensor="layers.*.attn.q.weight")))
    out.append(MetricRecord("output-entropy", s, math.nan if s == 2 else 4.0 - s / 10))
    return out


@pytest.fixture
def records() -> Callable[[int], list[MetricRecord]]:
    return make_records


@pytest.fixture
def run_info(tmp_path) -> RunInfo:
    return RunInfo(
        name="demo-run",
        dir=str(tmp_path / "run"),
        config={"run": {"name": "demo-run"}, "metrics": ["layer-grad-l2:1"], "sinks": {"tensorboard": {}}},
        manifest=({"name": "layers.0.attn.q.weight", "shape": [8, 8], "dtype": "float32"},),
        tags={"dp": "2", "tp": "1", "model": "TinyMoE"},
        num_layers=LAYERS,
        num_experts=EXPERTS,
        metrics=("global-grad-l2", "layer-grad-l2"),
    )


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory) -> Path:
    """An empty, fully migrated MLflow SQLite store, built once per session (creating one takes
    seconds); tests copy it rather than migrate a new one each time."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, mlflow_template_db) -> str:
    """A fresh SQLite tracking URI for one test (a copy of the template store)."""
    path = tmp_path / "store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(mlflow_template_db, path)
    return f"sqlite:///{path}"
