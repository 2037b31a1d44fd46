"""The step scope of ``TensorMetrics`` itself: which steps are due (every ``interval``-th and
the first), what a due step records (values against float64 references of the same tensors),
what the scope refuses and when, ``close()`` (idempotent, deferred inside a scope, status from
the context manager) and the calls refused after it."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from tmetrics_core.errors import ConfigError, TMetricsError
from tmetrics_core.hub.sink_hub import NullHub
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.records import MetricRecord
from tmetrics_core.tensor_metrics import TensorMetrics


class _Hub(NullHub):
    """Keeps what the sinks would get: the records per step and the close status."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, list[MetricRecord]]] = []
        self.closed: list[str] = []

    def submit(self, records, step):
        self.submitted.append((step, list(records)))

    def close(self, status="finished", *, timeout=None):
        self.closed.append(status)
        return super().close(status)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    return model


def _forward(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
    return model.layers[1](torch.tanh(model.layers[0](x))).square().sum()


def _tracked(**kwargs) -> tuple[nn.Module, torch.optim.Optimizer, TensorMetrics, _Hub]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hub = _Hub()
    metrics = TensorMetrics(model, optimizer=optimizer, hub=hub, **kwargs,
                            metrics=[(build_metric("global-param-l2"), 3), (build_metric("layer-grad-l2"), 2)])
    return model, optimizer, metrics, hub


def _l2(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


def test_due_steps_record_the_float64_values_of_what_the_optimizer_steps_with():
    model, optimizer, metrics, hub = _tracked()
    want = {}
    for step in range(1, 8):
        with metrics.step(step):
            _forward(model, step).backward()
            # What the optimizer's pre-hook reads: the parameters before the update, their gradients.
            want[step] = {("global-param-l2", None): _l2(model.parameters()),
                          **{("layer-grad-l2", i): _l2(p.grad for p in block.parameters())
                             for i, block in enumerate(model.layers)}}
            optimizer.step()
            optimizer.zero_grad()
    metrics.close()
    # Step 1 (the first) runs every metric; then global-param-l2 every 3rd, layer-grad-l2 every 2nd.
    due = {1: {"global-param-l2", "layer-grad-l2"}, 2: {"layer-grad-l2"}, 3: {"global-param-l2"},
           4: {"layer-grad-l2"}, 6: {"global-param-l2", "layer-grad-l2"}}
    assert [step for step, _ in hub.submitted] == sorted(due)
    for step, records in hub.submitted:
        assert all(r.step == step for r in records)
        got = {(r.metric, r.layer): r.value for r in records}
        assert {m for m, _ in got} == due[step]
        assert got == {k: pytest.approx(v, rel=1e-6) for k, v in want[step].items() if k[0] in due[step]}
    assert metrics.last_records == hub.submitted[-1][1]
    assert metrics.failures == []


def test_the_step_scope_refuses_what_it_cannot_measure():
    model, optimizer, metrics, _ = _tracked()
    for bad in (1.0, True, "3"):
        with pytest.raises(TypeError, match="step must be an int, the number of the optimizer step"):
            with metrics.step(bad):  # type: ignore[arg-type]
                pass
    with pytest.raises(TMetricsError, match="before the first step scope: pass step="):
        metrics.log({"loss": 1.0})
    with pytest.raises(TMetricsError, match="observe_gradients\\(\\) called outside a step scope"):
        metrics.observe_gradients()
    with metrics.step(2):
        with pytest.raises(TMetricsError, match=r"metrics.step\(3\) entered inside the scope of step 2: step "
                                                "scopes do not nest"):
            with metrics.step(3):
                pass
        _forward(model, 2).backward()
        optimizer.step()
    for again in (2, 1):  # step 2 was due (the first): steps must increase past it
        with pytest.raises(TMetricsError, match=rf"metrics.step\({again}\) entered after step 2 was measured"):
            with metrics.step(again):
                pass
    with metrics.step(3):  # not due (global-param-l2 every 3rd is; the refused scopes left no state)
        _forward(model, 3).backward()
        optimizer.step()
    assert {r.metric for r in metrics.last_records} == {"global-param-l2"}
    metrics.close()


def test_close_is_idempotent_and_every_call_after_it_is_refused():
    _, _, metrics, hub = _tracked()
    report = metrics.close()
    assert report.status == "finished" and metrics.close("failed") is report and hub.closed == ["finished"]
    for call, message in ((lambda: metrics.step(4).__enter__(), r"TensorMetrics.step\(4\) called after close\(\)"),
                          (lambda: metrics.log({"loss": 1.0}, step=4), r"TensorMetrics.log\(...\) called after"),
                          (metrics.observe_gradients, r"TensorMetrics.observe_gradients\(\) called after")):
        with pytest.raises(TMetricsError, match=message):
            call()


def test_close_inside_a_scope_closes_at_its_end_after_measuring_the_step():
    for raises, status in ((False, "finished"), (True, "failed")):
        model, optimizer, metrics, hub = _tracked()
        with pytest.raises(RuntimeError) if raises else contextlib.nullcontext():
            with metrics.step(1):
                _forward(model, 1).backward()
                optimizer.step()
                assert metrics.close() is None and hub.closed == []
                if raises:
                    raise RuntimeError("the training loop's own error")
        assert hub.closed == [status]
        # The step was measured before the close when its body completed; not when it raised.
        assert [s for s, _ in hub.submitted] == ([] if raises else [1])
        assert metrics.close().status == status


def test_the_context_manager_closes_with_the_status_of_how_its_block_ended():
    for error, status in ((None, "finished"), (ValueError, "failed"), (KeyboardInterrupt, "killed")):
        _, _, metrics, hub = _tracked()
        with pytest.raises(error) if error else contextlib.nullcontext():
            with metrics as entered:
                assert entered is metrics
                if error:
                    raise error()
        assert hub.closed == [status]


def test_bad_arguments_are_refused_when_the_object_is_built():
    model = _model()
    with pytest.raises(ConfigError, match=r"run.read_results: read_results='later'; need one of now, next-step"):
        TensorMetrics(model, metrics=[], read_results="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"grad_divisor: grad_divisor=0; need an int >= 1"):
        TensorMetrics(model, metrics=[], grad_divisor=0)
    with pytest.raises(ConfigError, match=r"grad_scaler: grad_scaler= needs optimizer="):
        TensorMetrics(model, metrics=[], grad_scaler=torch.amp.GradScaler("cpu"))
