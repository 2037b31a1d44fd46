"""DeepSpeed 0.19.8 on its CPU accelerator, gloo, in one spawned world running every case (its
import and engine set-up dominate the time): ZeRO 1, 2 and 3, ZeRO 2 with accumulation 2 and
clipping, optimizer offload to the CPU, bf16 (ZeRO 2 and 3), fp16 with dynamic loss scaling
(ZeRO 2 and 3, with steps DeepSpeed skips for an injected +inf), ``model=engine.module`` with
``engine.optimizer``, accelerate's ``attach`` with a ``DeepSpeedPlugin`` and the Trainer with
``TrainingArguments(deepspeed=...)``. tmetrics is attached by the line a user writes; no
placements, hooks or offsets come from the test.

References: fp32 runs, a float64 single-process training of the same global batches by hand
(rel 1e-5); bf16 and fp16 runs, DeepSpeed's own tensors (``safe_get_full_grad`` and
``safe_get_full_optimizer_state``, the bf16/fp16 weights) read by the test around each step
(rel 1e-5; fp16 gradients divided by the loss scale), and the float64 reference within their
precision; every run, DeepSpeed's own ``get_global_grad_norm()``."""

from __future__ import annotations

import logging
import math

import pytest

pytest.importorskip("deepspeed")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.deepspeed.world import BLOCKS, METRICS, Case, run_cases  # noqa: E402

WORLD = 2
CASES = [
    Case("zero0", 0),  # no ZeRO: the client optimizer, gradients all-reduced into .grad
    Case("zero1", 1),
    Case("zero2-module", 2, path="module"),
    Case("zero2-accumulate", 2, gas=2, clip=1.0),
    Case("zero2-offload", 2, extra={"offload_optimizer": {"device": "cpu"}}),
    Case("zero3", 3, steps=3, interval=2, count_gathers=True,  # and a forward-side metric under its fetch hooks
         metrics=(*METRICS, "layer-residual-accumulator-l2")),
    Case("zero2-bf16", 2, bf16=True),
    Case("zero3-bf16", 3, bf16=True),
    Case("zero2-fp16", 2, fp16=True,  # dynamic loss scaling: gradients and cotangents read unscaled
         metrics=(*METRICS, "layer-residual-grad-l2")),
    Case("zero2-fp16-skips", 2, fp16=True, steps=3, inject=(2, 3)),  # +inf in a gradient: DeepSpeed skips 2 and 3
    Case("zero3-fp16", 3, fp16=True, steps=3, inject=(3,)),  # ZeRO 3's float32 gradient partitions, one skip
    Case("zero2-fp16-offload", 2, fp16=True, extra={"offload_optimizer": {"device": "cpu"}}),  # float32 CPU grads
    Case("accelerate-zero2", 2, gas=2, clip=1.0, path="accelerate"),
    Case("trainer-zero2", 2, clip=1.0, path="trainer"),
]
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(run_cases, WORLD, CASES, str(tmp_path_factory.mktemp("deepspeed")), timeout=600)


def _expected_keys(case: Case) -> set[tuple]:
    stats = {"layer-optimizer-state-rms": ("exp_avg", "exp_avg_sq"),
             "layer-grad-nonfinite": ("nan", "posinf", "neginf", "total")}
    due = [s for s in range(1, case.steps + 1) if s == 1 or s % case.interval == 0]
    post = ("layer-update-ratio", "layer-optimizer-state-rms")  # none on a step DeepSpeed skipped
    return {(m, s, None if m.startswith("global") else layer, stat) for m in case.metrics for s in due
            for layer in range(BLOCKS) for stat in stats.get(m, (None,)) if not (s in case.inject and m in post)}


@pytest.mark.parametrize("name", [c.name for c in CASES if not (c.bf16 or c.fp16)])
def test_every_record_equals_the_float64_reference(runs, name):
    records, reference = runs[0][name]["records"], runs[0][name]["reference"]
    assert set(records) == _expected_keys(BY_NAME[name])
    wrong = {k: (v, reference[k]) for k, v in records.items()
             if not math.isclose(v, reference[k], rel_tol=1e-5, abs_tol=1e-12)}
    assert not wrong


@pytest.mark.parametrize("name", [c.name for c in CASES if c.bf16 or c.fp16])
def test_low_precision_records_equal_deepspeeds_own_tensors(runs, name):
    case = BY_NAME[name]
    records, own, reference = runs[0][name]["records"], runs[0][name]["own"], runs[0][name]["reference"]
    assert set(records) == _expected_keys(case)
    compared = set(own) & set(records)
    # grad (global, layers), param; update and 2 states where DeepSpeed stepped (fp16: gradients unscaled)
    assert len(compared) == len(own) == sum(1 + BLOCKS * (2 if s in case.inject else 5)
                                            for s in range(1, case.steps + 1))
    assert not {k: (records[k], own[k]) for k in compared if not math.isclose(records[k], own[k], rel_tol=1e-5)}
    # bf16/fp16 weights and gradients: within their precision of the float64 training (inf where injected)
    assert not {k: (v, reference[k]) for k, v in records.items()
                if not math.isclose(v, reference[k], rel_tol=3e-2, abs_tol=1e-12)}


@pytest.mark.parametrize("name", [c.name for c in CASES if c.stage > 0])  # without ZeRO it keeps no norm
def test_global_grad_l2_equals_deepspeeds_own_norm(runs, name):
    case = BY_NAME[name]
    norms = runs[0][name]["norms"]
    assert norms == runs[1][name]["norms"]
    for step, norm in enumerate(norms, start=1):
        if step == 1 or step % case.interval == 0:
            assert runs[0][name]["records"][("global-grad-l2", step, None, None)] == pytest.approx(norm, rel=1e-6)


def test_a_step_deepspeed_skips_writes_its_gradients_and_says_so_once(runs):
    records = runs[0]["zero2-fp16-skips"]["records"]
    for step in (2, 3):  # the +inf, counted once across the two ranks' partitions; no update records
        assert [records[("layer-grad-nonfinite", step, 1, stat)] for stat in ("posinf", "total")] == [1, 1]
        assert records[("global-grad-l2", step, None, None)] == math.inf
        assert ("layer-update-ratio", step, 0, None) not in records
    assert runs[0]["zero2-fp16-skips"]["norms"][1:] == [math.inf, math.inf]  # DeepSpeed's own norm of a skip
    said = runs[0]["zero2-fp16-skips"]["said"]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO]
    assert "DeepSpeed skipped the optimizer step of step 2" in said[0][1] and "once" in said[0][1]
    assert runs[1]["zero2-fp16-skips"]["said"] == []  # the logging rank only


def test_reading_fp16_gradients_leaves_deepspeeds_training_alone(runs):
    # tmetrics divides copies. Were DeepSpeed's float32 gradients (offload's CPU buffers, ZeRO 3's
    # partitions) unscaled in place, DeepSpeed would unscale them again: with offload the step-2
    # norm read 8.61968 instead of 8.61798.
    plain = runs[0]["zero2-fp16"]["norms"]
    assert runs[0]["zero2-fp16-offload"]["norms"] == pytest.approx(plain, rel=1e-6)
    assert runs[0]["zero3-fp16"]["norms"][:2] == pytest.approx(plain, rel=1e-6)


def test_a_zero3_due_step_gathers_no_parameter(runs):
    # Step 2 is due (every metric, the update ratio among them), step 3 is not: DeepSpeed's own
    # forward and backward gather alike in both; tmetrics' reads of the partitions add nothing.
    gathers = [r["zero3"]["gathers"] for r in runs]
    assert all(g[1] == g[2] > 0 for g in gathers), gathers


def test_what_tmetrics_does_not_read_is_refused_by_name(runs):
    said = runs[0]["refusals"]
    assert "model=engine" in said["foreign-module"]
    assert "from_config(cfg, model=engine)" in said["direct"]
    assert "DeepSpeed-MoE" in said["moe"]
    assert "zero_hpz_partition_size=2" in said["hpz"]
    assert "PipelineEngine" in said["pipeline"]
    assert "clipped gradients" in said["zero0-clip"]


FOUR = [Case("zero1-4", 1), Case("zero3-4", 3, steps=3, interval=2)]


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    return run_distributed(run_cases, 4, FOUR, str(tmp_path_factory.mktemp("deepspeed4")), timeout=600)


@pytest.mark.parametrize("case", FOUR, ids=[c.name for c in FOUR])
def test_four_ranks_equal_the_float64_reference(runs4, case):
    """4 ranks: ZeRO partitions cut the blocks' tensors at other places, and more ranks hold
    none of a small tensor; every record still equals the float64 reference of the global batch."""
    records, reference = runs4[0][case.name]["records"], runs4[0][case.name]["reference"]
    assert set(records) == _expected_keys(case)
    wrong = {k: (v, reference[k]) for k, v in records.items()
             if not math.isclose(v, reference[k], rel_tol=1e-5, abs_tol=1e-12)}
    assert not wrong
    for step, norm in enumerate(runs4[0][case.name]["norms"], start=1):
        if step == 1 or step % case.interval == 0:
            assert records[("global-grad-l2", step, None, None)] == pytest.approx(norm, rel=1e-6)
