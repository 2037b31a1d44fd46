"""Router diagnostic families read a layer's top-k choices together with its logits: observed
through ``tm.observe`` in the demo model, one call per tensor, they equal the same metrics
prepared directly on both sites at once (the catalogue's tested path), and are finite."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.topology import Topology
from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.observe import observing
from tmetrics_core.reporter import Reporter
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.tokens import TokenObserver
from tmetrics_core.tensor_metrics import TensorMetrics

FAMILIES = ["layer-router-health", "layer-router-routing-balance", "layer-router-seq-aux-decomposition"]
CONFIG = dict(d_model=16, n_layers=2, n_heads=2, d_ff=12, n_experts=4, top_k=2, dense_layers=(1,), seq_len=8)


class _Capture(TokenObserver):
    """Keeps what the model observes (to prepare it the direct way)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kinds = frozenset({"router_logits", "router_topk"})
        self.seen = []

    def record(self, module, name, tensor, *, kind, shard_dim):
        x = tensor.detach().reshape(-1, tensor.shape[-1])
        path = self.index.path(module)
        self.seen.append((self._site(f"{path}.{name}", kind, x, shard_dim, path), x.clone()))


def test_families_observed_one_tensor_at_a_time_equal_direct_preparation():
    model = Transformer(ModelConfig(**CONFIG), seed=3)
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in FAMILIES])
    with metrics.step(1):
        model(batch)
    observed = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
    assert metrics.failures == []

    topology = Topology.single_process()
    capture = _Capture([], topology, ModuleIndex(model), num_experts=4, reporter=Reporter(topology))
    with observing(capture):
        model(batch)
    sites = [s for s, _ in capture.seen]
    prepared = prepare_states([build_metric(n) for n in FAMILIES], sites, [x for _, x in capture.seen], topology)
    results, failures = Executor(topology).run(prepared, {s.key: s for s in sites})
    direct = {(n, r.layer, r.stat): r.value for n, rs in results.items() for r in rs}
    assert failures == [] and direct.keys() == observed.keys()
    for key, value in direct.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(observed[key]), key
        else:
            assert observed[key] == pytest.approx(value, rel=1e-9), key
    assert math.isfinite(observed[("layer-router-seq-aux-decomposition", 0, "loss-mean")])
    assert observed[("layer-router-seq-aux-decomposition", 0, "loss-mean")] > 0
