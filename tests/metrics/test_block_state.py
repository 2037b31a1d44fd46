"""Block states: a statistic metric prepared from rows keeps one matrix per statistic, reads as
the per-site mapping, and batches take its rows."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.topology import Topology
from tmetrics_core.metrics.batches import _Cut
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.site import Site


def _sites(n: int) -> list[Site]:
    return [Site(name=f"layers.{i % 2}.w{i}", kind="grad", logical_shape=(3, 5), dtype="float32", placements=(),
                 layer=i % 2) for i in range(n)]


def test_a_block_state_reads_as_per_site_vectors_of_float64_references() -> None:
    topology = Topology.single_process()
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5) for _ in range(4)]
    sites = _sites(4)
    block = build_metric("layer-grad-l2").prepare(sites, tensors, topology, {})
    assert isinstance(block, BlockState) and list(block) == [s.key for s in sites] and len(block) == 4
    for key, t in zip(block, tensors):
        (sumsq,) = block[key]
        assert sumsq.item() == pytest.approx(t.double().pow(2).sum().item(), rel=1e-12)
    assert dict(block).keys() == set(block.site_keys)


def test_placeholders_keep_per_site_vectors() -> None:
    topology = Topology.single_process()
    sites = _sites(2)
    tensors = [torch.randn(3, 5), None]
    assert not isinstance(build_metric("layer-grad-l2").prepare(sites, tensors, topology, {}), BlockState)


def test_a_cut_takes_its_members_rows_of_a_block_matrix() -> None:
    matrix = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    whole = _Cut(0, (), list(range(6)), (), (), None)
    assert whole.rows_of(matrix) is matrix
    part = _Cut(0, (), [1, 4, 5], (), (), None)
    torch.testing.assert_close(part.rows_of(matrix), matrix[[1, 4, 5]])
    torch.testing.assert_close(part.rows_of(matrix), matrix[[1, 4, 5]])  # the index tensor is kept


def test_membership_and_the_token_plan_keep_a_block_state_whole() -> None:
    """``key in state`` makes no per-site vector, and a token metric's block state in plan
    order goes to the executor as it is; out of order or incomplete, as per-site vectors in plan
    order (values the same either way)."""
    from tmetrics_core.sources.token_plan import TokenPlan

    topology = Topology.single_process()
    metric = build_metric("layer-residual-accumulator-rms")
    sites = [Site(name=f"layers.{i}", kind="residual_accumulator", logical_shape=(-1, 4), layer=i) for i in range(3)]
    tensors = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    block = metric.prepare(sites, tensors, topology, {})
    assert isinstance(block, BlockState)
    assert sites[1].key in block and ("layers.9", "residual_accumulator") not in block
    assert block._index is not None  # membership built the position table, not vectors

    class Seen:  # the attributes of a TokenObserver that state_for reads (the real one: test_deferred_observation)
        errors: dict = {}
        states = {metric.name: block}

    plan = TokenPlan(topology)
    plan.sites = {s.key: s for s in sites}
    kept, error = plan.state_for(metric, Seen())  # type: ignore[arg-type]
    assert error is None and kept is block
    reversed_block = BlockState(block.site_keys[::-1], [m.flip(0) for m in block.matrices])
    Seen.states = {metric.name: reversed_block}
    rebuilt, _ = plan.state_for(metric, Seen())  # type: ignore[arg-type]
    assert not isinstance(rebuilt, BlockState) and list(rebuilt) == [s.key for s in sites]
    for key in rebuilt:
        assert all(torch.equal(a, b) for a, b in zip(rebuilt[key], block[key]))
