"""The demo training step with tmetrics, without it, and with what people write instead.

Each variant is a :class:`~tmetrics_core.demo.train.Trainer` on its own copy of the demo model
(same seed, same batches), differing only in the metrics object the loop calls:

- ``bare``: no metrics (``NullMetrics``);
- ``tmetrics``: :class:`~tmetrics_core.TensorMetrics` with the standard bundle at an interval;
- ``wandb.watch``: ``wandb.watch(model, log="all", log_freq=1)`` on an offline run, committed
  with one ``run.log`` per step (watch's histograms are only written by the next ``log``);
- ``norm loop``: per-parameter ``.norm().item()`` of every parameter and gradient per step,
  after backward (where tmetrics reads them too); with ``all_reduce=True`` each norm is
  squared and all-reduced over the world first, one collective per tensor.

Records stay in memory for tmetrics (no sink): sink costs are measured by
``bench.sink_blocking``. The bundle is ``BUNDLE``; :data:`BUNDLES` names it and the bundles
of the backward, attention and low-precision metrics, whose names may carry recipes
(``layer-param-quant:mxfp8+fp8-tensorwise``, see :func:`metric_of`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from tmetrics_core.topology import Topology as Axes
from tmetrics_core.demo.data import ByteCorpus
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.demo.train import MetricsFactory, StepMetrics, TrainConfig, Trainer
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["BUNDLE", "BUNDLES", "NEVER", "NormLoop", "WandbWatch", "make_trainer", "norm_loop_factory", "metric_of",
           "tmetrics_factory", "wandb_factory"]

BUNDLE = (
    "layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "layer-update-ratio",
    "layer-residual-accumulator-rms", "layer-residual-contribution-rms",
    "layer-expert-tokens", "layer-expert-load-imbalance", "layer-router-decision-entropy",
)
"""The standard bundle: per-layer parameter and gradient L2, gradient absmax, update ratio,
residual RMS (stream and block contribution), router load and decision entropy."""

BUNDLES = {
    "standard": BUNDLE,
    "backward": ("layer-residual-grad-rms", "layer-backward-gain", "layer-residual-grad-l2", "output-logits-grad-l2"),
    "attention": ("layer-attn-logit-max", "layer-attn-entropy", "layer-attn-sink", "layer-attn-lse"),
    "low-precision": ("layer-param-quant:mxfp8+fp8-tensorwise",),
}
"""Bundles by name: the standard one, the backward statistics (docs/backward.md: cotangents of
the blocks' outputs and of the logits), the attention diagnostics (recomputed from the queries
and keys of every layer) and the low-precision statistics of the parameters under two recipes."""

NEVER = 10**9
"""An interval no benchmark reaches: after its first step (always due) nothing is due again."""


def make_trainer(metrics: MetricsFactory | None, *, dp: int = 1, corpus: ByteCorpus | None = None) -> Trainer:
    """The demo trainer (default model, global batch 8) on one process or ``dp`` DDP ranks."""
    topology = ParallelDegrees(dp=dp)
    config = TrainConfig(steps=10**6)
    parallel = parallelize(ModelConfig(), topology, seed=config.seed, batch_size=config.batch_size)
    return Trainer(parallel, corpus or ByteCorpus.from_stdlib(), config, metrics=metrics)


def metric_of(spec: str) -> TensorMetric:
    """The metric a bundle entry names: ``name`` or ``name:recipe+recipe`` (the recipes of a
    ``layer-*-quant`` metric).

    Raises:
        ConfigError: an unknown name or recipe, or recipes on a metric that takes none.
    """
    name, _, recipes = spec.partition(":")
    return build_metric(name, recipe=tuple(recipes.split("+")) if recipes else None)


def tmetrics_factory(interval: int, names: tuple[str, ...] = BUNDLE) -> MetricsFactory:
    """TensorMetrics with the metrics ``names`` (default the standard bundle; entries as
    :func:`metric_of` reads them) every ``interval`` steps, no sink."""
    def build(model: nn.Module, optimizer: Optimizer, mesh: Any) -> StepMetrics:
        topology = Axes.from_mesh(mesh) if mesh is not None else None
        return TensorMetrics(model, metrics=[(metric_of(name), interval) for name in names],
                             optimizer=optimizer, topology=topology)
    return build


_WANDB_DIRS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")


class WandbWatch:
    """``wandb.watch(model, log="all", log_freq=1)`` on an offline run in a temporary directory
    (W&B's directory variables point there until :meth:`close` restores them)."""

    def __init__(self, model: nn.Module) -> None:
        import wandb

        self._dir = tempfile.TemporaryDirectory(prefix="bench-wandb-")
        self._environ = {v: os.environ.get(v) for v in _WANDB_DIRS}
        os.environ.update({v: self._dir.name for v in _WANDB_DIRS})
        # The global run: watch's hooks log through ``wandb.run``.
        self.run = wandb.init(project="bench", dir=self._dir.name, mode="offline",
                              settings=wandb.Settings(console="off", silent=True))
        wandb.watch(model, log="all", log_freq=1)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        yield
        self.run.log({"step": step})

    def observe_gradients(self) -> None:
        return None

    def close(self) -> None:
        self.run.finish()
        for variable, value in self._environ.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        self._dir.cleanup()


def wandb_factory(model: nn.Module, optimizer: Optimizer, mesh: Any) -> StepMetrics:
    """A :class:`WandbWatch` on ``model``."""
    return WandbWatch(model)


class NormLoop:
    """The loop people write: every parameter's and gradient's L2 norm, read with ``.item()``.

    Args:
        model: the model whose ``named_parameters()`` are read.
        all_reduce: square each local norm and all-reduce it over the world before reading
            (one collective per tensor, as needed when tensors are sharded).
    """

    def __init__(self, model: nn.Module, *, all_reduce: bool = False) -> None:
        self.params = [p for _, p in model.named_parameters()]
        self.all_reduce = all_reduce
        self.values: list[float] = []
        self.collectives = 0
        self.seconds = 0.0
        """Wall time inside the all_reduce calls."""

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def observe_gradients(self) -> None:
        values = []
        for p in self.params:
            for t in (p.detach(), p.grad):
                if t is None:
                    continue
                norm = t.norm()
                if self.all_reduce:
                    norm = norm.square()
                    start = time.perf_counter()
                    dist.all_reduce(norm)
                    self.seconds += time.perf_counter() - start
                    self.collectives += 1
                values.append(norm.item())
        self.values = values

    def close(self) -> None:
        return None


def norm_loop_factory(*, all_reduce: bool = False) -> Callable[[nn.Module, Optimizer, Any], StepMetrics]:
    """A :class:`NormLoop` factory (``all_reduce``: one collective per tensor)."""
    def build(model: nn.Module, optimizer: Optimizer, mesh: Any) -> StepMetrics:
        return NormLoop(model, all_reduce=all_reduce)
    return build

