"""Cotangent metrics on one rank vs float64 autograd over the same global batch: gradient
accumulation over 4 micro-batches, a GradScaler at 2^16, both activation-checkpointing
flavours, torch's checkpoint_wrapper and selective checkpointing; each micro-batch's cotangent
observed once per site, and the forward's residual L2 once per micro-batch under recomputation."""
from __future__ import annotations

import pytest
import torch

from tests.backward_model import BATCH, L, METRICS, Net, assert_close, batch, expected, loss_of, observed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.tokens import TokenObserver
from tmetrics_core.tensor_metrics import TensorMetrics


def _metrics(tm_kwargs=None, ckpt=None, micro=4, scaler=None, count=None):
    model = Net(ckpt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tm = TensorMetrics(model, metrics=[(build_metric(n, modules=["layers.*.mlp"] if "activation" in n else None), 1)
                                       for n in METRICS], optimizer=optimizer, grad_scaler=scaler, **(tm_kwargs or {}))
    tokens, targets = batch(1)
    with tm.step(1):
        for k in range(micro):
            rows = slice(k * BATCH // micro, (k + 1) * BATCH // micro)
            loss = loss_of(model(tokens[rows]), targets[rows]) / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return observed(tm.last_records)


@pytest.fixture
def counted(monkeypatch):
    """Cotangent observations by kind."""
    calls: dict[str, int] = {}
    original = TokenObserver.cotangent

    def spy(self, module, name, grad, *, kind, shard_dim):
        calls[kind] = calls.get(kind, 0) + 1
        return original(self, module, name, grad, kind=kind, shard_dim=shard_dim)
    monkeypatch.setattr(TokenObserver, "cotangent", spy)
    return calls


@pytest.mark.parametrize("ckpt", [None, "reentrant", "non-reentrant", "wrapper", "selective"])
def test_accumulation_and_checkpointing_match_float64(ckpt, counted):
    assert_close(_metrics(ckpt=ckpt), expected(1))
    # micro-batches x sites: L block outputs, L block inputs, L mlp outputs, 1 head output
    assert counted == {"residual_grad": 4 * L, "residual_input_grad": 4 * L, "activation_grad": 4 * L,
                       "logits_grad": 4}


def test_grad_scaler_divides_the_loss_scale(counted):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    assert_close(_metrics(micro=2, scaler=scaler), expected(1))
    assert counted["residual_grad"] == 2 * L


def test_divisor_counts_each_data_parallel_rank_once():
    """D is the product of the population axes' sizes, less an axis inside another (torchtitan's
    ep inside fsdp); tp and pp do not average gradients."""
    from tmetrics_core.sources.cotangents import CotangentScale, data_parallel_divisor
    from tmetrics_core.topology import Axis, Topology

    axes = [Axis("pp", 2, 0, None, (0, 8)), Axis("fsdp", 4, 0, None, (0, 1, 2, 3)), Axis("ep", 2, 0, None, (0, 1)),
            Axis("tp", 2, 0, None, (0, 4))]
    assert data_parallel_divisor(Topology(axes, global_rank=0, world_size=16)) == 4
    scale = CotangentScale(4, lambda: torch.tensor(2.0 ** 16))
    assert scale.factor(torch.zeros(1)).item() == 2.0 ** -18
    assert CotangentScale(1, None).factor(torch.zeros(1)) is None
