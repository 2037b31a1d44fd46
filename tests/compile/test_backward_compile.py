"""Cotangent metrics under ``torch.compile(model, fullgraph=True)``: the tensor hooks their
forward hooks register are traced into the graph (a ``tmetrics::observe_grad`` operator in the
backward), so the baseline's graph count holds, with no graph break and no recompile when the
metrics are due every step or every 5, and the records equal the uncompiled run's."""

from __future__ import annotations

import pytest

from bench.compile_counts import BACKWARD, BUNDLE, largest_difference, run


@pytest.fixture(scope="module")
def bare_graphs() -> int:
    return run("eager", None, steps=2).graphs


@pytest.mark.parametrize("interval, steps", [(1, 3), (5, 6)])
def test_backward_metrics_add_no_graph_break_or_recompile(interval: int, steps: int, bare_graphs: int) -> None:
    counts = run("eager", interval, steps=steps, bundle=BUNDLE + BACKWARD)
    assert (counts.graphs, counts.breaks, counts.recompiles, counts.warnings) == (bare_graphs, 0, 0, [])
    reference = run(None, interval, steps=steps, bundle=BUNDLE + BACKWARD).records
    due = [s for s in range(1, steps + 1) if s == 1 or s % interval == 0]
    assert [s for s, r in reference.items() if r] == due
    assert {key[0] for key in reference[due[-1]]} >= set(BACKWARD)
    assert largest_difference(counts.records, reference) == 0.0


def test_aot_autograd_backward_observes_as_eager() -> None:
    """Through AOT autograd the hook is part of the compiled backward graph."""
    counts = run("aot_eager", 5, steps=6, bundle=BACKWARD, model_name="tiny")
    assert (counts.graphs, counts.breaks, counts.recompiles, counts.warnings) == (1, 0, 0, [])
    reference = run(None, 5, steps=6, bundle=BACKWARD, model_name="tiny").records
    assert {key[0] for key in reference[5]} == set(BACKWARD)
    assert largest_difference(counts.records, reference) == 0.0
