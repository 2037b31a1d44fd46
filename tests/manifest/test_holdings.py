"""Holdings: rows merged across ranks (lowest rank kept per distinct row), coordinates united."""

from tmetrics_core.manifest.holdings import Holdings


def _row(name, shape=(4,), dtype="float32"):
    return (name, name, 0, None, "attn.q", "attn", shape, dtype, (), ())


def test_merge_keeps_each_distinct_row_with_its_lowest_rank_and_unites_coordinates():
    a = Holdings.local([_row("w"), _row("v")], {"pp": 0, "dp": 1}, rank=3, stacked=0)
    b = Holdings.local([_row("w", shape=(2,))], {"pp": 1, "dp": 0}, rank=1, stacked=8)
    c = Holdings.local([_row("w")], {"pp": 1, "dp": 1}, rank=2, stacked=0)
    union = Holdings()
    for h in (a, b, c):
        union.merge(h)
    assert union.rows["w"] == {_row("w"): 2, _row("w", shape=(2,)): 1}
    assert union.held["w"] == {"pp": {0, 1}, "dp": {0, 1}} and union.held["v"] == {"pp": {0}, "dp": {1}}
    assert union.stacked == 8
    assert a.rows["w"] == {_row("w"): 3}  # merging never changes what was merged in


def test_fingerprint_ignores_ranks_and_coordinates_but_not_rows():
    here = Holdings.local([_row("w")], {"dp": 0}, rank=0, stacked=0)
    there = Holdings.local([_row("w")], {"dp": 1}, rank=5, stacked=0)
    cast = Holdings.local([_row("w", dtype="bfloat16")], {"dp": 1}, rank=5, stacked=0)
    assert here.fingerprint() == there.fingerprint() != cast.fingerprint()
    assert 0 <= here.fingerprint() < 2 ** 56


def test_spread_marks_every_coordinate_of_an_axis():
    h = Holdings.local([_row("w")], {"dp": 1, "tp": 0}, rank=1, stacked=0)
    h.spread("dp", 4)
    assert h.held["w"] == {"dp": {0, 1, 2, 3}, "tp": {0}}
