"""Under ``torch.compile(model, fullgraph=True)`` tmetrics adds no graph, no graph break, no
recompile and no warning, whatever its cadence, and its records equal the uncompiled run's.

The model is the demo MoE transformer with the demo's bundle (residual, output-logit and router
metrics observed in the forward; gradient and parameter norms around it): see
``bench/compile_counts.py``, which prints the same counts as a table."""

from __future__ import annotations

import math

import pytest
import torch

from bench.compile_counts import largest_difference, run
from tmetrics_core.observe import fail, fail_unless, observe, observing, record, record_residual, register_modules

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


def test_inductor_same_graphs_no_break_no_recompile_and_records_within_rounding() -> None:
    """A smaller model (embedding, two blocks of only the demo's MoE layer, head) and one
    cadence: inductor's C++ compilation takes most of this test's time."""
    interval, steps = CADENCES["every 5"]
    counts = run("inductor", interval, steps=steps, model_name="tiny")
    assert (counts.graphs, counts.breaks, counts.recompiles, counts.warnings) == (1, 0, 0, [])
    reference = run(None, interval, steps=steps, model_name="tiny").records
    assert any(key[0] == "layer-residual-contribution-rms" for key in reference[5])
    difference = largest_difference(counts.records, reference)
    assert math.isfinite(difference) and difference < 1e-4  # fused kernels round differently


class _Observer:
    """Records what reaches the observer (the protocol of ``tmetrics_core.observe.Observer``)."""

    kinds = frozenset({"activation", "router_logits", "residual_accumulator"})
    kept = frozenset({"router_logits"})

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.tensors: list[torch.Tensor] = []

    def record(self, module, name, tensor, *, kind, shard_dim, minus=None):
        self.seen.append((module, name, kind, shard_dim, minus))
        self.tensors.append(tensor.detach().clone())

    def record_residual(self, module, h, x, *, accumulator):
        self.seen.append((module, "residual", accumulator, x))
        self.tensors.append(h.detach().clone())

    def fail(self, reason, kinds=None):
        self.seen.append(("fail", reason))

    def fail_unless(self, ok, reason, kinds=None):
        self.seen.append(("fail_unless", bool(ok), reason, kinds))


def test_each_call_reaches_the_observer_from_a_compiled_graph_as_from_eager() -> None:
    """Through AOT autograd (``aot_eager``): the operators, which have no output, are kept in
    order; the module is found from its id; a kind not watched, and a residual whose
    contribution is not watched, are filtered as in eager."""
    inner = torch.nn.Linear(3, 3)
    register_modules([inner])

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = inner(x)
        observe(inner, "a", h, kind="activation", shard_dim=1)
        observe(inner, "b", h, kind="logits")  # not watched
        record(inner, "r", h * 2, kind="router_logits", shard_dim=None)
        record_residual(inner, h, x, accumulator=True)
        fail("why")
        fail_unless((h > 1e9).all(), "never", frozenset({"router_topk"}))  # a device flag: no host read here
        return h.relu()

    x = torch.randn(4, 3, requires_grad=True)
    runs = []
    for fn in (forward, torch.compile(forward, backend="aot_eager", fullgraph=True)):
        observer = _Observer()
        with observing(observer):
            fn(x).sum().backward()
        runs.append(observer)
    eager, compiled = runs
    assert compiled.seen == eager.seen == [(inner, "a", "activation", 1, None), (inner, "r", "router_logits", None, None),
                                           (inner, "residual", True, None), ("fail", "why"),
                                           ("fail_unless", False, "never", frozenset({"router_topk"}))]
    assert all(torch.equal(a, b) for a, b in zip(compiled.tensors, eager.tensors)) and len(compiled.tensors) == 3
