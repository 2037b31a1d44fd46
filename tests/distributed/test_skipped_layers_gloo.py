"""A layer that runs on no rank in a step (LayerDrop, an early exit) gives no record that step,
not the placeholders' 0 (a plausible wrong norm); one that runs on some ranks only is measured
over their tokens. One process and 2 gloo ranks, against float64 references."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.harness import run_distributed

D = 5
NAMES = ("layer-residual-accumulator-l2", "layer-residual-contribution-l2", "layer-residual-accumulator-rms")
SKIPS = {1: {}, 2: {0: (1,), 1: (1,)}, 3: {1: (2,)}, 4: {0: (0, 2), 1: (0, 2)}}
"""Per step, per rank: the layers that rank does not run (absent: none)."""


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(10 * step + rank))


def _rank(rank: int, world: int) -> list[dict]:
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    model = Net(3)
    layers = model.layers
    topology = None
    if world > 1:
        import torch.distributed as dist
        topology = Topology.from_groups({"dp": dist.group.WORLD})
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in NAMES], topology=topology, timeout_s=30)
    out = []
    for step, skips in SKIPS.items():
        skipped = skips.get(rank, ())
        h = _tokens(step, rank)
        with metrics.step(step):
            for i, block in enumerate(layers):
                if i not in skipped:
                    h = block(h)
        out.append({(r.metric, r.layer): r.value for r in metrics.last_records})
    metrics.close()
    assert metrics.failures == []
    return out


def _reference(world: int) -> list[dict]:
    """float64 sums over the blocks each rank ran."""
    from tests.sources.test_token_row_buffer import Net

    layers = Net(3).layers
    out = []
    for step, skips in SKIPS.items():
        sums: dict[tuple[str, int], float] = {}
        counts: dict[int, int] = {}
        for rank in range(world):
            h = _tokens(step, rank)
            for i, block in enumerate(layers):
                if i in skips.get(rank, ()):
                    continue
                with torch.no_grad():
                    x, h = h, block(h)
                sums[("acc", i)] = sums.get(("acc", i), 0.0) + float(h.double().pow(2).sum())
                sums[("part", i)] = sums.get(("part", i), 0.0) + float((h.double() - x.double()).pow(2).sum())
                counts[i] = counts.get(i, 0) + h.numel()
        values = {}
        for i, n in counts.items():
            values[("layer-residual-accumulator-l2", i)] = math.sqrt(sums[("acc", i)])
            values[("layer-residual-contribution-l2", i)] = math.sqrt(sums[("part", i)])
            values[("layer-residual-accumulator-rms", i)] = math.sqrt(sums[("acc", i)] / n)
        out.append(values)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_layer_no_rank_ran_gives_no_record(world):
    ranks = [_rank(0, 1)] if world == 1 else run_distributed(_rank, 2, timeout=150)
    reference = _reference(world)
    for got in ranks:
        for step, (records, want) in enumerate(zip(got, reference), start=1):
            assert records.keys() == want.keys(), (step, sorted(records), sorted(want))
            for key, value in want.items():
                assert records[key] == pytest.approx(value, rel=1e-5), (step, key)
    if world == 2:  # step 3: layer 2 ran on rank 0 only and is measured over its tokens
        assert ("layer-residual-accumulator-l2", 2) in ranks[0][2]
    assert ("layer-residual-accumulator-l2", 1) not in ranks[0][1]  # step 2: layer 1 ran nowhere
