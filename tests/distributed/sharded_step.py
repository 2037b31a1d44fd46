"""One training step of the tiny demo model under a topology, measured by TensorMetrics.

Module-level functions so spawned ranks can import them. Returns, per case, the records of
``global-grad-l2``, ``layer-param-l2`` and ``layer-grad-l2`` (and a few more) as plain data.
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import parallelize
from tmetrics_core.demo.degrees import ParallelDegrees as DemoTopology
from tmetrics_core.metrics.norms import AbsMax, L2Norm, Rms
from tmetrics_core.tensor_metrics import TensorMetrics

TINY: dict[str, Any] = dict(d_model=16, n_layers=2, n_heads=2, d_ff=12, n_experts=4, top_k=2, dense_layers=(1,),
                            seq_len=16)
UNEVEN: dict[str, Any] = dict(d_model=16, n_layers=2, n_heads=2, d_ff=9, n_experts=3, top_k=2, dense_layers=(1,),
                              seq_len=16)
BATCH = 8


def metric_set() -> list:
    return [
        (L2Norm(name="global-grad-l2", source_kinds=["grad"]), 1),
        (L2Norm(name="layer-param-l2", source_kinds=["param"], scope="layer"), 1),
        (L2Norm(name="layer-grad-l2", source_kinds=["grad"], scope="layer"), 1),
        (AbsMax(name="layer-grad-absmax", source_kinds=["grad"], scope="layer"), 1),
        (L2Norm(name="tensor-grad-l2", source_kinds=["grad"], scope="tensor"), 1),
        (Rms(name="layer-residual-accumulator-rms", source_kinds=["residual_accumulator"], scope="layer"), 1),
        (Rms(name="layer-router-logits-rms", source_kinds=["router_logits"], scope="layer"), 1),
    ]


def one_step(topology: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Build, measure one step (forward, backward, AdamW step) and return records and torch's
    own global grad norm computed by the demo's exact clip (for a cross-check)."""
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (BATCH, config["seq_len"] + 1), generator=torch.Generator().manual_seed(11))
    parallel = parallelize(ModelConfig(**config), DemoTopology(**topology), seed=3, batch_size=BATCH)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-3)
    topo = Topology.from_mesh(parallel.mesh) if parallel.mesh is not None else Topology.single_process()
    metrics = TensorMetrics(parallel.model, metrics=metric_set(), optimizer=optimizer, topology=topo, timeout_s=30)
    with metrics.step(1):
        parallel.forward_backward(batch)
        torch_norm = parallel.clip_grad_norm_(None)
        optimizer.step()
        optimizer.zero_grad()
    records = {(r.metric, r.layer, r.tensor, r.stat): r.value for r in metrics.last_records}
    metrics.close()
    return {"records": records, "torch_norm": torch_norm, "failures": [f.metric for f in metrics.failures]}


def run_cases(rank: int, world: int, cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    return {name: one_step(topology, config) for name, topology, config in cases}
