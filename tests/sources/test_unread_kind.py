"""An observation of a kind no metric reads (a misspelled ``kind``) is dropped, and the logging
rank says so once, with the kinds observations feed; before, the router metrics only said
that nothing fed them. A kind the catalogue reads is never flagged: not on steps where its
metric is not due, nor in a run that configures no metric of it."""

from __future__ import annotations

import logging

import torch

import tmetrics_core as tm
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics


class Routed(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.router = torch.nn.Linear(4, 3)

    def forward(self, x):
        tm.observe(self, "router_logits", self.router(x), kind=self.kind)
        return x


class Model(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].moe = Routed(kind)  # its router: layers.0.moe.router.weight

    def forward(self, x):
        return self.layers[0].moe(x)


def test_a_misspelled_kind_is_said_once_with_the_kinds_read(caplog):
    model = Model("router_logit")
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-router-logits-l2"), 1)])
    with caplog.at_level(logging.WARNING, logger="tmetrics"):
        for step in (1, 2):
            with metrics.step(step):
                model(torch.randn(5, 4))
    said = [r.getMessage() for r in caplog.records if "no metric reads this kind" in r.getMessage()]
    assert len(said) == 1
    assert "kind='router_logit'" in said[0] and "'router_logits'" in said[0] and "Check the kind's spelling" in said[0]
    metrics.close()


def test_a_kind_read_on_other_steps_or_by_unconfigured_metrics_is_not_flagged(caplog):
    for names in (("layer-router-logits-l2",), ("global-param-l2", "layer-residual-accumulator-rms")):
        model = Model("router_logits")
        metrics = TensorMetrics(model, metrics=[(build_metric(n), 2) for n in names])
        with caplog.at_level(logging.WARNING, logger="tmetrics"):
            for step in (1, 2, 3):
                with metrics.step(step):
                    model(torch.randn(5, 4))
        assert "no metric reads this kind" not in caplog.text
        metrics.close()
