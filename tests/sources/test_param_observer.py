"""The parameter side's cost follows the statistics, not the tensors: the torch ops one due step
issues (parameter side and the executor's reduction) are the same at 20 and at 200 parameter
tensors (every tensor read by batched torch ops, as on accelerators), with
gradients in the parameters' ``.grad`` or in a ZeRO-style flat buffer.

Views (``reshape`` of each tensor for the flat concatenation that non-finite counts read) are
one per tensor and launch no kernel: they are counted apart and only the other ops must match.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Axis, Topology

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-param-l2", "layer-update-ratio", "layer-grad-absmax",
           "layer-grad-nonfinite")
LAYERS = 4


class _Counting(TorchDispatchMode):
    """Counts the aten ops dispatched while active: compute ops and views apart."""

    def __init__(self) -> None:
        super().__init__()
        self.compute: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.is_view:
            self.views += 1
        else:
            self.compute[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Block(torch.nn.Module):
    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.parts = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3, 4) * 0.1) for _ in range(pieces))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((x @ p.t()).sum() for p in self.parts) + x.sum()


class _Net(torch.nn.Module):
    def __init__(self, per_layer: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(per_layer) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def _due_step_ops(per_layer: int, monkeypatch: Any, flat: bool = False
                  ) -> tuple[Counter[str], int, dict[tuple, float], dict[str, Any]]:
    """Ops of the third due step's tmetrics work (both phases, the snapshot, the step's end),
    its records, and float64 copies of that step's parameters before and after the update and
    of its gradients; counting wraps only tmetrics' calls, not the training ops. ``flat``: the
    gradients are also copied, before each optimizer step, into one flat buffer on a ``dp``
    axis of one rank (ZeRO's layout), from which tmetrics reads them."""
    torch.manual_seed(0)
    model = _Net(per_layer)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    buffer = torch.zeros(sum(p.numel() for p in params))
    extra: dict[str, Any] = {"flat_buffers": [FlatBuffer("grad", "dp", params, buffer, 0)],
                             "topology": Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1)
                             } if flat else {}
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in METRICS], optimizer=optimizer, **extra)
    counter = _Counting()
    active, inside = [False], [False]

    def counted(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not active[0] or inside[0]:  # counted once where these calls nest
                return original(*args, **kwargs)
            inside[0] = True
            try:
                with counter:
                    return original(*args, **kwargs)
            finally:
                inside[0] = False
        return run

    x = torch.randn(2, 4)
    with monkeypatch.context() as patch:
        patch.setattr(ParamObserver, "prepare", counted(ParamObserver.prepare))
        patch.setattr(ParamObserver, "take_snapshot", counted(ParamObserver.take_snapshot))
        patch.setattr(TensorMetrics, "_finish_step", counted(TensorMetrics._finish_step))
        for step in range(1, 4):
            active[0] = step == 3  # the plan is made on the first due step
            with metrics.step(step):
                model(x * step).backward()
                seen = {"before": [[p.detach().double().clone() for p in layer.parts] for layer in model.layers],
                        "grad": [[p.grad.double().clone() for p in layer.parts] for layer in model.layers]}
                buffer.copy_(torch.cat([p.grad.reshape(-1) for p in params]))
                optimizer.step()
                seen["after"] = [[p.detach().double().clone() for p in layer.parts] for layer in model.layers]
                optimizer.zero_grad()
    assert metrics.failures == []
    records = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
    metrics.close()
    return counter.compute, counter.views, records, seen


def _l2(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(t.pow(2).sum().item() for t in tensors))


@pytest.mark.parametrize("flat", [False, True], ids=["grad", "flat-buffer"])
def test_due_step_torch_ops_do_not_grow_with_the_tensor_count(monkeypatch, flat):
    small, small_views, records, seen = _due_step_ops(5, monkeypatch, flat)  # 20 parameter tensors
    large, large_views, _, _ = _due_step_ops(50, monkeypatch, flat)  # 200
    assert small == large, (small - large, large - small)
    assert sum(small.values()) < 60  # 43 measured: a few per statistic
    # On CPU no per-tensor view either (non-finite: a host check; a flat buffer's views of
    # its parts are made once, not per due step).
    assert small_views == large_views
    # The values of that step, against float64 references.
    grads, before, after = seen["grad"], seen["before"], seen["after"]
    assert records[("global-grad-l2", None, None)] == pytest.approx(_l2([g for layer in grads for g in layer]),
                                                                    rel=1e-9)
    for layer in range(LAYERS):
        assert records[("layer-grad-l2", layer, None)] == pytest.approx(_l2(grads[layer]), rel=1e-9)
        assert records[("layer-param-l2", layer, None)] == pytest.approx(_l2(before[layer]), rel=1e-9)
        update = _l2([a - b for a, b in zip(after[layer], before[layer])])
        assert records[("layer-update-ratio", layer, None)] == pytest.approx(update / _l2(after[layer]), rel=1e-6)
        assert records[("layer-grad-absmax", layer, None)] == max(g.abs().max().item() for g in grads[layer])
        assert records[("layer-grad-nonfinite", layer, "total")] == 0.0
