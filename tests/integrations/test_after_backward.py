"""``AfterBackward``: the reader runs once per backward pass, after every gradient of the pass is
accumulated, only when asked, and again after a backward that raised half way."""

from __future__ import annotations

import pytest
import torch

from tmetrics_core.integrations.backward import AfterBackward


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``fail`` is set (after the head's gradient is in)."""

    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.fail:
            raise RuntimeError("out of memory (simulated)")
        return grad


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_reader_sees_every_gradient_of_the_pass_once():
    model = _model()
    seen: list[list[float]] = []
    ready = AfterBackward(model, when=lambda: True,
                          then=lambda: seen.append([float(p.grad.norm()) for p in model.parameters()]))
    x = torch.randn(5, 3)
    model(x).square().sum().backward()
    assert len(seen) == 1 and seen[0] == [float(p.grad.norm()) for p in model.parameters()]
    model(x).square().sum().backward()  # accumulates: the second reading is of the sums
    assert len(seen) == 2 and seen[1] == pytest.approx([2 * v for v in seen[0]], rel=1e-6)
    ready.remove()
    model(x).square().sum().backward()
    assert len(seen) == 2


def test_only_when_asked():
    model = _model()
    calls = []
    sync = {"now": False}
    AfterBackward(model, when=lambda: sync["now"], then=lambda: calls.append(1))
    model(torch.randn(2, 3)).sum().backward()
    assert calls == []
    sync["now"] = True
    model(torch.randn(2, 3)).sum().backward()
    assert calls == [1]


def test_a_backward_that_raised_does_not_stop_later_readings():
    model = _model()
    calls = []
    AfterBackward(model, when=lambda: True, then=lambda: calls.append(1))
    _FailOnce.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        model[1](_FailOnce.apply(model[0](torch.randn(2, 3)))).sum().backward()
    assert calls == []  # the head's gradient came in, then the pass failed
    _FailOnce.fail = False
    model(torch.randn(2, 3)).sum().backward()
    assert calls == [1]
