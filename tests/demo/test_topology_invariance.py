"""Training is topology-invariant: same seed and global batch give the same losses (steps 1 and
2), the same global grad norm, and the same full gradients and parameters at step 1 (relative
1e-5 per tensor) on one process and on every supported topology (gloo, CPU)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tmetrics_core.demo.model import ModelConfig, Transformer
from tests.demo.two_steps import EVEN, UNEVEN, TwoSteps, run_topologies, two_steps
from tests.distributed.harness import run_distributed

CASES: dict[int, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {
    2: [
        ("dp2", {"dp": 2}, EVEN),
        ("fsdp2", {"dp": 2, "fsdp": True}, EVEN),
        ("fsdp2-uneven", {"dp": 2, "fsdp": True}, UNEVEN),
        ("tp2", {"tp": 2}, EVEN),
        ("ep2", {"ep": 2}, EVEN),
        ("pp2", {"pp": 2}, EVEN),
    ],
    4: [
        ("dp2xtp2", {"dp": 2, "tp": 2}, EVEN),
        ("fsdp4-uneven", {"dp": 4, "fsdp": True}, UNEVEN),
        ("hsdp2x2", {"dp_replicate": 2, "dp": 2, "fsdp": True}, EVEN),
        ("pp2xep2", {"pp": 2, "ep": 2}, EVEN),
        ("fsdp2xtp2", {"dp": 2, "tp": 2, "fsdp": True}, EVEN),
        ("pp2xfsdp2", {"pp": 2, "dp": 2, "fsdp": True}, EVEN),
        ("pp2xtp2", {"pp": 2, "tp": 2}, EVEN),
        ("pp2xdp2", {"pp": 2, "dp": 2}, EVEN),
    ],
}
CASE_IDS = [(world, case) for world, cases in CASES.items() for case, _, _ in cases]
CONFIG_OF = {case: config for cases in CASES.values() for case, _, config in cases}


@functools.cache
def _reference(config_key: str) -> TwoSteps:
    torch.set_num_threads(1)
    return two_steps({}, {"EVEN": EVEN, "UNEVEN": UNEVEN}[config_key])


@functools.cache
def _distributed(world: int) -> dict[str, TwoSteps]:
    return run_distributed(run_topologies, world, CASES[world], timeout=240)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "case"), CASE_IDS, ids=[case for _, case in CASE_IDS])
def test_matches_single_process(world: int, case: str) -> None:
    ref = _reference("EVEN" if CONFIG_OF[case] is EVEN else "UNEVEN")
    got = _distributed(world)[case]
    assert got.loss1 == pytest.approx(ref.loss1, rel=1e-5)
    assert got.loss2 == pytest.approx(ref.loss2, rel=1e-5)
    assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    assert got.grads.keys() == ref.grads.keys() == got.params.keys()
    for name, grad in ref.grads.items():
        assert got.grads[name].shape == grad.shape, name
        assert _rel(got.grads[name], grad) < 1e-5, name
        assert _rel(got.params[name], ref.params[name]) < 1e-5, name


def test_reference_is_a_real_step() -> None:
    """The compared quantities are not trivial: clipping is active and the update moves every tensor."""
    ref = _reference("EVEN")
    initial = dict(Transformer(ModelConfig(**EVEN), seed=3).named_parameters())
    assert ref.grad_norm > 0.05  # so clipping at 0.05 scaled the gradients
    assert ref.loss2 < ref.loss1
    for name, grad in ref.grads.items():
        assert grad.abs().sum() > 0, name
        assert not torch.equal(ref.params[name], initial[name].detach()), name
