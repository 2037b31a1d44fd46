"""A small model with canonical layer names (``layers.{i}.weight``), and a loop that trains it
under ``TensorMetrics`` while keeping every record handed to the sinks ("records in")."""

from __future__ import annotations

import time
from typing import Any

import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.records import MetricRecord
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["LayeredModel", "catalogue_metrics", "train_steps"]


class LayeredModel(torch.nn.Module):
    """``layers.{i}`` linear maps (layer ``i`` for the manifest) and a ``head``."""

    def __init__(self, width: int = 6, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def catalogue_metrics(*names: str) -> list[tuple[Any, int]]:
    """Catalogue metrics by name, each due every step."""
    return [(build_metric(name), 1) for name in names]


def train_steps(metrics: TensorMetrics, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                steps: range) -> tuple[list[MetricRecord], float]:
    """Train ``steps``; returns every record the steps produced, and the longest step in seconds
    (what a slow or hung sink may cost the training thread)."""
    produced: list[MetricRecord] = []
    longest = 0.0
    for step in steps:
        start = time.perf_counter()
        with metrics.step(step):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        longest = max(longest, time.perf_counter() - start)
        produced += metrics.last_records
    return produced, longest
