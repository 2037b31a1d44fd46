"""The parameter-side program prepares the states the general path prepares, bit for bit.

Each case trains the same small MoE transformer twice from the same seed, once with the due
set's :class:`~tmetrics_core.sources.param_program.ParamProgram` and once with it planned away (every
phase then takes the general path), and compares every record of every step exactly. The cases
cover the metric shapes the program takes (per layer, tensor, family and global scopes; sums of
squares, absolute maxima, zero counts with element counts, the update ratio's kept sites),
due sets that change from step to step (parameter metrics read before the step on some steps
and from the snapshot on others), ``observe_gradients()``, bfloat16 parameters, and tensors the
kernel refuses (float64: the program falls back to the general path at run time, with the
update snapshot intact). A due set with a metric the program does not take runs no program.
"""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.param_program import ParamProgram
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.tensor_metrics import TensorMetrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, seq_len=16)

BUNDLE_PARAMS = {"layer-param-l2": 1, "layer-grad-l2": 1, "layer-grad-absmax": 1, "layer-update-ratio": 1}
SHAPES = {"global-param-l2": 1, "tensor-grad-l2": 1, "family-param-l2": 2, "layer-param-rms": 1,
          "layer-grad-rms": 3, "layer-param-absmax": 2, "layer-grad-zero-fraction": 1}
CHANGING = {"layer-param-l2": 1, "layer-grad-l2": 2, "layer-update-ratio": 3, "layer-param-rms": 2}


def _loss(model: Transformer, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), tokens[:, 1:].reshape(-1))


def _train(intervals: dict[str, int], *, program: bool, steps: int = 4, dtype=torch.float32, early: bool = False,
           monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], int]:
    """Records per step (key -> value) and how many phases the program prepared."""
    ran = [0]
    with monkeypatch.context() as patch:
        if not program:
            patch.setattr(ParamObserver, "_plan_program", lambda self, *args: None)
        for name in ("read_pre", "read_post"):
            original = getattr(ParamProgram, name)

            def counted(self, *args, _original=original, **kwargs):
                states = _original(self, *args, **kwargs)
                ran[0] += states is not None
                return states
            patch.setattr(ParamProgram, name, counted)
        model = Transformer(SMALL, seed=0).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        metrics = TensorMetrics(model, metrics=[(build_metric(n), i) for n, i in intervals.items()],
                                optimizer=optimizer)
        out = []
        for step in range(1, steps + 1):
            with metrics.step(step):
                _loss(model, step).backward()
                if early:
                    metrics.observe_gradients()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
            assert metrics.failures == []
            out.append({(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records})
        metrics.close()
    return out, ran[0]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b


def _assert_equal(fast: list[dict], general: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(fast, general), start=1):
        assert a.keys() == b.keys(), step
        bad = {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}
        assert not bad, f"step {step}: {bad}"


@pytest.mark.parametrize("intervals", [BUNDLE_PARAMS, SHAPES, CHANGING], ids=["bundle", "shapes", "changing"])
def test_program_states_equal_the_general_path(intervals, monkeypatch):
    fast, ran = _train(intervals, program=True, monkeypatch=monkeypatch)
    general, none = _train(intervals, program=False, monkeypatch=monkeypatch)
    assert none == 0 and ran >= 4  # at least one phase on every step went through the program
    assert all(fast)
    _assert_equal(fast, general)


def test_program_with_gradients_read_early_and_bfloat16(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        fast, ran = _train(BUNDLE_PARAMS, program=True, dtype=dtype, early=True, monkeypatch=monkeypatch)
        general, _ = _train(BUNDLE_PARAMS, program=False, dtype=dtype, early=True, monkeypatch=monkeypatch)
        assert ran == 8  # both phases, every step
        _assert_equal(fast, general)


def test_tensors_the_kernel_refuses_take_the_program_with_torch_ops(monkeypatch):
    """float64 tensors: the C kernel does not take them, so the program reads them with batched
    torch ops (both phases, every step, nothing tried and abandoned); the update ratio sees
    every snapshot (torch's copies) and the states equal the general path's."""
    fast, ran = _train(BUNDLE_PARAMS, program=True, dtype=torch.float64, monkeypatch=monkeypatch)
    general, _ = _train(BUNDLE_PARAMS, program=False, dtype=torch.float64, monkeypatch=monkeypatch)
    assert ran == 8
    assert all(math.isfinite(v) and v > 0 for step in fast for (m, *_), v in step.items() if m == "layer-update-ratio")
    _assert_equal(fast, general)


def test_the_program_counts_non_finite_values(monkeypatch):
    """Counting non-finite values reads elements: the program reads them from the gradients it
    was given (the pre phase), so the due set keeps the program."""
    intervals = {**BUNDLE_PARAMS, "layer-grad-nonfinite": 1}
    fast, ran = _train(intervals, program=True, steps=2, monkeypatch=monkeypatch)
    general, _ = _train(intervals, program=False, steps=2, monkeypatch=monkeypatch)
    assert ran == 4
    _assert_equal(fast, general)
