"""The benchmark scripts' own machinery (their figures come from running them, not from tests):
the GPU script refuses cleanly without CUDA and its step harness runs every variant; the heap
peak sees tensor memory; rounds rotate the order and pair ratios per round."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import gpu_overhead
from bench.peak_memory import HeapPeak, heap_in_use
from bench.rounds import Rounds, interleave


def test_gpu_script_prints_help_and_refuses_without_cuda(capsys, monkeypatch):
    with pytest.raises(SystemExit) as help_exit:
        gpu_overhead.main(["--help"])
    assert help_exit.value.code == 0 and "--nproc" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as refused:
        gpu_overhead.main([])
    assert refused.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_gpu_step_harness_runs_every_variant_on_any_device():
    args = argparse.Namespace(batch=2, seq_len=8, d_model=16, layers=2, heads=2, d_ff=16, experts=4, top_k=2)
    for name in gpu_overhead.VARIANTS:
        job = gpu_overhead._job(name, args, torch.device("cpu"))
        before = [p.detach().clone() for p in job.model.parameters()]
        job.run(2)
        assert job.step == 2
        assert any(not torch.equal(b, p) for b, p in zip(before, job.model.parameters()))
        if name == "tmetrics every 1":
            assert {r.metric for r in job.metrics.last_records} == set(gpu_overhead.BUNDLE)
        job.metrics.close()


def test_heap_peak_sees_a_tensor_that_lived_inside_the_block():
    before = heap_in_use()
    with HeapPeak() as peak:
        x = torch.ones(1 << 20)  # 4 MiB
        del x
    assert peak.peak - before >= 4 << 20
    assert heap_in_use() - before < 1 << 20


def test_rounds_rotate_the_order_and_pair_ratios_per_round():
    calls = []
    result = interleave({n: (lambda steps, n=n: calls.append((n, steps))) for n in "abc"}, rounds=3, steps=2)
    assert [n for n, _ in calls] == list("abc" "bca" "cab") and {s for _, s in calls} == {2}
    assert all(len(v) == 3 for v in result.wall.values())
    r = Rounds({"base": [1.0, 2.0, 4.0], "x": [1.1, 2.4, 4.0]}, {"base": [1.0] * 3, "x": [1.0] * 3})
    assert r.paired("x", "base") == pytest.approx(1.1)  # median of 1.1, 1.2, 1.0
    assert r.mean("x", "base", trim=0.0) == pytest.approx(3.3 / 3)
    assert r.mean("x", "base", trim=0.34) == pytest.approx(1.1)  # one ratio cut at each end
    assert r.paired("x", "base", cpu=True) == 1.0


def test_due_step_time_splits_the_tmetrics_code_and_restores_what_it_wraps():
    from bench.due_step_time import _ENTRIES, _PASSES, due_step_time

    before = [getattr(owner, name) for owner, name in _ENTRIES + _PASSES]
    t = due_step_time(("layer-grad-l2", "layer-update-ratio"), steps=3)
    # Both groups read tensors (gradients; updates and the snapshot copy), so passes are timed.
    assert 0.0 < t.passes_ms < t.total_ms
    assert [getattr(owner, name) for owner, name in _ENTRIES + _PASSES] == before


def test_the_switched_pair_runs_one_trainer_with_tmetrics_off_then_on():
    from bench.demo_variants import make_trainer, tmetrics_factory
    from bench.step_overhead import SWITCHED, _switched

    trainer = make_trainer(tmetrics_factory(1, ("layer-grad-l2",)))
    metrics = trainer.metrics
    off, on = (_switched(trainer)[name] for name in SWITCHED)
    off(1)
    assert metrics.last_records == []  # the bundle's object saw no step scope
    on(1)
    assert {r.metric for r in metrics.last_records} == {"layer-grad-l2"}
    steps = {r.step for r in metrics.last_records}
    off(1)
    assert trainer.metrics is not metrics and {r.step for r in metrics.last_records} == steps


def test_alternate_pairs_single_steps_in_both_orders_and_reports_the_mean_difference(monkeypatch):
    """Steps of known cost on a fake clock: the overhead is their mean difference over the first's
    mean, its standard error that of the pairs, and the order alternates so that neither variant
    always runs first."""
    import bench.rounds as rounds

    clock = [0.0]
    monkeypatch.setattr(rounds.time, "perf_counter", lambda: clock[0])
    order: list[str] = []
    costs = {"off": iter([4.0, 4.0, 4.0, 4.0]), "on": iter([5.0, 4.0, 6.0, 5.0])}

    def step(name: str):
        def run() -> None:
            order.append(name)
            clock[0] += next(costs[name])
        return run
    got = rounds.alternate(step("off"), step("on"), pairs=4)
    assert order == ["off", "on", "on", "off", "off", "on", "on", "off"]
    assert got.differences == (1.0, 0.0, 2.0, 1.0) and got.first_mean == 4.0
    assert got.overhead() == pytest.approx(0.25)
    assert got.standard_error() == pytest.approx(0.816496580927726 / 2 / 4.0)


def test_release_ab_reads_the_figures_step_overhead_prints():
    """bench.release_ab parses Table 1 as bench.step_overhead prints it (built here from known
    rounds, pairs and due-step times), and says what is missing in an output without pairs."""
    from bench.due_step_time import DueStepTime
    from bench.release_ab import ReleaseRun, parse
    from bench.rounds import PairedSteps
    from bench.step_overhead import SECOND_BARE, SWITCHED, _single_table

    names = ("bare", SECOND_BARE, "tmetrics every 1", "tmetrics every 10", *SWITCHED)
    rounds = Rounds(wall={n: [0.1, 0.1] for n in names}, cpu={n: [0.2, 0.2] for n in names})
    stepwise = PairedSteps(differences=(0.004, 0.006), first_mean=0.08)
    table = _single_table(rounds, 2, 5, 9.0, (0, 0), (78, 0), DueStepTime(4.94, 2.53), stepwise)
    assert parse("\n".join(table)) == ReleaseRun(overhead_pct=6.25, error_pct=1.25, bare_ms=80.0, code_ms=4.94,
                                                 passes_ms=2.53, ops=78)
    without_pairs = "\n".join(_single_table(rounds, 2, 5, 9.0, (0, 0), (78, 0), DueStepTime(4.94, 2.53), None))
    with pytest.raises(ValueError, match="no paired single-step.*no --pairs"):
        parse(without_pairs)


def test_bundle_entries_carry_recipes_and_compared_bundles_print_after_what_release_ab_reads():
    """A bundle entry ``name:recipe+recipe`` builds the quant metric with those recipes; the lines of
    a ``--compare`` bundle come under table 1 with its own ops and due-step time, and leave the
    figures bench.release_ab reads those of the standard bundle."""
    from bench.demo_variants import BUNDLES, metric_of
    from bench.due_step_time import DueStepTime
    from bench.release_ab import parse
    from bench.rounds import PairedSteps
    from bench.step_overhead import SECOND_BARE, SWITCHED, Compared, _single_table
    from tmetrics_core.errors import ConfigError

    assert [r.name for r in metric_of("layer-param-quant:mxfp8+fp8-tensorwise").recipes] == ["mxfp8", "fp8-tensorwise"]
    with pytest.raises(ConfigError):
        metric_of("layer-grad-l2:mxfp8")
    names = ("bare", SECOND_BARE, "tmetrics every 1", "attention every 1", "attention every 100", *SWITCHED)
    wall = {n: [0.1, 0.1] for n in names} | {"attention every 1": [0.15, 0.15], "attention every 100": [0.1005] * 2}
    rounds = Rounds(wall=wall, cpu={n: [0.2, 0.2] for n in names})
    stepwise = PairedSteps(differences=(0.004, 0.006), first_mean=0.08)
    compared = [Compared("attention", (629, 0), DueStepTime(38.0, 35.0, 4.0))]
    table = _single_table(rounds, 2, 5, 9.0, (0, 0), (78, 0), DueStepTime(4.94, 2.53), stepwise, compared)
    row = next(line for line in table if line.startswith("attention every 100"))
    assert row.split()[-1] == f"{1 + (0.5 + 99 * 9.0 / 100e3) / 100:.4f}"  # its own due overhead, not the bundle's
    tail = "\n".join(table[-2:])
    assert "every 1 wall x 1.500 over bare" in tail and "629 torch ops" in tail and "38.00 ms" in tail
    assert "x9.50 of them" in tail and ", ".join(BUNDLES["attention"]) in tail
    assert parse("\n".join(table)).ops == 78 and parse("\n".join(table)).code_ms == 4.94


def test_alert_precision_tells_a_recovery_after_an_injection_from_a_new_spike():
    from bench.alert_precision import RECOVERY, recovery
    from tmetrics_core.alerts import AlertEngine
    from tmetrics_core.config.alerts import parse_alerts
    from tmetrics_core.records import Labels, MetricRecord

    def spike_alerts(late: float):
        """grad-norm-spike over layer 0: 1.0 before the injection at step 100, 0.05 after it, ``late`` at 225."""
        values = {step: 1.0 if step < 100 else 0.05 for step in range(5, 225, 5)} | {225: late}
        steps = {step: [MetricRecord("layer-grad-l2", step, value, Labels(layer=0))] for step, value in values.items()}
        engine = AlertEngine(parse_alerts("default"))
        alerts = [a for step in sorted(steps) for a in engine.observe(steps[step], step) if a.state == "open"]
        return alerts, steps

    (back,), steps = spike_alerts(1.2)  # 24x the depressed baseline, 1.2x the healthy level
    assert (back.rule, back.step, back.jump) == ("grad-norm-spike", 225, pytest.approx(24.0))
    assert recovery(back, steps, start=100) == pytest.approx(1.2) and 1.2 <= RECOVERY
    (new,), steps = spike_alerts(30.0)  # 30x the healthy level: a spike by any baseline
    assert recovery(new, steps, start=100) == pytest.approx(30.0) and 30.0 > RECOVERY
    assert recovery(new, steps, start=300) is None  # an alert before the injection is no recovery


def test_cold_calls_hook_table_times_the_rows_pass_in_three_settings():
    from bench.cold_calls import hook_call

    lines = hook_call(1)
    assert len(lines) == 5 and lines[2].startswith("back to back")
    warm = float(lines[2].split()[-2])
    assert warm > 0.0 and float(lines[2].split()[-1]) == 1.0
