"""``read_results: next-step`` on one process and on 2 gloo ranks (DDP): the same records as
``now``, each delivered at the end of the next step scope (due or not) or at ``close()``."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed.harness import run_distributed

NAMES = {"layer-grad-l2": 1, "layer-update-ratio": 2, "global-grad-l2": 3, "layer-residual-accumulator-rms": 2}
D = 5


class _Hub:
    """Records each submission with the step scope that was open when it came."""

    def __init__(self) -> None:
        self.scope: int | None = None
        self.submitted: list[tuple[int | None, int, list]] = []

    def submit(self, records, step):
        self.submitted.append((self.scope, step, list(records)))

    def close(self, status):
        self.scope = "close"
        return ("report", status)


def _steps(rank, world, mode):
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    model, topology, wrapped = Net(3), None, None
    if world > 1:
        import torch.distributed as dist
        topology = Topology.from_groups({"dp": dist.group.WORLD})
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hub = _Hub()
    metrics = TensorMetrics(model, metrics=[(build_metric(n), i) for n, i in NAMES.items()], optimizer=opt,
                            topology=topology, hub=hub, timeout_s=30, read_results=mode)
    last = {}
    for step in range(1, 8):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, D, generator=g)
        part = x if world == 1 else x[rank * 2:(rank + 1) * 2]
        hub.scope = step
        with metrics.step(step):
            loss = (wrapped or model)(part).pow(2).sum() / (4 * 3 * D) * world
            loss.backward()
            opt.step()
            opt.zero_grad()
        last[step] = sorted({r.step for r in metrics.last_records})
    hub.scope = "close"
    metrics.close()
    assert metrics.failures == [], metrics.failures
    values = {(r.metric, r.step, r.layer, r.tensor, r.stat): r.value for _, _, rs in hub.submitted for r in rs}
    return [(scope, step) for scope, step, _ in hub.submitted], values, last


def _rank(rank, world, mode):
    return _steps(rank, world, mode)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_next_step_delivers_the_same_records_one_step_later(world):
    got = {mode: ([_steps(0, 1, mode)] if world == 1 else run_distributed(_rank, 2, mode, timeout=150))
           for mode in ("now", "next-step")}
    reference = _steps(0, 1, "now")[1]  # one process, read at once
    for mode, ranks in got.items():
        for when, values, last in ranks:
            assert values.keys() == reference.keys() and values
            for key, value in reference.items():
                assert values[key] == pytest.approx(value, rel=1e-5), (mode, key)
            # Steps 1 to 7 are all due (layer-grad-l2 every step): read at once, or at the end
            # of the next scope, the last one at close().
            if mode == "now":
                assert when == [(s, s) for s in range(1, 8)]
                assert last == {s: [s] for s in range(1, 8)}
            else:
                assert when == [(s + 1, s) for s in range(1, 7)] + [("close", 7)]
                assert last == {1: [], **{s: [s - 1] for s in range(2, 8)}}


def _sparse(mode):
    """Metrics due every 3 steps: a result waits for the end of the next scope, due or not."""
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = Net(2)
    hub = _Hub()
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-param-l2"), 3)], hub=hub, read_results=mode)
    for step in range(1, 8):
        hub.scope = step
        with metrics.step(step):
            model(torch.randn(2, 3, D)).sum().backward()
    hub.scope = "close"
    metrics.close()
    return [(scope, step) for scope, step, _ in hub.submitted]


def test_next_step_results_leave_at_the_next_scope_due_or_not():
    assert _sparse("now") == [(1, 1), (3, 3), (6, 6)]
    assert _sparse("next-step") == [(2, 1), (4, 3), (7, 6)]


def test_a_step_that_found_nothing_is_said_when_read_at_close(caplog):
    """The last due step, read at close() (no step scope open), found nothing to measure: the
    warning names the metric, as at the step's end."""
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = Net(2)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-grad-l2"), 1)], read_results="next-step")
    with metrics.step(1):
        model(torch.randn(2, 3, D))  # no backward: no gradient to read
    metrics.close()
    assert "metric 'layer-grad-l2' found nothing to measure on any rank at step 1" in caplog.text
    assert metrics.last_records == [] and metrics.failures == []


@pytest.mark.parametrize("mode", ["now", "next-step"])
def test_close_inside_a_step_scope_closes_after_that_step_is_logged(mode):
    """close() called inside the last step's scope returns None and takes effect at the scope's
    end: the optimizer hooks still run (the update is read), the step's records reach the sinks
    before they close, in both modes; close() after the scope returns that close's report; later
    steps raise."""
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.errors import TMetricsError
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = Net(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hub = _Hub()
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1)], optimizer=opt, hub=hub,
                            read_results=mode)
    for step in (1, 2):
        hub.scope = step
        with metrics.step(step):
            model(torch.randn(2, 3, D, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            if step == 2:
                assert metrics.close() is None
                assert hub.scope == 2  # not closed yet
            opt.step()
            opt.zero_grad()
    assert hub.scope == "close"
    assert metrics.close() == ("report", "finished")  # the report of the close at the scope's end
    assert [step for _, step, _ in hub.submitted] == [1, 2]
    assert all(r.value > 0 for _, _, rs in hub.submitted for r in rs) and len(hub.submitted[1][2]) == 2
    assert metrics.failures == []
    with pytest.raises(TMetricsError, match="after close"):
        metrics.observe_gradients()


def test_a_deferred_close_keeps_the_first_status_and_says_failed_when_the_body_raised():
    """Inside a scope the first close() status wins (as outside one); a body that raises after
    close("finished") ends the run "failed"; a scope whose entry raised leaves close() working."""
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    def run(body) -> list:
        model = Net(2)
        hub = _Hub()
        statuses = []
        hub.close = statuses.append
        metrics = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 1)], hub=hub)
        with pytest.raises(KeyError) if body == "raises" else contextlib.nullcontext():
            with metrics.step(1):
                model(torch.randn(2, 3, D))
                metrics.close("killed" if body == "twice" else "finished")
                metrics.close("finished")
                if body == "raises":
                    raise KeyError("the training loop's own error")
        metrics.close()
        return [statuses, [step for _, step, _ in hub.submitted]]

    assert run("twice") == [["killed"], [1]]
    assert run("raises") == [["failed"], []]
    model = Net(2)
    hub = _Hub()
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 1)], hub=hub)
    with pytest.raises(TypeError):
        with metrics.step("1"):  # type: ignore[arg-type]  # fails before the body runs
            pass
    metrics.close()
    assert hub.scope == "close"


def test_a_step_whose_entry_raised_changes_nothing():
    """A step number that cannot be used (here a str) raises before any state is set: the next
    scope is still the first step (every metric due there) and reads like one."""
    from tests.sources.test_token_row_buffer import Net
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = Net(2)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-l2"), 2)])
    with pytest.raises(TypeError):
        with metrics.step("1"):  # type: ignore[arg-type]
            pass
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(3))
    with metrics.step(3):  # not a multiple of 2: due only as the first step
        model(x)
    with torch.no_grad():
        h = model.layers[0](x)
    assert [(r.step, r.layer) for r in metrics.last_records] == [(3, 0), (3, 1)]
    assert metrics.last_records[0].value == pytest.approx(float(h.double().norm()), rel=1e-6)
    metrics.close()
