"""StridedShard is a sibling of Shard, not a kind of it: no predicate that selects plain
``torch.chunk`` pieces takes it, the local shape follows its interleaved runs, and the metrics
that need plain chunks (a class split of router logits, of softmax rows) refuse it by name."""

from __future__ import annotations

import pytest

from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.router import check_router_rows
from tmetrics_core.metrics.softmax import RowSoftmax
from tmetrics_core.placements import Shard, StridedShard, parse_placement
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology


def test_strided_shard_is_no_shard_but_splits_its_dim() -> None:
    strided = StridedShard(0, split_factor=2)
    assert not isinstance(strided, Shard)
    assert not strided.is_shard() and not strided.is_shard(0) and strided.is_strided_shard()
    assert strided.shard_dim() == 0 and strided.splits()
    assert Shard(1).shard_dim() == 1 and Shard(None).shard_dim() is None and not Shard(1).is_strided_shard()
    assert strided != Shard(0) and parse_placement(str(strided)) == strided
    with pytest.raises(PlacementError):
        StridedShard(True)  # type: ignore[arg-type]


def test_local_shape_follows_the_interleaved_runs() -> None:
    # 10 rows, FSDP (2 ranks, split_factor 2) over TP (Shard(0), 2 ranks): torch.chunk pieces of 5
    # rows per TP rank, each cut 3 + 2 by FSDP.
    site = Site("w", "param", (10, 4), placements=(("fsdp", StridedShard(0, split_factor=2)), ("tp", Shard(0))))
    sizes = {"fsdp": 2, "tp": 2}
    shapes = {(f, t): site.local_shape({"fsdp": f, "tp": t}, sizes) for f in range(2) for t in range(2)}
    assert shapes == {(0, 0): (3, 4), (0, 1): (3, 4), (1, 0): (2, 4), (1, 1): (2, 4)}
    assert StridedShard(0, split_factor=2).runs(10, 2, 1) == ((3, 2), (8, 2))


def test_class_splits_must_be_plain_shards() -> None:
    strided = (("ep", StridedShard(1, split_factor=2)),)
    logits = Site("layers.0.moe.router", "router_logits", (-1, 8), placements=strided, layer=0, num_experts=8)
    with pytest.raises(PlacementError, match="split by expert"):
        check_router_rows(logits, "router-entropy", allow_class_split=True)
    check_router_rows(Site("layers.0.moe.router", "router_logits", (-1, 8), placements=(("ep", Shard(1)),), layer=0,
                     num_experts=8), "router-entropy", allow_class_split=True)
    rows = Site("layers.0.attn.probs", "activation", (-1, 8), placements=strided)
    with pytest.raises(PlacementError, match="interleaves the classes"):
        RowSoftmax().check(rows, Topology.single_process())
