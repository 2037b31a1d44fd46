"""Tiny torchtitan 0.3.0 runs on CPU with gloo, parallelized by torchtitan's own functions.

CPU shims (test scaffolding only, from MACHINE-NOTES): SDPA inner attention instead of
FlexAttention (no backward on CPU), ``parallel_dims.device_type = "cpu"``, the model config's
``update_from_config`` called as torchtitan's Trainer calls it (fills the TP sharding specs), the
``partial_dtensor`` backend, and ``set_force_sum_reduction_for_comms(True)`` on every FSDP
module (FSDP2 otherwise asks gloo for ``PREMUL_SUM``). The loss is torchtitan's: the local sum of
token losses over the global token count, so summed gradients are the global mean's.

Pipeline parallel runs use torchtitan's ``pipeline_llm`` (its ``_pipeline_module_split`` keeps
the blocks a stage holds in the ``layers`` ModuleDict under their global ids) and the ``GPipe``
schedule from ``torch.distributed.pipelining``, with 2 microbatches of torchtitan's loss scaled
by the global token count, so the stages' gradients are the one-process run's.

Every run starts from the same full weights (a one-process model initialized with seed 0,
copied into the sharded parameters with ``distribute_tensor``) and sees the same global batch
(split across data-parallel ranks), so its norms equal the one-process run's.
"""

from __future__ import annotations

from typing import Any

import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.naming.canonical import canonicalize
from tmetrics_core.tensor_metrics import TensorMetrics

BATCH, SEQ = 4, 16
METRICS = ("global-grad-l2", "layer-grad-l2", "layer-param-l2", "tensor-grad-l2", "layer-residual-accumulator-l2",
           "layer-residual-contribution-rms")
MOE_METRICS = METRICS + ("layer-expert-tokens", "expert-grad-l2", "expert-param-l2")
QKV_SELECT = ["layers.*.attn.[qkv].*", "layers.*.attn.o.*"]
"""tensor-grad-l2 on the q/k/v views of the fused wqkv (the ``llama3-gqa`` runs)."""


def _spec(family: str):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if family == "llama3":
        from torchtitan.models.llama3 import model_registry

        spec = model_registry("debugmodel")
        spec.model.layers = spec.model.layers[:2]
    elif family == "llama3-gqa":  # 16 query heads over 4 key/value heads: wqkv rows in 4 groups of 6 heads
        from torchtitan.models.common.rope import ComplexRoPE
        from torchtitan.models.llama3 import _build_llama3_layers, model_registry

        spec = model_registry("debugmodel")
        spec.model.layers = _build_llama3_layers(
            n_layers=2, dim=256, n_heads=16, n_kv_heads=4, hidden_dim=768, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=16, max_seq_len=131072, theta=500000, scaling="llama"))
    else:
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry
        from torchtitan.models.common.rope import CosSinRoPE

        spec = model_registry("debugmodel_moe")
        spec.model.layers = _build_qwen3_moe_layers(
            n_layers=2, dim=256, n_heads=4, n_kv_heads=2, head_dim=32, moe_hidden_dim=32, num_experts=4, top_k=2,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=32, max_seq_len=4096, theta=1000000.0))
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


class Pipeline:
    """One rank's share of a pipeline-parallel run: torchtitan's schedule and whether this
    rank holds the first and the last stage."""

    def __init__(self, schedule: Any, first: bool, last: bool) -> None:
        self.schedule, self.first, self.last = schedule, first, last


def build(family: str, world: int, *, dp_shard: int = 1, tp: int = 1, ep: int = 1, dp_replicate: int = 1,
          pp: int = 1):
    """The model (this rank's stage under ``pp``) parallelized by torchtitan, its ParallelDims
    (None for one process), and the one-process full weights it was loaded with. With ``pp``
    the model carries its :class:`Pipeline` as ``model.pipeline``."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.trainer import Trainer

    parallel_dims_module.device_type = "cpu"
    set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does; its MoE dispatch reads it
    spec = _spec(family)
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, data_parallel_replicate_degree=dp_replicate,
                                    tensor_parallel_degree=tp, expert_parallel_degree=ep,
                                    pipeline_parallel_degree=pp, pipeline_parallel_schedule="GPipe",
                                    pipeline_parallel_microbatch_size=BATCH // 2, spmd_backend="partial_dtensor")
    config = Trainer.Config(model_spec=spec, parallelism=parallelism,
                            training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=3,
                                                           mixed_precision_param="float32", disable_cuda_graphs=True))
    spec.model.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"):
        full = spec.model.build()
    full.to_empty(device="cpu")
    with torch.no_grad():
        full.init_weights(buffer_device=None)
    weights = {n: p.detach().clone() for n, p in full.named_parameters()}
    if world == 1:
        return full, None, weights
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    if pp > 1:
        model = _pipeline(model, spec, dims, config)
    else:
        model = spec.parallelize_fn(model, parallel_dims=dims, training=config.training, parallelism=parallelism,
                                    compile_config=config.compile, ac_config=None, dump_folder="/tmp")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        _load(model, weights)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return model, dims, weights


def _pipeline(model: torch.nn.Module, spec: Any, dims: Any, config: Any) -> torch.nn.Module:
    """This rank's stage of ``model`` by torchtitan's ``pipeline_llm`` (one stage per rank)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=None, dump_folder="/tmp", device=torch.device("cpu"),
        model_config=spec.model, parallelize_fn=spec.parallelize_fn, loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()))
    (stage,) = parts
    stage.pipeline = Pipeline(schedule, first, last)
    return stage


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        full = weights[name]
        if isinstance(param, DTensor):
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
        else:
            param.copy_(full)


def _reference(name: str, views: dict[str, Any], modules: dict[str, torch.nn.Module], full: torch.Tensor
               ) -> torch.Tensor:
    """Entry ``name`` of a full stored tensor: its canonical view, or for the q/k/v views of a
    fused ``wqkv`` the rows torchtitan's own ``FusedQKVLinear`` gives q, k and v (its checkpoint
    split: ``[n_kv, heads_per_kv + 2, head_dim, dim]``, then ``[:, :h]``, ``[:, h]``, ``[:, h + 1]``)."""
    if name in views:
        return views[name].view(full)
    layer, part = name.split(".")[1], name.split(".")[3]
    qkv = modules[f"layers.{layer}.attention.qkv_linear"]
    h, hd = qkv.heads_per_kv, qkv.head_dim
    rows = full.reshape(-1, h + 2, hd, *full.shape[1:])
    return {"q": rows[:, :h].flatten(1, 2), "k": rows[:, h], "v": rows[:, h + 1]}[part]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: ``[BATCH, SEQ + 1]`` token ids."""
    return torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def local_rows(dims: Any) -> slice:
    """The rows of the global batch this rank trains on (split across the data-parallel ranks)."""
    if dims is None:
        return slice(0, BATCH)
    mesh = dims.get_optional_mesh("batch")
    if mesh is None:
        return slice(0, BATCH)
    n, r = mesh.size(), mesh.get_local_rank()
    return slice(r * BATCH // n, (r + 1) * BATCH // n)


def train(model: torch.nn.Module, dims: Any, steps: int = 2, *, metrics: TensorMetrics | None = None,
          config_dir: str | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps measured by tmetrics (built with no topology, placements or
    offsets given: ``from_config`` with torchtitan's ParallelDims); per step the records, the
    global grad norm of torchtitan's ``clip_grad_norm_`` (float32), the float64 norms of the
    full gradients (``full_tensor()``), whole and per canonical tensor, and torchtitan's tokens
    per expert."""
    import torch.distributed as dist
    from torchtitan.distributed.utils import clip_grad_norm_

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if metrics is None:
        names = MOE_METRICS if hasattr(next(iter(model.layers.values())), "moe") else METRICS
        gqa = names is METRICS and getattr(next(iter(model.layers.values())).attention.qkv_linear, "heads_per_kv", 1) > 1
        config = {"run": {"dir": config_dir or "/tmp/tmetrics-titan"}, "sinks": [],
                  "metrics": [{"name": n, "interval": 1, **({"select": QKV_SELECT} if gqa and n == "tensor-grad-l2" else {})}
                              for n in names]}
        metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer, mesh=dims)
    named = dict(model.named_parameters())
    views = {cn.name: cn for cn in canonicalize(named.items(), split_stacked=True)}
    modules = dict(model.named_modules())
    out = []
    groups: dict[str, int] = {}
    ep = dims is not None and dims.ep > 1
    pipeline = getattr(model, "pipeline", None)
    pp_mesh = dims.get_mesh("pp") if pipeline is not None else None
    for step in range(1, steps + 1):
        for module in model.modules():
            if hasattr(module, "tokens_per_expert_E"):
                module.tokens_per_expert_E.zero_()
        tokens = batch(step)[local_rows(dims)]
        with metrics.step(step):
            if pipeline is not None:
                pipeline.schedule.step(tokens[:, :-1] if pipeline.first else None,
                                       target=tokens[:, 1:] if pipeline.last else None,
                                       losses=[] if pipeline.last else None,
                                       loss_kwargs={"global_valid_tokens": torch.tensor(float(BATCH * SEQ))})
            else:
                logits = model(tokens[:, :-1])
                if hasattr(logits, "full_tensor"):
                    logits = logits.full_tensor()
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                         tokens[:, 1:].reshape(-1), reduction="sum") / (BATCH * SEQ)
                loss.backward()
            # Per canonical entry (one per expert of a stacked tensor: its slice of the full
            # gradient), and the whole model once per stored parameter.
            squares = {e.name: _reference(e.name, views, modules, _full(named[e.original].grad)).double().pow(2).sum().item()
                       for e in metrics.manifest.entries if e.original in named and named[e.original].grad is not None}
            for e in metrics.manifest.entries:  # the key/value-head groups this rank's q/k/v view holds
                if e.component in ("attn.q", "attn.k", "attn.v") and e.name in metrics.manifest.local:
                    grad = named[e.original].grad
                    mine = metrics.manifest.viewed(e.name, grad.to_local() if hasattr(grad, "to_local") else grad)
                    ref = _reference(e.name, views, modules, _full(grad))
                    groups[e.name] = next(g for g in range(ref.shape[0] - mine.shape[0] + 1)
                                          if torch.equal(ref[g:g + mine.shape[0]], mine))
            exact = torch.tensor(sum(_full(g).double().pow(2).sum().item()
                                     for g in (p.grad for p in named.values()) if g is not None), dtype=torch.float64)
            if pp_mesh is not None:  # the stages hold different parameters
                dist.all_reduce(exact, group=pp_mesh.get_group())
            exact = exact.item() ** 0.5
            norm = clip_grad_norm_([p for p in model.parameters()], 1e9, pp_mesh=pp_mesh, ep_enabled=ep)
            optimizer.step()
            optimizer.zero_grad()
        counts = {}
        for name, module in model.named_modules():
            if hasattr(module, "tokens_per_expert_E"):
                counts[int(name.split(".")[1])] = module.tokens_per_expert_E.detach().clone()
        out.append({"records": {(r.metric, r.layer, r.expert, r.tensor, r.stat): r.value for r in metrics.last_records},
                    "norm": float(_full(norm)), "exact": float(exact),
                    "tensor_exact": {name: value ** 0.5 for name, value in squares.items()},
                    "tokens_per_expert": counts,
                    "failures": [str(f) for f in metrics.failures]})
    metrics.close()
    return {"steps": out, "placements": sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()}),
            "views": {e.name: (e.shape, tuple((a, str(p)) for a, p in e.placements))
                      for e in metrics.manifest.entries if ".attn." in e.name},
            "first_group": groups}
