"""Sources under real sharding (gloo): a small transformer trained one step under DDP, FSDP2
(even, uneven, 4 ranks), DTensor TP, DP x TP, HSDP, EP (MoE) and pipeline ownership gives the
same per-layer parameter and gradient norms as one process, and global-grad-l2 equals
torch.nn.utils.clip_grad_norm_ of the unsharded model."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.sharded_step import TINY, UNEVEN, one_step
from tmetrics_core.demo.model import ModelConfig, Transformer

CASES = {
    2: [("dp2", {"dp": 2}, TINY), ("fsdp2", {"dp": 2, "fsdp": True}, TINY),
        ("fsdp2-uneven", {"dp": 2, "fsdp": True}, UNEVEN), ("tp2", {"tp": 2}, TINY),
        ("ep2", {"ep": 2}, TINY), ("pp2", {"pp": 2}, TINY)],
    4: [("fsdp4-uneven", {"dp": 4, "fsdp": True}, UNEVEN), ("dp2xtp2", {"dp": 2, "tp": 2}, TINY),
        ("hsdp2x2", {"dp_replicate": 2, "dp": 2, "fsdp": True}, TINY), ("pp2xep2", {"pp": 2, "ep": 2}, TINY)],
}
IDS = [(w, name) for w, cases in CASES.items() for name, _, _ in cases]
CONFIG = {name: cfg for cases in CASES.values() for name, _, cfg in cases}


@functools.cache
def _single(config_name: str):
    return one_step({}, TINY if config_name == "TINY" else UNEVEN)


@functools.cache
def _ranks(world: int):
    return run_distributed(__import__("tests.distributed.sharded_step", fromlist=["run_cases"]).run_cases,
                           world, CASES[world], timeout=280)


def _torch_reference(config):
    """Gradients of the unsharded model on the same batch, with torch's clip_grad_norm_."""
    torch.manual_seed(0)
    from tests.distributed.sharded_step import BATCH
    batch = torch.randint(0, 256, (BATCH, config["seq_len"] + 1), generator=torch.Generator().manual_seed(11))
    model = Transformer(ModelConfig(**config), seed=3)
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), batch[:, 1:].reshape(-1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    layers = {}
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            layers.setdefault(layer, [0.0, 0.0])
            layers[layer][0] += p.detach().double().pow(2).sum().item()
            layers[layer][1] += p.grad.double().pow(2).sum().item()
    return norm, {k: (math.sqrt(a), math.sqrt(b)) for k, (a, b) in layers.items()}


@pytest.mark.parametrize("config_name", ["TINY", "UNEVEN"])
def test_single_process_equals_torch(config_name):
    config = TINY if config_name == "TINY" else UNEVEN
    got = _single(config_name)["records"]
    norm, layers = _torch_reference(config)
    assert got[("global-grad-l2", None, None, None)] == pytest.approx(norm, rel=1e-5)
    for layer, (param_l2, grad_l2) in layers.items():
        assert got[("layer-param-l2", layer, None, None)] == pytest.approx(param_l2, rel=1e-5)
        assert got[("layer-grad-l2", layer, None, None)] == pytest.approx(grad_l2, rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "case"), IDS, ids=[c for _, c in IDS])
def test_sharded_equals_single_process(world, case):
    ref = _single("TINY" if CONFIG[case] is TINY else "UNEVEN")["records"]
    norm, _ = _torch_reference(CONFIG[case])
    for rank, result in enumerate(_ranks(world)):
        got = result[case]
        assert got["failures"] == []
        assert got["records"][("global-grad-l2", None, None, None)] == pytest.approx(norm, rel=1e-5)
        assert got["records"][("global-grad-l2", None, None, None)] == pytest.approx(got["torch_norm"], rel=1e-5)
        assert set(got["records"]) == set(ref), (rank, set(got["records"]) ^ set(ref))
        for key, value in ref.items():
            assert got["records"][key] == pytest.approx(value, rel=1e-5), (rank, key)
