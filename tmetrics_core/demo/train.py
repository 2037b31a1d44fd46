"""The demo's training loop: AdamW, warm-up then cosine learning rate, gradient clipping,
non-finite step skipping, failure injection, and one hook point for the metrics object.

The hook point (see :class:`Trainer.step`)::

    with metrics.step(step):
        loss = forward and backward        # observe() sites fire inside the model
        clip gradients                     # global norm over all ranks
        optimizer.step()                   # metrics read gradients, state, updates via step hooks
        optimizer.zero_grad()

``metrics`` is built by a :class:`MetricsFactory` from the model, optimizer and mesh after the
optimizer exists, so it can register optimizer step hooks; without one, :class:`NullMetrics`.
"""

from __future__ import annotations

import contextlib
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Mapping, Protocol

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import AdamW, Optimizer
from tqdm import tqdm

from tmetrics_core.demo.data import ByteCorpus
from tmetrics_core.demo.model import Block, ModelConfig
from tmetrics_core.demo.parallel import ParallelModel
from tmetrics_core.errors import ConfigError

__all__ = [
    "INJECTIONS",
    "Injection",
    "MetricsFactory",
    "NullMetrics",
    "StepMetrics",
    "StepResult",
    "TrainConfig",
    "Trainer",
]

InjectionKind = Literal["lr-spike", "dead-expert", "nan-grad"]
INJECTIONS: tuple[str, ...] = ("lr-spike", "dead-expert", "nan-grad")
_DEAD_BIAS = -1e4  # far below any router logit, finite so every sink can store it


@dataclass(frozen=True, kw_only=True, slots=True)
class Injection:
    """A deliberate failure that the metrics should make visible.

    - ``lr-spike``: the learning rate of every parameter of ``layer`` is multiplied by
      ``factor`` for steps ``start_step .. start_step + duration - 1``.
    - ``dead-expert``: from ``start_step`` on, ``layers.{layer}.moe.expert_bias[expert]`` is
      set to -1e4, so the router never picks ``expert`` (it gets zero tokens).
    - ``nan-grad``: at ``start_step``, after backward, every element of the gradient of
      ``layers.{layer}.attn.q.weight`` becomes NaN; the step is then skipped (see
      :meth:`Trainer.update`).
    """

    kind: InjectionKind
    """One of :data:`INJECTIONS`."""
    layer: int
    """Global index of the affected layer."""
    start_step: int
    """First affected step (steps count from 1)."""
    expert: int = 0
    """Global index of the dead expert (``dead-expert`` only)."""
    duration: int = 5
    """Number of steps of the spike (``lr-spike`` only)."""
    factor: float = 1000.0
    """Learning-rate multiplier of the spike (``lr-spike`` only)."""

    @classmethod
    def default(cls, kind: str, model: ModelConfig, *, steps: int) -> Injection:
        """The demo's choice: the middle layer (first MoE layer from there for ``dead-expert``),
        the last expert, starting a third of the way into ``steps``.

        Raises:
            ConfigError: unknown ``kind``, or ``dead-expert`` on a model with no MoE layer or
                with ``top_k == n_experts``.
        """
        if kind not in INJECTIONS:
            raise ConfigError(f"unknown injection {kind!r}; valid: {', '.join(INJECTIONS)}", path="--inject")
        layer = model.n_layers // 2
        if kind == "dead-expert":
            moe_layers = [i for i in range(model.n_layers) if model.is_moe(i)]
            if not moe_layers or model.top_k == model.n_experts:
                raise ConfigError("dead-expert needs an MoE layer and top_k < n_experts", path="--inject")
            layer = next((i for i in moe_layers if i >= layer), moe_layers[0])
        return cls(kind=kind, layer=layer, start_step=max(1, steps // 3),  # type: ignore[arg-type]
                   expert=model.n_experts - 1)

    def lr_factor(self, layer: int | None, step: int) -> float:
        """Multiplier of the learning rate of ``layer``'s parameters at ``step``."""
        spiking = self.kind == "lr-spike" and layer == self.layer
        return self.factor if spiking and self.start_step <= step < self.start_step + self.duration else 1.0


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation settings. ``steps`` and ``batch_size`` are global (all ranks together)."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences per step in the GLOBAL batch (split over the data-parallel ranks)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 20
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norm weights)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment coefficients."""
    grad_clip: float | None = 1.0
    """Clip the global gradient L2 norm to this value; ``None`` disables clipping."""
    seed: int = 0
    """Seed of initialisation and of the batches."""
    inject: Injection | None = None
    """A failure to inject, or ``None``."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"got {self.steps}; need >= 1", path="--steps")
        if self.batch_size < 1:
            raise ConfigError(f"got {self.batch_size}; need >= 1", path="train.batch_size")
        if not self.lr > 0:
            raise ConfigError(f"got {self.lr}; need > 0", path="--lr")

    def lr_at(self, step: int) -> float:
        """Scheduled learning rate at ``step`` (1-based): linear warm-up, then cosine decay."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class StepMetrics(Protocol):
    """What the loop needs of a metrics object (``tmetrics_core.TensorMetrics`` fits)."""

    def step(self, step: int) -> AbstractContextManager[object]:
        """Scope of one training step: forward, backward, optimizer step and zero_grad."""
        ...

    def observe_gradients(self) -> None:
        """Read gradients now, before clipping (so gradient norms are the unclipped ones)."""
        ...

    def log(self, values: Mapping[str, float]) -> None:
        """The loop's own scalars (loss, learning rate) at the current step, beside the metrics."""
        ...

    def close(self) -> None:
        """Flush and release everything; called once after the last step."""
        ...


class MetricsFactory(Protocol):
    """Builds the metrics object once the model and optimizer exist (same call on every rank)."""

    def __call__(self, model: nn.Module, optimizer: Optimizer, mesh: DeviceMesh | None) -> StepMetrics:
        ...


class NullMetrics:
    """The metrics object of a run without metrics: every step scope does nothing."""

    def step(self, step: int) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def observe_gradients(self) -> None:
        return None

    def log(self, values: Mapping[str, float]) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: ``loss`` (global mean cross-entropy, nats per byte), the global
    gradient ``grad_norm`` before clipping, whether the update was ``skipped`` (non-finite
    gradients), and wall ``seconds``."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    seconds: float


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """One AdamW group per (layer, decayed or not); ``layer`` is None outside ``layers.*``."""
    groups: dict[tuple[int | None, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        groups.setdefault((layer, param.dim() >= 2 and not name.endswith("norm.weight")), []).append(param)
    return [{"params": params, "layer": layer, "weight_decay": weight_decay if decay else 0.0}
            for (layer, decay), params in groups.items()]


def _skip_update(optimizer: Optimizer, args: object, kwargs: object) -> None:
    """Optimizer step pre-hook: drop every gradient so AdamW leaves parameters and state alone."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


class Trainer:
    """Trains a :class:`ParallelModel` on a :class:`ByteCorpus` (same code on every rank).

    Args:
        parallel: this rank's model part and schedule.
        corpus: the text; every rank draws the same global batch per step.
        config: optimisation settings.
        metrics: builds the metrics object from ``(parallel.module, optimizer, parallel.mesh)``.
    """

    def __init__(self, parallel: ParallelModel, corpus: ByteCorpus, config: TrainConfig, *,
                 metrics: MetricsFactory | None = None) -> None:
        self.parallel = parallel
        self.corpus = corpus
        self.config = config
        self.optimizer = AdamW(_param_groups(parallel.model, config.weight_decay), lr=config.lr,
                               betas=config.betas)
        self.metrics: StepMetrics = (NullMetrics() if metrics is None
                                     else metrics(parallel.module, self.optimizer, parallel.mesh))
        self.is_logging_rank = not dist.is_initialized() or dist.get_rank() == 0

    def forward_backward(self, step: int) -> float:
        """Forward and backward on ``step``'s global batch; returns the global mean loss.

        Applies ``dead-expert`` before the forward and ``nan-grad`` after the backward.
        """
        inject = self.config.inject
        layers = self.parallel.model.layers
        if inject and inject.kind == "dead-expert" and step == inject.start_step and str(inject.layer) in layers:
            block = layers[str(inject.layer)]
            assert isinstance(block, Block)  # the layers of the demo model are Blocks
            block.moe.expert_bias[inject.expert] = _DEAD_BIAS
        batch = self.corpus.batch(step, batch_size=self.config.batch_size,
                                  seq_len=self.parallel.model.config.seq_len, seed=self.config.seed)
        loss = self.parallel.forward_backward(batch)
        if inject and inject.kind == "nan-grad" and step == inject.start_step and str(inject.layer) in layers:
            block = layers[str(inject.layer)]
            assert isinstance(block, Block)
            grad = block.attn.q.weight.grad
            assert grad is not None  # the backward just ran through this layer
            (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(float("nan"))
        return loss

    def update(self, step: int) -> tuple[float, bool]:
        """Clip, set the learning rates of ``step``, step the optimizer, zero the gradients.

        When the global gradient norm is not finite the update is skipped, as mixed-precision
        loss scalers do: a pre-hook registered just before ``optimizer.step()`` (so after every
        hook the metrics registered) drops the gradients, and AdamW leaves parameters and
        moments untouched. Returns ``(grad_norm, skipped)``.
        """
        self.metrics.observe_gradients()  # before clipping: gradient metrics are pre-clip, like the norm below
        norm = self.parallel.clip_grad_norm_(self.config.grad_clip)
        base = self.config.lr_at(step)
        for group in self.optimizer.param_groups:
            factor = self.config.inject.lr_factor(group["layer"], step) if self.config.inject else 1.0
            group["lr"] = base * factor
        skipped = not math.isfinite(norm)
        guard = self.optimizer.register_step_pre_hook(_skip_update) if skipped else None
        try:
            self.optimizer.step()
        finally:
            if guard is not None:
                guard.remove()
        self.optimizer.zero_grad()
        return norm, skipped

    def step(self, step: int) -> StepResult:
        """One training step inside the metrics object's step scope."""
        start = time.perf_counter()
        with self.metrics.step(step):
            loss = self.forward_backward(step)
            norm, skipped = self.update(step)
            self.metrics.log({"loss": loss, "lr": self.config.lr_at(step)})  # beside the layer metrics
        return StepResult(step, loss, norm, skipped, time.perf_counter() - start)

    def run(self, *, progress: bool = True) -> list[StepResult]:
        """All steps, with a progress bar (step, loss, tokens/s) on global rank 0; then closes
        the metrics object. Returns every step's result (identical on every rank)."""
        tokens = self.config.batch_size * self.parallel.model.config.seq_len
        results = []
        bar = tqdm(total=self.config.steps, disable=not (progress and self.is_logging_rank),
                   desc="demo", unit="step", dynamic_ncols=True)
        try:
            for step in range(1, self.config.steps + 1):
                result = self.step(step)
                results.append(result)
                bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{tokens / result.seconds:,.0f}",
                                skipped=sum(r.skipped for r in results), refresh=False)
                bar.update(1)
        finally:
            bar.close()
            self.metrics.close()
        return results
