"""``alerts: default`` names a dead expert within 2 due steps of its death (issue 35), both kinds:
an injected one (its whole share lost at once: ``dead-expert``) and one the router starved by
itself (its load falls to 0 tokens: ``starved-expert``). Synthetic token counts of one layer with
4 experts, metrics due every 5 steps from step 1 as in the demo; the delay is counted in due steps
from the first due step with 0 tokens. The demo's own runs are measured in docs/alerts.md
(``python -m bench.alert_precision``)."""

from __future__ import annotations

from tmetrics_core.alerts import AlertEngine
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.records import Labels, MetricRecord

FAIR = 256.0  # 4 experts, top-2 of 512 tokens


def due_steps(n: int) -> list[int]:
    return [1] + [5 * i for i in range(1, n)]


def opened(loads: list[tuple[float, ...]]) -> list[tuple[int, str, int | None]]:
    """(due index, rule, expert) of every alert ``alerts: default`` opens over one layer's loads."""
    engine = AlertEngine(parse_alerts("default"))
    out = []
    for index, (step, load) in enumerate(zip(due_steps(len(loads)), loads)):
        for alert in engine.observe([MetricRecord("layer-expert-tokens", step, load, Labels(layer=2))], step):
            if alert.state == "open":
                out.append((index, alert.rule, alert.labels.expert))
    return out


def spread(lost: float) -> tuple[float, ...]:
    """Expert 3 loses ``lost`` tokens, the others share them."""
    return (FAIR + lost / 3,) * 3 + (FAIR - lost,)


def test_an_injected_death_is_named_at_its_due_step():
    # the demo's 120-step run kills expert 3 at step 40, its 9th due step (index 8)
    loads = [spread(0.0)] * 8 + [spread(FAIR)] * 6
    got = opened(loads)
    death = 8
    assert got[0] == (death, "dead-expert", 3), got
    assert got[1] == (death + 1, "starved-expert", 3), got  # the same expert, by its load, 1 due step on
    assert len(got) == 2
    print(f"injected death: dead-expert at delay {got[0][0] - death} due steps, starved-expert at "
          f"{got[1][0] - death}")


def test_a_starved_death_is_named_within_two_due_steps():
    # expert 3's load falls from its fair share by a third each due step from index 8; 0 tokens
    # from the first due step where it is under 1 token
    loads = [spread(0.0)] * 8 + [spread(FAIR * (1 - (2 / 3) ** k)) for k in range(1, 9)] + [spread(FAIR)] * 3
    death = next(i for i, load in enumerate(loads) if load[3] < 1.0)
    loads[death:] = [spread(FAIR)] * (len(loads) - death)
    got = opened(loads)
    assert [(rule, expert) for _, rule, expert in got] == [("starved-expert", 3)], got
    delay = got[0][0] - death
    assert delay <= 2
    print(f"starved death: starved-expert at delay {delay} due steps (named {-delay} before its load hit 0)")


def test_a_slow_fall_to_zero_from_above_the_starved_share_is_named_one_due_step_after():
    # from 0.3 of its fair share (under dead-expert's 0.5) straight to 0: only the starved rule sees it
    loads = [spread(0.0)] * 8 + [spread(0.7 * FAIR)] * 2 + [spread(FAIR)] * 4
    got = opened(loads)
    assert got == [(11, "starved-expert", 3)], got
    print(f"0.3 of fair -> 0: starved-expert at delay {got[0][0] - 10} due steps")


def test_uneven_fed_load_and_early_churn_raise_nothing():
    # the first 6 due values (steps 1-25) are the warm-up, where the demo's router empties and
    # refills experts; later an uneven load with every expert above 0.1 of fair is quiet
    churn = [(512.0, 512.0, 0.0, 0.0), (0.0, 512.0, 512.0, 0.0)] * 3
    uneven = [(400.0, 300.0, 200.0, 124.0), (500.0, 300.0, 180.0, 44.0)] * 6
    assert opened(churn + uneven) == []


def test_a_starvation_before_a_fault_is_not_named_as_its_first():
    # layer 3's expert 3 starves from due index 6 (named at 7, step 35), layer 2's expert 3 dies at index 8:
    # the death starts its own cluster, and the starved alert, outside any cluster, names itself
    engine = AlertEngine(parse_alerts("default"))
    firsts = {}
    for index, step in enumerate(due_steps(10)):
        dead = index >= 8
        records = [MetricRecord("layer-expert-tokens", step, spread(FAIR if dead else 0.0), Labels(layer=2)),
                   MetricRecord("layer-expert-tokens", step, (FAIR + 0.98 * FAIR / 3,) * 3 + (0.02 * FAIR,)
                                if index >= 6 else spread(0.0), Labels(layer=3))]
        for alert in engine.observe(records, step):
            firsts[(alert.rule, alert.labels.layer)] = (alert.step, alert.first["rule"], alert.first["layer"])
    assert firsts[("starved-expert", 3)] == (35, "starved-expert", 3)
    assert firsts[("dead-expert", 2)] == (40, "dead-expert", 2)
    assert firsts[("starved-expert", 2)] == (45, "dead-expert", 2)


def test_a_load_hovering_around_the_share_is_one_alert():
    # expert 3 dips under 0.1 of fair for 2 due steps, then moves between 0.05 and 0.15: one
    # alert, which closes only at 0.2 of fair (its fair share at index 16)
    hover = [spread(FAIR * (1 - share)) for share in (0.05, 0.05, 0.15, 0.05, 0.15, 0.05, 0.05, 0.15)]
    got = opened([spread(0.0)] * 8 + hover + [spread(0.0)] + hover)
    assert got == [(9, "starved-expert", 3), (18, "starved-expert", 3)], got
