"""Low-precision and outlier-feature metrics on activations under ``torch.compile(fullgraph=True)``:
one graph, no break, and the same records as the eager run, bit for bit."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

NAMES = ("layer-activation-quant", "layer-activation-channel-kurtosis", "layer-activation-outlier-ratio")
MODULES = ("layers.*.mlp", "layers.*.attn", "layers.*.moe")


def _step(compiled: bool) -> dict:
    config = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=4, top_k=2, dense_layers=(1,),
                         seq_len=16)
    model = Transformer(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    built = [build_metric(n, recipe=["mxfp8", "fp8-tensorwise", "nvfp4"]) if "quant" in n else build_metric(n)
             for n in NAMES]
    metrics = TensorMetrics(model, metrics=[(m, 1) for m in built], optimizer=optimizer,
                            modules={n: MODULES for n in NAMES})
    run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with metrics.step(1):
        out = run(tokens[:, :-1])
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
    records = {(r.metric, r.layer, r.tensor, r.stat): r.value for r in metrics.last_records}
    metrics.close()
    assert not metrics.failures
    return records


def test_compiled_forward_one_graph_and_equal_records():
    counters.clear()
    compiled = _step(True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    eager = _step(False)
    assert {k[0] for k in eager} == set(NAMES) and compiled.keys() == eager.keys()
    assert all(compiled[k] == eager[k] or (eager[k] != eager[k] and compiled[k] != compiled[k]) for k in eager)
