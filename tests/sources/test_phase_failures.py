"""A source whose read fails in a phase fails the metrics reading it, and only them: a metric of
another source of that phase that finds nothing to measure (no gradient anywhere) writes no
record and is said unfed, as on a step where no read failed, never a record of zeros; a gradient
whose read failed is not said missing."""

from __future__ import annotations

import logging

import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


def test_a_failed_read_leaves_the_other_sources_metrics_unfed_not_zero(caplog):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("layer-param-l2", "layer-grad-l2")])
    reads = metrics.params.reads
    real = reads.read

    def broken(failing):
        def read(source, entries, snapshot):
            if source == failing:
                raise RuntimeError(f"injected in {failing}")
            return real(source, entries, snapshot)
        return read
    out = []
    for step, read in ((1, broken("param")), (2, broken("grad")), (3, real)):
        reads.read = read  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING), metrics.step(step):
            pass  # no backward: no gradient anywhere
        out.append(({(r.metric, r.layer) for r in metrics.last_records}, set(metrics.params.unfed),
                    sorted(metrics.params.no_grad)))
    metrics.close()
    params = {("layer-param-l2", 0), ("layer-param-l2", 1)}
    names = sorted(e.name for e in reads.manifest.entries)
    assert out[0] == (set(), {"layer-grad-l2"}, names)  # param failed; no gradient: grad-l2 unfed
    assert out[1] == (params, set(), [])  # grad failed: no gradient said missing
    assert out[2] == (params, {"layer-grad-l2"}, names)
    assert [(f.metric, f.error.split(": ")[-1]) for f in metrics.failures] == [
        ("layer-param-l2", "injected in param"), ("layer-grad-l2", "injected in grad")]
    assert any("'layer-grad-l2' found nothing to measure" in r.getMessage() for r in caplog.records)
