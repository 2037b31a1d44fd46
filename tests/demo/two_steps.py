"""Two training steps of a tiny demo model under a topology: the record the invariance tests compare.

Module-level functions so spawned ranks can import them (``tests.distributed.harness``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tmetrics_core.demo.data import ByteCorpus, stdlib_files
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.demo.train import TrainConfig, Trainer

__all__ = ["EVEN", "UNEVEN", "TwoSteps", "run_topologies", "two_steps"]

EVEN: dict[str, Any] = dict(d_model=16, n_layers=2, n_heads=2, d_ff=12, n_experts=4, top_k=2,
                            dense_layers=(1,), seq_len=16)
"""Tiny model that splits evenly for tp 2 and ep 2; layer 1 is dense so both MLP forms are covered."""
UNEVEN: dict[str, Any] = dict(d_model=16, n_layers=2, n_heads=2, d_ff=9, n_experts=3, top_k=2,
                              dense_layers=(1,), seq_len=16)
"""FSDP shards cut unevenly: router [3, 16] and mlp.gate [9, 16] on 2 ranks (2+1, 5+4) and on 4
ranks (1+1+1+0, 3+3+3+0: empty local shards)."""


@dataclass(frozen=True, slots=True)
class TwoSteps:
    """Losses of steps 1 and 2, step 1's global grad norm, full gradients of step 1 (before
    clipping) and full parameters after step 1's update, by canonical name."""

    loss1: float
    loss2: float
    grad_norm: float
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def two_steps(topology: dict[str, Any], config: dict[str, Any]) -> TwoSteps:
    """Train 2 steps (lr 1e-2, no warm-up, clipping at 0.05 so it is active) on stdlib bytes."""
    model_config = ModelConfig(**config)
    train_config = TrainConfig(steps=2, batch_size=8, lr=1e-2, warmup_steps=0, grad_clip=0.05, seed=3)
    parallel = parallelize(model_config, ParallelDegrees(**topology), seed=train_config.seed,
                           batch_size=train_config.batch_size)
    corpus = ByteCorpus.from_files(stdlib_files()[:5], source="first five stdlib files")
    trainer = Trainer(parallel, corpus, train_config)
    loss1 = trainer.forward_backward(1)
    grads = {name: t.grad for name, t in parallel.full_state().items()}
    grad_norm, _ = trainer.update(1)
    params = {name: t.param for name, t in parallel.full_state().items()}
    loss2 = trainer.step(2).loss
    return TwoSteps(loss1, loss2, grad_norm, grads, params)


def run_topologies(rank: int, world_size: int, cases: list[tuple[str, dict[str, Any], dict[str, Any]]]
                   ) -> dict[str, TwoSteps]:
    """Every ``(case id, topology, model config)`` in turn on this rank; rank 0's records matter."""
    return {case: two_steps(topology, config) for case, topology, config in cases}
