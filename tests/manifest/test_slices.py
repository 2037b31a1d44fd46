"""Expert slices of stacked tensors on one rank (`tmetrics_core.manifest.slices.place_slice`): the
placement of each slice under DTensor sharding, and the view that reads it from the local shard,
checked against slicing the full tensor and cutting it as ``torch.chunk`` does."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tmetrics_core.errors import PlacementError
from tmetrics_core.manifest.slices import place_slice
from tmetrics_core.placements import Owned, Replica
from tmetrics_core.placements import Shard as TShard

FULL = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(3, 8, 5)  # [E, 2I, H], I = 4


def _place(region, axes, coords, sizes, *, squeeze=0, transposed=False):
    return place_slice("s", "stored", region, squeeze, transposed, FULL.shape, axes, coords, sizes)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_dim_sharded_uneven_each_expert_owned_by_the_rank_whose_chunk_holds_it(world: int) -> None:
    chunks = torch.chunk(FULL, world, dim=0)  # 3 experts: 2+1 on 2 ranks, 1+1+1+0 on 4
    starts = [sum(c.shape[0] for c in chunks[:r]) for r in range(world)]
    for e in range(3):
        owner = max(r for r in range(world) if starts[r] <= e and chunks[r].shape[0])
        for rank in range(world):
            placements, view = _place(((0, e, e + 1), (1, 4, 8)), (("ep", Shard(0)),), {"ep": rank}, {"ep": world})
            assert placements == (("ep", Owned(owner)),)
            if rank != owner:
                assert view is None
                continue
            assert torch.equal(view(chunks[rank]), FULL[e, 4:8])
            assert view(chunks[rank]).data_ptr() == chunks[rank][e - starts[rank], 4:].data_ptr()  # a view


def test_fused_part_dim_sharded_on_piece_boundaries_is_owned_and_other_dims_stay_sharded() -> None:
    # tp shards dim 1 (gate rows 0..3 on tp rank 0, up rows 4..7 on tp rank 1), dp shards dim 2 (spanned)
    axes = (("tp", Shard(1)), ("dp", Shard(2)))
    for tp in range(2):
        for dp in range(2):
            local = torch.chunk(torch.chunk(FULL, 2, dim=1)[tp], 2, dim=2)[dp]
            placements, view = _place(((0, 1, 2), (1, 4, 8)), axes, {"tp": tp, "dp": dp}, {"tp": 2, "dp": 2})
            assert placements == (("tp", Owned(1)), ("dp", TShard(1)))
            assert (view is None) == (tp != 1)
            if view is not None:
                assert torch.equal(view(local), torch.chunk(FULL[1, 4:8], 2, dim=1)[dp])


def test_transposed_slice_reports_the_shard_on_its_logical_dim() -> None:
    placements, view = _place(((0, 2, 3),), (("tp", Shard(2)), ("dp", Replicate())), {"tp": 0, "dp": 0},
                              {"tp": 2, "dp": 2}, transposed=True)
    assert placements == (("tp", TShard(0)), ("dp", Replica()))  # stored [E, 8, 5] dim 2 -> slice [5, 8] dim 0
    assert torch.equal(view(torch.chunk(FULL, 2, dim=2)[0]), torch.chunk(FULL[2].T, 2, dim=0)[0])


def test_a_slice_cut_by_a_piece_boundary_is_a_placement_error_naming_axis_and_rows() -> None:
    with pytest.raises(PlacementError, match=r"rows \[0, 4\) of dim 1 .* axis 'tp'"):
        _place(((0, 0, 1), (1, 0, 4)), (("tp", Shard(1)),), {"tp": 0}, {"tp": 3})  # pieces of 3 rows


def test_interleaved_sharding_of_the_expert_dim_is_refused() -> None:
    with pytest.raises(PlacementError, match="interleaves"):
        _place(((0, 0, 1),), (("dp", _StridedShard(0, split_factor=2)),), {"dp": 0}, {"dp": 2})


def test_an_axis_of_one_rank_holds_the_whole_piece_whatever_its_placement() -> None:
    # torchtitan's expert mesh (efsdp, ep) with efsdp of size 1: fully_shard gives the experts
    # _StridedShard(0, sf=ep) there, which on one rank is the identity.
    axes = (("efsdp", _StridedShard(0, split_factor=2)), ("ep", Shard(0)))
    for ep in range(2):
        local = torch.chunk(FULL[:2], 2, dim=0)[ep]  # 2 experts, one per ep rank
        region = ((0, ep, ep + 1),)
        placements, view = place_slice("s", "stored", region, 0, False, (2, 8, 5), axes, {"efsdp": 0, "ep": ep},
                                       {"efsdp": 1, "ep": 2})
        assert placements == (("efsdp", Replica()), ("ep", Owned(ep)))
        assert torch.equal(view(local), FULL[ep])


def test_grouped_qkv_views_are_shard_of_whole_groups_and_refuse_a_cut_group() -> None:
    # A fused wqkv of 3 key/value heads, each group 2 q rows + 1 k + 1 v = 4 rows: [12, 5].
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    groups = full.reshape(3, 4, 5)
    axes = (("tp", Shard(0)),)
    # 3 groups over 3 TP ranks: one whole group each, so q is Shard(0) of [3, 2, 5].
    for rank in range(3):
        local = torch.chunk(full, 3, dim=0)[rank]
        placements, view = place_slice("q", "wqkv", ((1, 0, 2),), None, False, (12, 5), axes, {"tp": rank},
                                       {"tp": 3}, (0, 4))
        assert placements == (("tp", TShard(0)),)
        assert torch.equal(view(local), groups[rank:rank + 1, 0:2])
    # Over 2 ranks torch.chunk gives rows 0-5 and 6-11: group 1 (rows 4-7) is cut.
    with pytest.raises(PlacementError, match="cut its groups of 4 rows"):
        place_slice("k", "wqkv", ((1, 2, 3),), None, False, (12, 5), axes, {"tp": 0}, {"tp": 2}, (0, 4))
