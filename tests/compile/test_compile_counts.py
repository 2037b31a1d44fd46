"""Under ``torch.compile(model, fullgraph=True)`` tmetrics adds no graph, no graph break, no
recompile and no warning, whatever its cadence, and its records equal the uncompiled run's.

The model is the demo MoE transformer with the demo's bundle (residual, output-logit and router
metrics observed in the forward; gradient and parameter norms around it): see
``bench/compile_counts.py``, which prints the same counts as a table."""

from __future__ import annotations

import math

import pytest

from bench.compile_counts import largest_difference, run

CADENCES = {"every step": (1, 3), "every 5": (5, 6), "never": (10**9, 3)}
"""Cadence -> (interval, steps): the every-5 run goes due, idle 3 steps, due again; "never" is
due at the first step only (tmetrics measures every run's first step), then idle."""


@pytest.fixture(scope="module")
def bare_graphs() -> int:
    counts = run("eager", None, steps=2)
    assert counts.breaks == 0 and counts.recompiles == 0
    return counts.graphs


@pytest.mark.parametrize("cadence", list(CADENCES))
def test_eager_backend_same_graphs_no_break_no_recompile_and_equal_records(cadence: str, bare_graphs: int) -> None:
    interval, steps = CADENCES[cadence]
    counts = run("eager", interval, steps=steps)
    assert (counts.graphs, counts.breaks, counts.recompiles, counts.warnings) == (bare_graphs, 0, 0, [])
    reference = run(None, interval, steps=steps).records
    due = [s for s in range(1, steps + 1) if s == 1 or s % interval == 0]
    assert [s for s, r in reference.items() if r] == due
    assert any(key[0] == "layer-router-z-loss" for key in reference[1])  # the forward's sites are measured
    assert largest_difference(counts.records, reference) == 0.0  # the same kernels: bit-equal


def test_inductor_same_graphs_no_break_no_recompile_and_records_within_rounding(bare_graphs: int) -> None:
    interval, steps = CADENCES["every 5"]
    counts = run("inductor", interval, steps=steps)
    assert (counts.graphs, counts.breaks, counts.recompiles, counts.warnings) == (bare_graphs, 0, 0, [])
    reference = run(None, interval, steps=steps).records
    difference = largest_difference(counts.records, reference)
    assert math.isfinite(difference) and difference < 1e-4  # fused kernels round differently
