"""torchtitan 0.3.0 parallelized by its own functions on gloo (CPU shims in titan_run.py), measured
with no topology, placements or offsets written here (``from_config(..., mesh=parallel_dims)``):
global-grad-l2 equals the float64 norm of the full gradients (rel 1e-6) and torchtitan's
``clip_grad_norm_`` (rel 2e-4: torch accumulates that norm in float32, 6.6e-5 off the float64
value here even in one process); layer grad and param L2 and tensor grad L2 equal the
one-process run (rel 1e-4 across runs)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed
from tests.integrations.torchtitan import titan_run


def _rank(rank, world, cases):
    out = {}
    for name, degrees in cases:
        model, dims, _ = titan_run.build("llama3", world, **degrees)
        out[name] = titan_run.train(model, dims, config_dir=f"/tmp/tmetrics-titan-{name}-{rank}")
    return out


@pytest.fixture(scope="module")
def one_process():
    model, dims, _ = titan_run.build("llama3", 1)
    return titan_run.train(model, dims, config_dir="/tmp/tmetrics-titan-one")


def _check(run, reference):
    for step, want in zip(run["steps"], reference["steps"]):
        assert not step["failures"], step["failures"]
        got = step["records"]
        key = ("global-grad-l2", None, None, None, None)
        assert got[key] == pytest.approx(step["exact"], rel=1e-6)
        assert got[key] == pytest.approx(step["norm"], rel=2e-4)
        assert set(got) == set(want["records"])
        for k, value in want["records"].items():
            assert got[k] == pytest.approx(value, rel=1e-4), k


def test_one_process(one_process):
    for step in one_process["steps"]:
        got = step["records"][("global-grad-l2", None, None, None, None)]
        assert got == pytest.approx(step["exact"], rel=1e-6) and got == pytest.approx(step["norm"], rel=2e-4)


def test_fsdp2_and_tp_on_two_ranks(one_process):
    cases = [("fsdp", {"dp_shard": 2}), ("tp", {"tp": 2})]
    for result in run_distributed(_rank, 2, cases, timeout=400):
        _check(result["fsdp"], one_process)
        _check(result["tp"], one_process)


def test_fsdp2_over_tp_on_2x2(one_process):
    for result in run_distributed(_rank, 4, [("fsdp-tp", {"dp_shard": 2, "tp": 2})], timeout=500):
        assert any("_StridedShard" in p for p in result["fsdp-tp"]["placements"])
        _check(result["fsdp-tp"], one_process)
