"""Alert rules on synthetic record streams: warm-up, de-duplication, recovery, NaN, first to trip."""

from __future__ import annotations

import math

import pytest

from tmetrics_core.alerts import Alert, AlertEngine
from tmetrics_core.config.alerts import AlertsConfig, parse_alerts
from tmetrics_core.config.schema import load_config
from tmetrics_core.errors import ConfigError
from tmetrics_core.records import Labels, MetricRecord


def R(metric: str, step: int, value, **labels) -> MetricRecord:
    return MetricRecord(metric, step, value, Labels(**labels))


def engine(*rules: dict, **options) -> AlertEngine:
    return AlertEngine(parse_alerts({"rules": list(rules), "gradient_nonfinite": False, **options}))


def feed(eng: AlertEngine, values: list[float], metric: str = "m", **labels) -> dict[int, list[Alert]]:
    out = {}
    for step, v in enumerate(values, start=1):
        alerts = eng.observe([R(metric, step, v, **labels)], step)
        if alerts:
            out[step] = alerts
    return out


def test_spike_waits_for_warmup_then_trips_once_and_closes_at_baseline():
    eng = engine({"kind": "spike", "metric": "m", "factor": 10, "window": 4, "warmup": 3})
    # step 2 is 100x step 1 but inside the warm-up; step 6 trips; 7 is still high (no new
    # alert: one open alert per series); 8 is back under halfway (median 1 -> bound 10 -> 5.5).
    got = feed(eng, [1.0, 100.0, 1.0, 1.0, 1.0, 50.0, 60.0, 5.0, 1.0])
    assert list(got) == [6, 8]
    opened, closed = got[6][0], got[8][0]
    assert (opened.state, opened.value, opened.baseline, opened.jump, opened.rule) == \
        ("open", 50.0, 1.0, 50.0, "m-spike")
    # the window at step 8 is [1, 1, 50, 60]: median 25.5 -> bound 255, halfway 140.25
    assert (closed.state, closed.value, closed.baseline, closed.opened) == ("closed", 5.0, 25.5, 6)


def test_spike_zscore_uses_median_absolute_deviation():
    eng = engine({"kind": "spike", "metric": "m", "factor": None, "zscore": 5, "window": 5, "warmup": 5})
    # window [1, 2, 3, 4, 5]: median 3, MAD 1 -> sigma 1.4826; bound 3 + 5 * 1.4826 = 10.413
    got = feed(eng, [1, 2, 3, 4, 5, 10.4])
    assert got == {}
    got = feed(engine({"kind": "spike", "metric": "m", "factor": None, "zscore": 5, "window": 5, "warmup": 5}),
               [1, 2, 3, 4, 5, 10.5])
    assert got[6][0].baseline == 3.0


def test_spike_ema_baseline_and_floor():
    eng = engine({"kind": "spike", "metric": "m", "baseline": "ema", "factor": 2, "window": 3, "warmup": 1,
                  "floor": 0.5})
    # alpha 0.5: ema after [1] is 1 -> 2.1 trips (bound 2); ema then 1.55
    got = feed(eng, [1.0, 2.1])
    assert got[2][0].baseline == 1.0
    quiet = engine({"kind": "spike", "metric": "m", "factor": 2, "window": 3, "warmup": 1, "floor": 0.5})
    assert feed(quiet, [0.01, 0.4]) == {}  # 40x, but under the floor


def test_spike_skips_nan_which_never_enters_the_baseline():
    eng = engine({"kind": "spike", "metric": "m", "factor": 10, "window": 3, "warmup": 2})
    got = feed(eng, [1.0, math.nan, 1.0, math.inf, 20.0])
    assert list(got) == [5] and got[5][0].baseline == 1.0


def test_threshold_above_and_below_with_recovery():
    eng = engine({"kind": "threshold", "metric": "m", "above": 3, "below": 1})
    got = feed(eng, [2, 4, 5, 2, 0.5, math.nan, 2])
    assert [(s, a.state, a.baseline) for s, al in got.items() for a in al] == [
        (2, "open", 3.0), (4, "closed", 3.0), (5, "open", 1.0), (7, "closed", 1.0)]


def test_nonfinite_on_values_and_on_counts():
    eng = engine({"kind": "nonfinite", "metric": "*"})
    got = feed(eng, [1.0, math.nan, math.inf, 2.0], metric="layer-grad-l2", layer=1)
    assert [(s, a.state, a.baseline) for s, al in got.items() for a in al] == [(2, "open", 1.0), (4, "closed", 1.0)]
    assert math.isinf(got[2][0].jump)
    counts = feed(engine({"kind": "nonfinite", "metric": "*"}), [0, 0, 5, 0], metric="layer-grad-nonfinite", layer=2)
    assert [(s, a.state, a.value) for s, al in counts.items() for a in al] == [(3, "open", 5.0), (4, "closed", 0.0)]


def test_stuck_zero_on_vector_elements_names_the_expert():
    eng = engine({"kind": "stuck", "metric": "layer-expert-tokens", "mode": "zero", "steps": 2,
                  "scope": {"expert": "*"}})
    rows = [(5.0, 3.0), (5.0, 0.0), (6.0, 0.0), (6.0, 0.0), (4.0, 2.0)]
    got = {}
    for step, row in enumerate(rows, start=1):
        alerts = eng.observe([R("layer-expert-tokens", step, row, layer=4)], step)
        if alerts:
            got[step] = alerts
    assert list(got) == [3, 5]
    opened = got[3][0]
    assert (opened.labels.layer, opened.labels.expert, opened.value, opened.baseline) == (4, 1, 0.0, 3.0)
    assert got[5][0].state == "closed" and got[5][0].labels.expert == 1


def test_stuck_unchanged_counts_the_first_value():
    eng = engine({"kind": "stuck", "metric": "m", "mode": "unchanged", "steps": 3})
    got = feed(eng, [1.0, 2.0, 2.0, 2.0, 2.0, 3.0])
    assert [(s, a.state, a.baseline) for s, al in got.items() for a in al] == [(4, "open", 2.0), (6, "closed", 3.0)]


def test_scope_globs_on_labels_and_cached_misses():
    eng = engine({"kind": "threshold", "metric": "layer-*", "above": 1, "scope": {"layer": "1*"}})
    recs = [R("layer-grad-l2", 1, 5.0, layer=l) for l in (0, 1, 12)] + [R("global-grad-l2", 1, 5.0)]
    assert sorted(a.labels.layer for a in eng.observe(recs, 1)) == [1, 12]


def test_first_to_trip_orders_by_step_then_jump_then_labels():
    eng = engine({"kind": "spike", "metric": "u", "factor": 10, "window": 3, "warmup": 2, "scope": {"layer": "*"}},
                 {"kind": "nonfinite", "metric": "g*"}, cluster_steps=5)
    for step in (1, 2):
        eng.observe([R("u", step, 1.0, layer=l) for l in range(3)], step)
    # step 3: layer 2 jumps 50x, layer 0 jumps 20x; layer 2 is first
    step3 = eng.observe([R("u", 3, 20.0, layer=0), R("u", 3, 1.0, layer=1), R("u", 3, 50.0, layer=2)], 3)
    assert [(a.labels.layer, a.jump) for a in step3] == [(2, 50.0), (0, 20.0)]
    assert all(a.first == {"step": 3, "rule": "u-spike", "metric": "u", "layer": 2} for a in step3)
    # step 5: NaN everywhere, an infinite jump, but the cluster's first stays layer 2 at step 3;
    # within the step the alert naming a layer comes before the global one
    step5 = eng.observe([R("g", 5, math.nan), R("g", 5, math.nan, layer=1)], 5)
    assert [a.labels.layer for a in step5] == [1, None]
    assert step5[0].first["layer"] == 2 and step5[0].first["step"] == 3
    # more than cluster_steps later: a new cluster led by its own first alert
    step20 = eng.observe([R("g", 20, 1.0), R("g", 20, 1.0, layer=1), R("g", 20, math.inf, layer=0)], 20)
    opened = [a for a in step20 if a.state == "open"]
    assert opened[0].first == {"step": 20, "rule": "gx-nonfinite", "metric": "g", "layer": 0}
    assert {a.labels.layer for a in step20 if a.state == "closed"} == {None, 1}


def test_default_set_and_gradient_nonfinite_on_by_default():
    config = load_config({"alerts": "default"}).alerts
    names = [r.name for r in config.active_rules]
    assert names == ["grad-norm-spike", "update-ratio-spike", "nonfinite-gradients", "dead-expert", "starved-expert",
                     "load-imbalance"]
    assert config.rules[5].scope == {"stat": "max-over-mean"}  # the stat name layer-expert-load-imbalance uses
    assert [r.name for r in AlertsConfig().active_rules] == ["nonfinite-gradients"]
    eng = AlertEngine(AlertsConfig())
    assert [a.metric for a in eng.observe([R("global-grad-l2", 1, math.nan), R("output-entropy", 1, math.nan)], 1)] \
        == ["global-grad-l2"]


def test_alert_json_round_trip():
    eng = engine({"kind": "nonfinite", "metric": "*"})
    alert = eng.observe([R("g", 1, math.nan, layer=3, stat="x")], 1)[0]
    assert Alert.from_json(alert.to_json()).to_json() == alert.to_json()
    assert alert.to_json()["value"] == "NaN"


@pytest.mark.parametrize("alerts, message", [
    ([{"kind": "spike", "metric": "m", "factor": 0}], "alerts[0].factor: got 0; need a number > 1"),
    ([{"kind": "spike", "metric": "m", "factor": None}], "alerts[0].factor: got neither"),
    ([{"kind": "spike", "metric": "m", "window": 1}], "alerts[0].window: got 1; need an integer >= 2"),
    ([{"kind": "threshold", "metric": "m", "above": 1, "below": 2}], "alerts[0].below: got below 2.0 >= above 1.0"),
    ([{"kind": "stuck", "metric": "m", "mode": "unchanged", "steps": 1}], "alerts[0].steps: got 1"),
    ([{"kind": "stuck", "metric": "m", "scope": {"layr": "1"}}], "alerts[0].scope.layr: unknown label 'layr'"),
    ([{"kind": "spiky", "metric": "m"}], "alerts[0].kind: got 'spiky'"),
    ([{"kind": "spike"}], "alerts[0]: missing key 'metric'"),
    ([{"kind": "spike", "metric": "m", "facter": 2}], "alerts[0].facter: unknown key 'facter'"),
    ([{"kind": "spike", "metric": "m"}, {"kind": "spike", "metric": "m"}], "alerts[1].name: rule name 'm-spike'"),
    ({"cluster_steps": -1}, "alerts.cluster_steps: got -1"),
    ("sometimes", "alerts: got 'sometimes'; need 'default' or a list of rules"),
])
def test_config_errors_name_path_and_value(alerts, message):
    with pytest.raises(ConfigError) as caught:
        load_config({"alerts": alerts})
    assert str(caught.value).startswith(message), str(caught.value)


def test_config_round_trips_through_to_dict():
    config = load_config({"alerts": ["default", {"kind": "threshold", "metric": "x", "below": 0}]})
    assert load_config(config.to_dict()) == config


def test_stuck_share_tells_a_sudden_death_from_a_slow_starvation():
    eng = engine({"kind": "stuck", "metric": "t", "mode": "zero", "steps": 1, "share": 0.25, "warmup": 1})
    # expert 0 starves (10 of a mean 100 -> 0.1 of its share, then 0); expert 1 had 100 (1.0) and
    # drops to 0 at once; expert 2 drops to 0 at step 1, inside the warm-up
    rows = [(10.0, 100.0, 0.0, 290.0), (0.0, 0.0, 0.0, 400.0), (0.0, 0.0, 0.0, 400.0)]
    got = {s: eng.observe([R("t", s, row, layer=0)], s) for s, row in enumerate(rows, start=1)}
    assert [(a.step, a.labels.expert, a.baseline) for alerts in got.values() for a in alerts] == [(2, 1, 100.0)]


def _deaths(rule: dict, rows: list[tuple[float, ...]]) -> list[tuple[int, int | None]]:
    eng = engine(rule)
    return [(a.step, a.labels.expert) for s, row in enumerate(rows, start=1)
            for a in eng.observe([R("t", s, row, layer=0)], s) if a.state == "open"]


def test_a_starved_expert_is_named_within_two_due_steps_of_its_death_as_is_a_sudden_one():
    """Issue 35: an expert that starved by itself (0 tokens) raised no alert, since the zero rule
    with a share waits for a sudden death. The starved mode names it by its falling load; the
    delay is counted in due steps from the first due step with 0 tokens (its death)."""
    starved = {"kind": "stuck", "metric": "t", "mode": "starved", "share": 0.1, "steps": 2, "warmup": 2}
    fair = 256.0  # 4 experts, 1024 routed tokens
    # expert 3 starves: its load halves each due step from step 3 (128, 64, ..., 0 at step 10)
    slow = [(fair, fair, fair, fair)] * 2 + [
        (fair + x / 3, fair + x / 3, fair + x / 3, fair - x) for x in
        (128.0, 192.0, 224.0, 240.0, 248.0, 252.0, 254.0, 256.0, 256.0, 256.0)]
    death = next(s for s, row in enumerate(slow, start=1) if row[3] == 0)
    (tripped,) = _deaths(starved, slow)
    assert tripped[1] == 3 and tripped[0] - death <= 2
    print(f"starved expert: named at due step {tripped[0]}, its death (0 tokens) at due step {death}: "
          f"delay {tripped[0] - death} due steps")
    # the zero rule with a share (the default dead-expert rule) never names it
    zero = {"kind": "stuck", "metric": "t", "mode": "zero", "steps": 1, "share": 0.5, "warmup": 2}
    assert _deaths(zero, slow) == []
    # a sudden death at step 5: both rules name it, the zero rule at once, the starved mode 1 due step later
    sudden = [(fair,) * 4] * 4 + [(fair + fair / 3,) * 3 + (0.0,)] * 4
    assert _deaths(zero, sudden) == [(5, 3)]
    assert _deaths(starved, sudden) == [(6, 3)]
    # a clean, uneven but fed load (every expert above 10% of fair) raises nothing
    uneven = [(400.0, 300.0, 200.0, 124.0), (500.0, 300.0, 190.0, 34.0)] * 5
    assert _deaths(starved, uneven) == []


def test_starved_mode_needs_a_share():
    with pytest.raises(ConfigError, match=r"alerts\.rules\[0\]\.share: mode 'starved' needs share"):
        engine({"kind": "stuck", "metric": "t", "mode": "starved"})
