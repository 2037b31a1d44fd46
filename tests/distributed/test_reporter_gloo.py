"""Which rank speaks: with ``log_rank=1`` on a 2-rank gloo world, rank 1 says tmetrics'
warnings and rank 0 says none. Before the Reporter, three of them tested ``global_rank == 0``
and ignored ``distributed.log_rank``: the metric that found nothing to measure
(``TensorMetrics``), the observation of a kind no metric reads (``sources/tokens.py``) and the
residual stream found split by sequence (``sources/sequence_split.py``) were printed by rank 0.
Three more were said by every rank: an optional metric skipped (``scope/startup_checks.py``), a
config without sinks (``build.py``) and a Trainer tracker passed over (``integrations/hf.py``)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import tmetrics_core as tm
from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

D = 4
SAID = {"unfed": "found nothing to measure on any rank", "unread kind": "no metric reads this kind",
        "sequence split": "holds different tokens on the ranks of axis 'tp'",
        "optional skipped": "optional metric 'global-output-logits-l2' skipped"}


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> None:
        tm.observe(self, "router_logits", self.router(x), kind="router_logit")  # misspelled: read by no metric


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(D, D)
        self.moe = Routed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(x)
        self.moe(x)
        return x


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(rank: int, world: int, log_rank: int) -> dict[str, list[str]]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    topology = Topology.from_groups({"tp": dist.group.WORLD})
    handler = _Collect()
    logger = logging.getLogger("tmetrics")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        metrics = TensorMetrics(model, metrics=[(build_metric("layer-router-logits-l2"), 1),
                                                (build_metric("layer-residual-accumulator-rms"), 1),
                                                (build_metric("global-output-logits-l2"), 1)],  # no head here
                                topology=topology, log_rank=log_rank, timeout_s=60,
                                optional_metrics={"global-output-logits-l2"})
        for step in (1, 2):
            with metrics.step(step):  # different tokens on each rank: the residual stream is split
                model.layers[1](model.layers[0](torch.randn(3, D, generator=torch.Generator().manual_seed(rank))))
        metrics.close()
    finally:
        logger.removeHandler(handler)
        logger.level = level
    return {what: [m for m in handler.messages if text in m] for what, text in SAID.items()}


def test_only_the_log_rank_says_the_warnings():
    for log_rank in (1, 0):
        said = run_distributed(_run, 2, log_rank, timeout=120)
        quiet = said[1 - log_rank]
        assert quiet == {what: [] for what in SAID}, f"rank {1 - log_rank} spoke with log_rank={log_rank}"
        speaker = said[log_rank]
        assert {what: len(m) for what, m in speaker.items()} == {"unfed": 1, "unread kind": 1, "sequence split": 2,
                                                                 "optional skipped": 1}
        assert "metric 'layer-router-logits-l2' found nothing to measure on any rank at step 1" in speaker["unfed"][0]
        assert "kind='router_logit'" in speaker["unread kind"][0]


def _without_sinks(rank: int, world: int, log_rank: int, run_dir: str) -> tuple[list[str], str]:
    import torch.distributed as dist

    torch.manual_seed(0)  # the same parameters on both ranks: the replicas check at start-up passes
    handler = _Collect()
    logger = logging.getLogger("tmetrics")
    logger.addHandler(handler)
    try:
        metrics = TensorMetrics.from_config({"metrics": ["global-param-l2"], "distributed": {"log_rank": log_rank}},
                                            model=nn.Sequential(nn.Linear(D, D)), axes={"dp": dist.group.WORLD},
                                            run_dir=run_dir)
        hub = type(metrics.hub).__name__
        metrics.close()
    finally:
        logger.removeHandler(handler)
    return [m for m in handler.messages if "names no sinks" in m], hub


def test_only_the_log_rank_says_a_config_has_no_sinks_and_holds_the_hub(tmp_path):
    said = run_distributed(_without_sinks, 2, 1, str(tmp_path), timeout=120)
    assert [len(messages) for messages, _ in said] == [0, 1]
    assert [hub for _, hub in said] == ["NullHub", "SinkHub"]
