from __future__ import annotations

import posixpath
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import (
    MLFLOW_RULES,
    PLAIN_RULES,
    TENSORBOARD_RULES,
    WANDB_RULES,
    KeyBook,
    KeyRules,
    check_collisions,
    index_widths,
)
from tmetrics_core.records import Histogram, Labels, MetricRecord

ALL_RULES = (PLAIN_RULES, TENSORBOARD_RULES, MLFLOW_RULES, WANDB_RULES)


def rec(metric: str, **labels: object) -> MetricRecord:
    return MetricRecord(metric=metric, step=1, value=1.0, labels=Labels(**labels))  # type: ignore[arg-type]


def render_key(record: MetricRecord, rules: KeyRules = PLAIN_RULES, **widths: int) -> str:
    """The key of one record alone, from a fresh book."""
    return KeyBook(rules, **widths).add(record.metric, record.labels)


# record -> (plain, tensorboard, mlflow, wandb)
TABLE = [
    (rec("global-grad-l2"), ("global-grad-l2",) * 4),
    (rec("layer-grad-l2", layer=3), ("layer-grad-l2/layer_03",) * 4),
    (rec("layer-expert-tokens", layer=3, expert=17), ("layer-expert-tokens/layer_03/expert_017",) * 4),
    (
        rec("layer-expert-load-imbalance", layer=3, stat="max_over_mean"),
        ("layer-expert-load-imbalance/layer_03/max_over_mean",) * 4,
    ),
    (rec("tensor-grad-l2", tensor="layers.3.attn.q.weight"), ("tensor-grad-l2/layers.3.attn.q.weight",) * 4),
    (
        rec("family-grad-l2", tensor="layers.*.attn.q.weight"),
        ("family-grad-l2/layers.*.attn.q.weight",) + ("family-grad-l2/layers._.attn.q.weight",) * 3,
    ),
    (
        rec("layer-grad-nonfinite", layer=11, stat="nan"),
        ("layer-grad-nonfinite/layer_11/nan",) * 4,
    ),
    # MLflow accepts ':' and ' ', the others do not.
    (
        rec("tensor-param-l2", tensor="odd name:x"),
        ("tensor-param-l2/odd_name_x",) * 2 + ("tensor-param-l2/odd name:x",) + ("tensor-param-l2/odd_name_x",),
    ),
    # A "/" inside a label never makes a false segment; "." and ".." segments are not path moves.
    (rec("tensor-param-l2", tensor="a/b"), ("tensor-param-l2/a_b",) * 4),
    (rec("tensor-param-l2", tensor=".."), ("tensor-param-l2/__",) * 4),
    (rec("tensor-param-l2", tensor=""), ("tensor-param-l2/_",) * 4),
    # All labels at once: metric, tensor, layer, expert, stat.
    (
        rec("m", tensor="t", layer=1, expert=2, stat="s"),
        ("m/t/layer_01/expert_002/s",) * 4,
    ),
]


@pytest.mark.parametrize("record, expected", TABLE, ids=[r.metric + str(r.labels) for r, _ in TABLE])
def test_render_table(record: MetricRecord, expected: tuple[str, str, str, str]) -> None:
    got = tuple(render_key(record, rules) for rules in ALL_RULES)
    assert got == expected


def test_value_kind_does_not_change_key() -> None:
    hist = Histogram(edges=(0.0, 1.0), counts=(3,))
    for value in (1.0, (1.0, 2.0), hist):
        r = MetricRecord(metric="layer-grad-histogram", step=5, value=value, labels=Labels(layer=7))
        assert render_key(r, TENSORBOARD_RULES) == "layer-grad-histogram/layer_07"


def test_widths() -> None:
    assert index_widths(0, 0) == (2, 3)
    assert index_widths(96, 64) == (2, 3)
    assert index_widths(100, 1000) == (2, 3)  # largest indices 99 and 999
    assert index_widths(101, 1001) == (3, 4)
    assert index_widths(12000, 1) == (5, 3)
    with pytest.raises(ValueError):
        index_widths(-1, 0)
    r = rec("layer-expert-tokens", layer=7, expert=5)
    assert render_key(r, PLAIN_RULES, layer_width=3, expert_width=4) == "layer-expert-tokens/layer_007/expert_0005"
    keys = [render_key(rec("m", layer=i), layer_width=index_widths(120, 0)[0]) for i in range(120)]
    assert keys == sorted(keys)


def test_negative_index_raises() -> None:
    with pytest.raises(ValueError, match="layer index"):
        render_key(rec("m", layer=-1))
    with pytest.raises(ValueError, match="expert index"):
        KeyBook().add("m", Labels(layer=0, expert=-3))


def test_long_key_is_cut_with_hash_and_stays_distinct() -> None:
    a = rec("tensor-grad-l2", tensor="x" * 1100 + ".a")
    b = rec("tensor-grad-l2", tensor="x" * 1100 + ".b")
    for rules in ALL_RULES:
        ka, kb = render_key(a, rules), render_key(b, rules)
        assert len(ka) == rules.max_len and len(kb) == rules.max_len
        assert ka != kb
        assert ka.startswith("tensor-grad-l2/xxxx")
        assert re.fullmatch(r".*-[0-9a-f]{8}", ka)
    book = KeyBook(MLFLOW_RULES)
    assert book.add(a.metric, a.labels) != book.add(b.metric, b.labels)


def test_keybook_collision_names_both_label_sets() -> None:
    book = KeyBook(TENSORBOARD_RULES)
    first = book.add("tensor-grad-l2", Labels(tensor="layers.*.attn.q.weight"))
    assert first == "tensor-grad-l2/layers._.attn.q.weight"
    assert book.add("tensor-grad-l2", Labels(tensor="layers.*.attn.q.weight")) == first  # same labels: fine
    with pytest.raises(ConfigError) as info:
        book.add("tensor-grad-l2", Labels(tensor="layers._.attn.q.weight"))
    message = str(info.value)
    assert "tensorboard" in message and repr(first) in message
    assert "tensor='layers.*.attn.q.weight'" in message
    assert "tensor='layers._.attn.q.weight'" in message
    assert info.value.path == "sinks.tensorboard"
    assert book.series(first) == ("tensor-grad-l2", Labels(tensor="layers.*.attn.q.weight"))
    assert len(book) == 1


def test_collisions_depend_on_the_backend() -> None:
    # PLAIN keeps '*', so "a*b" and "a_b" stay distinct there; MLflow keeps ' ' but not '@'.
    book = KeyBook(PLAIN_RULES)
    assert book.add("m", Labels(tensor="a*b")) != book.add("m", Labels(tensor="a_b"))
    book = KeyBook(MLFLOW_RULES)
    assert book.add("m", Labels(tensor="a b")) == "m/a b"
    book.add("m", Labels(tensor="a_b"))
    with pytest.raises(ConfigError, match="mlflow key 'm/a_b'"):
        book.add("m", Labels(tensor="a@b"))


def test_check_collisions_lists_every_collision() -> None:
    items = [
        ("m", Labels(tensor="a*b")),
        ("m", Labels(tensor="a_b")),
        ("m", Labels(tensor="c+d")),
        ("m", Labels(tensor="c=d")),
        ("m", Labels(layer=3)),
        ("m", Labels(layer=3)),  # the same label set twice is not a collision
    ]
    with pytest.raises(ConfigError) as info:
        check_collisions(items, WANDB_RULES)
    message = str(info.value)
    assert message.startswith("sinks.wandb: 2 key collision(s) for wandb")
    for fragment in ("tensor='a*b'", "tensor='a_b'", "tensor='c+d'", "tensor='c=d'"):
        assert fragment in message
    check_collisions(items[:2], PLAIN_RULES)  # '*' is kept in plain keys
    check_collisions([("m", Labels(layer=i)) for i in range(200)], MLFLOW_RULES, layer_width=3)


def test_rules_validation() -> None:
    with pytest.raises(ValueError):
        KeyRules("bad", r"[^/]", 100)
    with pytest.raises(ValueError):
        KeyRules("bad", r"-\w", 100)
    with pytest.raises(ValueError):
        KeyRules("bad", r"[a-z]", 100)  # no '_'
    with pytest.raises(ValueError):
        KeyRules("bad", r"[\w]", 10)


_labels = st.text(min_size=0, max_size=300)


@settings(max_examples=300, deadline=None)
@given(
    metric=st.text(min_size=0, max_size=60),
    tensor=st.one_of(st.none(), _labels),
    stat=st.one_of(st.none(), st.text(max_size=40)),
    layer=st.one_of(st.none(), st.integers(0, 10**6)),
    expert=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_every_key_is_legal_for_its_backend(
    metric: str, tensor: str | None, stat: str | None, layer: int | None, expert: int | None
) -> None:
    r = MetricRecord(metric=metric, step=0, value=0.0, labels=Labels(layer=layer, expert=expert, tensor=tensor, stat=stat))
    for rules in ALL_RULES:
        key = render_key(r, rules)
        assert len(key) <= rules.max_len
        assert re.fullmatch(rules.allowed + "+", key, flags=re.ASCII), (rules.name, key)
        assert not key.startswith("/") and "//" not in key and not key.endswith("/")
        if rules is not PLAIN_RULES:
            # MLflow's own path check: the key must be a normalized relative path.
            assert posixpath.normpath(key) == key and not key.startswith("..")
