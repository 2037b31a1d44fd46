"""Attention metrics on 2 real gloo ranks equal the single-process [layers x heads] table: heads
split over tp (each rank its share of query and key heads), the batch split over dp, and keys
split over cp with every rank holding the same queries (merged by MAX of the per-query maxima,
then SUM of the rescaled parts). One spawn runs the four topologies."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import tmetrics_core as tm
from tests.attention_model import WIDTH, AttentionModel, attention_metrics, shard_heads, table
from tests.distributed.harness import run_distributed
from tmetrics_core.topology import Topology

B, T = 4, 10


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, 7:] = False
    return torch.randn(B, T, WIDTH, generator=g) * 3, mask


def _run(model: AttentionModel, x: torch.Tensor, spec: tm.AttentionSpec, topology: Topology) -> tuple[dict, int]:
    metrics = attention_metrics(model, topology=topology)
    with metrics.step(1):
        model(x, spec)
    out = table(metrics.last_records), metrics.executor.stats.rounds
    metrics.close()
    return out


def _scenarios(rank: int, world: int) -> dict[str, tuple[dict, int]]:
    torch.manual_seed(0)
    full = AttentionModel()
    x, mask = _inputs()
    spec = tm.AttentionSpec(causal=True, token_mask=mask)
    out = {"single": _run(full, x, spec, Topology.single_process())}
    world_group = dist.group.WORLD

    part = AttentionModel(heads=2, kv_heads=1, head_split=True)
    shard_heads(full, part, rank, world)
    out["tp"] = _run(part, x, spec, Topology.from_groups({"tp": world_group}))

    rows = slice(rank * B // world, (rank + 1) * B // world)
    out["dp"] = _run(full, x[rows], tm.AttentionSpec(causal=True, token_mask=mask[rows]),
                     Topology.from_groups({"dp": world_group}))

    lo, hi = rank * T // world, (rank + 1) * T // world
    keys = AttentionModel(key_range=(lo, hi))
    keys.load_state_dict(full.state_dict())
    split = tm.AttentionSpec(causal=True, token_mask=mask, k_positions=torch.arange(lo, hi), key_split="cp")
    out["cp"] = _run(keys, x, split, Topology.from_groups({"cp": world_group}))
    return out


def _same_table(got: dict, want: dict, name: str) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key[0] == "layer-attn-logit-max":
            assert got[key] == value, (name, key)  # exact
        elif isinstance(value, tuple):
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
        else:
            assert got[key] == pytest.approx(value, rel=1e-9), (name, key)


def test_tp_dp_and_key_split_equal_the_single_process_table():
    results = run_distributed(_scenarios, 2, timeout=180)
    single, _ = results[0]["single"]
    assert len(single) == 3 * (2 + 3 * 4) and all(math.isfinite(v) for k, v in single.items() if k[2] != "heads")
    for rank, result in enumerate(results):
        for name in ("tp", "dp", "cp"):
            got, rounds = result[name]
            _same_table(got, single, name)  # every rank holds the whole table (what a QK-clip reads)
            # one round of packed requests (tp, dp); MAX, SUM, then SUM for a key split
            assert rounds == (3 if name == "cp" else 1), (name, rounds)
