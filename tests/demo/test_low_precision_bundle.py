"""The demo's low-precision bundle config: it validates, and one step of a small demo model
measured with it writes every recipe's statistics per layer (weights, gradients, block outputs)
and the outlier-feature metrics per module."""

from __future__ import annotations

import math
from importlib import resources

import torch

from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.metrics.quant.metric import QUANT_STATS
from tmetrics_core.tensor_metrics import TensorMetrics

BUNDLE = resources.files("tmetrics_core.demo") / "low_precision.yaml"
SMALL = dict(d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=4, top_k=2, dense_layers=(1,), seq_len=16)


def test_bundle_measures_every_layer(tmp_path):
    parallel = parallelize(ModelConfig(**SMALL), ParallelDegrees(), seed=3, batch_size=4)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-3)
    metrics = TensorMetrics.from_config(str(BUNDLE), model=parallel.model, optimizer=optimizer, sinks=["jsonl"],
                                        run_dir=tmp_path)
    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    with metrics.step(1):
        parallel.forward_backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    records = metrics.last_records
    metrics.close()
    assert not metrics.failures
    by = {}
    for r in records:
        by.setdefault(r.metric, []).append(r)
    for name, recipes in (("layer-param-quant", ("mxfp8", "fp8-tensorwise", "nvfp4")),
                          ("layer-grad-quant", ("mxfp8", "fp8-tensorwise")),
                          ("layer-activation-quant", ("mxfp8", "fp8-tensorwise", "nvfp4"))):
        stats = {(r.labels.layer, r.labels.stat) for r in by[name]}
        assert stats == {(layer, f"{recipe}.{s}") for layer in (0, 1) for recipe in recipes for s in QUANT_STATS}
        sqnr = [r.value for r in by[name] if r.labels.stat.endswith("sqnr-db")]
        assert all(10.0 < v < 80.0 for v in sqnr), sqnr
    for name in ("layer-activation-channel-kurtosis", "layer-activation-outlier-ratio"):
        assert {r.labels.tensor for r in by[name]} >= {"layers.0.attn", "layers.0.moe", "layers.1.mlp"}
        assert all(math.isfinite(r.value) and r.value > 1.0 for r in by[name])
    assert (tmp_path / "metrics.jsonl").read_text().count("layer-param-quant/layer_01/nvfp4.underflow") == 1
