"""What each gloo rank runs: Megatron cases trained for two steps with tmetrics attached by
the two lines a user writes, records returned by key. No placements, offsets or hooks here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests.integrations.megatron import cpu_shims, gpt

STEPS = 2
METRICS = ["global-grad-l2", "layer-param-l2", "layer-grad-l2", "layer-update-ratio", "tensor-grad-l2",
           "layer-optimizer-state-rms", "layer-residual-accumulator-l2", "layer-residual-contribution-l2"]
MOE_METRICS = METRICS + ["layer-expert-tokens", "layer-router-logits-l2"]


@dataclass(frozen=True)
class Case:
    """One layout: parallel degrees, Megatron's DDP wrapper, which optimizer."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    moe: bool = False
    sp: bool = False  # sequence parallel (Megatron needs it for MoE with tp > 1)
    ddp: bool = False
    optimizer: str = "torch"  # "torch" (Adam), "fp32" (FP32Optimizer), "chained" (ChainedOptimizer),
    # "distributed" (DistributedOptimizer from get_megatron_optimizer; implies Megatron's DDP)
    user_axes: bool = False  # pass axes={"dp": ..., "tp": ...} as the user did (they win)
    layers: int = gpt.LAYERS
    vpp: int = 1  # virtual pipeline chunks per stage (the model is then Megatron's list of chunks)
    micro_batches: int = 1  # one stage: as many micro-batches as Megatron's interleaved schedule runs


Key = tuple[str, int, Any, Any, Any, Any]


def run_cases(rank: int, world: int, cases: list[Case], run_dir: str) -> dict[str, dict[Key, float]]:
    """Train each case; return ``{case: {(metric, step, layer, expert, tensor, stat): value}}``
    of the logging rank's records (every rank returns its own for checking)."""
    cpu_shims.apply()
    from megatron.core import parallel_state as ps

    out = {}
    for case in cases:
        ps.initialize_model_parallel()
        full = gpt.full_weights(moe=case.moe, layers=case.layers)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
                                     virtual_pipeline_model_parallel_size=case.vpp if case.vpp > 1 else None,
                                     expert_model_parallel_size=case.ep)
        try:
            out[case.name] = _train(case, full, f"{run_dir}/{case.name}")
        finally:
            ps.destroy_model_parallel()
    return out


def _train(case: Case, full: dict[str, torch.Tensor], run_dir: str) -> dict[Key, float]:
    import tmetrics_core as tm

    if case.vpp > 1:
        cpu_shims.cuda_tensors_on_cpu()  # the interleaved schedule counts tokens in a "cuda" tensor
    model = gpt.build(tp=case.tp, pp=case.pp, ep=case.ep, moe=case.moe, sp=case.sp, layers=case.layers, vpp=case.vpp)
    for chunk in model if isinstance(model, list) else [model]:
        gpt.load_full(chunk, full)
    if case.ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=case.optimizer == "distributed")
        model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = _optimizer(case, model)
    cfg = {"run": {"name": case.name, "dir": run_dir}, "sinks": {},
           "metrics": MOE_METRICS if case.moe else METRICS}
    values: dict[Key, float] = {}
    axes = None
    if case.user_axes:
        from megatron.core import parallel_state as ps

        from tmetrics_core.errors import ConfigError

        try:  # without tp, Megatron's tensor-parallel weights cannot be placed: a clear error
            tm.TensorMetrics.from_config(cfg, model=model, optimizer=optimizer,
                                         axes={"dp": ps.get_data_parallel_group()})
        except ConfigError as exc:
            values[("error-without-tp", 0, None, None, None, str(exc)[:300])] = 1.0
        axes = {"dp": ps.get_data_parallel_group(), "tp": ps.get_tensor_model_parallel_group()}
    metrics = tm.TensorMetrics.from_config(cfg, model=model, optimizer=optimizer, axes=axes)
    for step in range(1, STEPS + 1):
        with metrics.step(step):
            if case.ddp:
                model.zero_grad_buffer()
            gpt.train_step(model, *gpt.local_batch(step), micro_batches=case.micro_batches)
            if case.ddp:
                finalize_model_grads([model])  # what Megatron's schedules call after the backward
            for name, p in _named(model):  # a replicated tensor of this very run, by hand
                if name.endswith("mlp.router.weight"):
                    layer = int(name.split("decoder.layers.")[1].split(".")[0])
                    grad = p.grad if p.grad is not None else p.main_grad
                    values[("hand-router-grad-l2", step, layer, None, None, None)] = float(grad.double().norm())
            if torch.distributed.get_world_size() == 1:  # the reference's own check, by hand
                grads = [g for _, p in _named(model) if (g := getattr(p, "main_grad", p.grad)) is not None]
                values[("hand-grad-l2", step, None, None, None, None)] = float(
                    torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
            optimizer.step()
            optimizer.zero_grad()
        for r in metrics.last_records:
            value = r.value if isinstance(r.value, (int, float)) else tuple(float(v) for v in r.value)
            values[(r.metric, step, r.layer, r.expert, r.tensor, r.stat)] = value
    metrics.close()
    return values


def _named(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [np for chunk in (model if isinstance(model, list) else [model]) for np in chunk.named_parameters()]


def _optimizer(case: Case, model: Any) -> Any:
    params = [p for _, p in _named(model)]
    if case.optimizer == "torch":
        return torch.optim.Adam(params, lr=1e-2)
    cpu_shims.cuda_tensors_on_cpu()
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig, get_megatron_optimizer

    if case.optimizer == "distributed":  # as Megatron's training loop builds it (Adam, no weight decay)
        cpu_shims.cuda_type_names()
        return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=0.0,
                                                      use_distributed_optimizer=True), [model])

    config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0, bf16=False, fp16=False)
    if case.optimizer == "fp32":
        return FP32Optimizer(torch.optim.Adam(params, lr=1e-2), config, None)
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    return ChainedOptimizer([FP32Optimizer(torch.optim.Adam(group, lr=1e-2), config, None)
                             for group in (dense, experts) if group])
