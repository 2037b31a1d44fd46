"""The demo job: a byte-level MoE transformer trained on Python's own sources, on any topology.

``run_demo(DemoArgs(...))`` runs it; ``demo_options`` adds its flags to a click command.
Modules: ``model`` (the transformer), ``data`` (the byte corpus), ``topology`` (degrees and
mesh), ``parallel`` (sharding and the exact schedule), ``train`` (the loop and its metrics hook
point), ``launch`` (one process, ``--nproc`` ranks, or a ``torchrun`` rank).
"""

from __future__ import annotations

from tmetrics_core.demo.launch import DemoArgs
from tmetrics_core.demo.launch import DemoSummary
from tmetrics_core.demo.launch import demo_options
from tmetrics_core.demo.launch import run_demo
from tmetrics_core.demo.train import MetricsFactory
from tmetrics_core.demo.train import StepMetrics

__all__ = [
    "DemoArgs",
    "DemoSummary",
    "MetricsFactory",
    "StepMetrics",
    "demo_options",
    "run_demo",
]
