"""Megatron-Core in bf16 with its mixed-precision optimizer, run for real on 2 gloo ranks:
a bf16 ``GPTModel`` in Megatron's ``Float16Module`` and DDP (gradients reduced in fp32 in
``main_grad``), ``Float16OptimizerWithFloat16Params`` from ``get_megatron_optimizer(bf16=True)``
(fp32 main copies, stepped by Megatron), DP=2; and the same with its ``DistributedOptimizer``
(fp32 main params as flat shards over dp).

A bf16 run is not the one-process run to the last bit (bf16 matmuls over half the batch), so
each rank checks the records against the truth of the run itself, computed by hand from
Megatron's own tensors on every step: global-grad-l2 from the reduced ``main_grad``; the
layer update ratio from the **bf16 model weights** before and after the step (what tmetrics
reads as the parameters: the weights the forward uses, see docs/integrations/megatron.md);
the layer Adam-state RMS from the state of the **fp32 main params**. No placement, offset or hook is
written here; the shims are those of ``cpu_shims``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.megatron import cpu_shims, gpt  # noqa: E402

METRICS = ["global-grad-l2", "layer-update-ratio", "layer-optimizer-state-rms", "layer-param-l2"]
REL = 1e-6


def _layer(name: str) -> int | None:
    return int(name.split("decoder.layers.")[1].split(".")[0]) if "decoder.layers." in name else None


def _train(rank: int, world: int, distributed: bool, run_dir: str) -> list[tuple[str, float, float]]:
    """Two bf16 steps; ``[(what, tmetrics' value, hand value)]``."""
    cpu_shims.apply()
    cpu_shims.cuda_tensors_on_cpu()
    cpu_shims.cuda_type_names()
    import tmetrics_core as tm
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel()
    inner = gpt.build(bf16=True)
    model = DistributedDataParallel(
        config=inner.config, module=Float16Module(inner.config, inner),
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                       bf16=True, use_distributed_optimizer=distributed), [model])
    metrics = tm.TensorMetrics.from_config({"run": {"name": "bf16", "dir": run_dir}, "sinks": {}, "metrics": METRICS},
                                           model=model, optimizer=optimizer)
    named = [(n, p) for n, p in inner.named_parameters()]
    out = []
    for step in (1, 2):
        with metrics.step(step):
            model.zero_grad_buffer()
            gpt.train_step(model, *gpt.local_batch(step))
            finalize_model_grads([model])
            grads = [p.main_grad.double() for _, p in named]
            if distributed:  # only this rank's range is reduced: complete it for the hand norm
                grads = [g.clone() for g in grads]
                _all_reduce_owned(optimizer, named, grads)
            hand_grad = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            before = {n: p.detach().double().clone() for n, p in named}
            optimizer.step()
            optimizer.zero_grad()
        records = {(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}
        out.append((f"global-grad-l2 step {step}", records[("global-grad-l2", None, None)], hand_grad))
        for layer in sorted({_layer(n) for n, _ in named} - {None}):
            mine = [(n, p) for n, p in named if _layer(n) == layer]
            update = sum(float((p.detach().double() - before[n]).pow(2).sum()) for n, p in mine)
            param = sum(float(p.detach().double().pow(2).sum()) for _, p in mine)
            out.append((f"layer-update-ratio layer {layer} step {step}",
                        records[("layer-update-ratio", layer, None)], math.sqrt(update / param)))
            for kind in ("exp_avg", "exp_avg_sq"):
                sumsq, count = _state_sumsq(optimizer, [p for _, p in mine], kind)
                out.append((f"layer-optimizer-state-rms {kind} layer {layer} step {step}",
                            records[("layer-optimizer-state-rms", layer, kind)], math.sqrt(sumsq / count)))
    metrics.close()
    ps.destroy_model_parallel()
    return out


def _leaf(optimizer):
    (leaf,) = optimizer.chained_optimizers
    return leaf


def _all_reduce_owned(optimizer, named, grads) -> None:
    """Each rank keeps its owned range of every gradient, zeros elsewhere; a sum over the
    data-parallel group then gives the whole reduced gradient."""
    leaf = _leaf(optimizer)
    for (_, p), g in zip(named, grads):
        owned = torch.zeros_like(g).view(-1)
        if p in leaf.model_param_gbuf_map:
            r = leaf._get_model_param_range_map(p)["param"]
            owned[r.start:r.end] = g.view(-1)[r.start:r.end]
        torch.distributed.all_reduce(owned)
        g.copy_(owned.view_as(g))


def _state_sumsq(optimizer, params, kind: str) -> tuple[float, float]:
    """Sum of squares and element count of ``kind`` over ``params``' fp32 main copies (whole
    ones; or shards, summed over the data-parallel ranks)."""
    leaf = _leaf(optimizer)
    sharded = not hasattr(leaf, "fp32_from_float16_groups")
    pairs = (zip(leaf.float16_groups, leaf.fp32_from_float16_groups) if not sharded else
             zip(leaf.model_fp32_groups + leaf.model_float16_groups,
                 leaf.shard_fp32_groups + leaf.shard_fp32_from_float16_groups))
    mains = {id(m): s for models, copies in pairs for m, s in zip(models, copies)}
    sumsq = torch.zeros(1, dtype=torch.float64)
    for p in params:
        state = leaf.optimizer.state.get(mains.get(id(p), p), {})
        if kind in state:
            sumsq += state[kind].double().pow(2).sum()
    if sharded:
        torch.distributed.all_reduce(sumsq)
    return float(sumsq), float(sum(p.numel() for p in params))


def _both(rank: int, world: int, run_dir: str) -> dict[str, list[tuple[str, float, float]]]:
    return {name: _train(rank, world, distributed, f"{run_dir}/{name}")
            for name, distributed in (("float16_optimizer", False), ("distributed_optimizer", True))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_both, 2, str(tmp_path_factory.mktemp("megatron_bf16")), timeout=300)


@pytest.mark.parametrize("optimizer", ["float16_optimizer", "distributed_optimizer"])
def test_bf16_records_equal_megatrons_own_tensors(runs, optimizer):
    for rank, both in enumerate(runs):
        checks = both[optimizer]
        assert len(checks) == 2 * (1 + 2 * 3)  # per step: global grad L2; per layer: ratio, two state RMS
        worst = max(abs(got - want) / abs(want) for _, got, want in checks)
        print(f"bf16 {optimizer} rank {rank}: worst rel {worst:.2e} over {len(checks)} values")
        wrong = [(what, got, want) for what, got, want in checks if not math.isclose(got, want, rel_tol=REL)]
        assert not wrong, (rank, wrong[:5])
