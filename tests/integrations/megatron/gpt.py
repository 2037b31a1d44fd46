"""A tiny Megatron-Core GPT (2 layers, hidden 64, 4 heads, vocab 256; MoE: 4 experts, top-2,
SequentialMLP), its data, and one training step as a Megatron user writes it.

Every run starts from the weights of one seeded one-process model (:func:`full_weights`),
sliced the way Megatron lays them out (:func:`load_full`), so the sharded run and the
one-process reference train the same model on the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 8, 4
EXPERTS, TOPK = 4, 2
SEED = 1234


def config(*, tp: int = 1, pp: int = 1, ep: int = 1, moe: bool = False, sp: bool = False, bf16: bool = False,
           layers: int = LAYERS, vpp: int = 1) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict[str, Any] = {}
    if moe:
        extra = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type="allgather",
                     moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_router_load_balancing_type="none",
                     add_bias_linear=False)
    return TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        bias_activation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, sequence_parallel=sp, bf16=bf16,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        **extra)


def build(*, tp: int = 1, pp: int = 1, ep: int = 1, moe: bool = False, sp: bool = False,
          bf16: bool = False, layers: int = LAYERS, vpp: int = 1) -> Any:
    """The GPTModel of this rank (parallel state must be initialized); ``bf16``: its weights in
    bfloat16 (wrap it in Megatron's ``Float16Module``); ``vpp`` > 1: the list of this rank's
    virtual pipeline chunks, built by Megatron with ``vp_stage``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(SEED)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, moe_grouped_gemm=False)
    cfg = config(tp=tp, pp=pp, ep=ep, moe=moe, sp=sp, bf16=bf16, layers=layers, vpp=vpp)
    if vpp == 1:
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                        share_embeddings_and_output_weights=False)
    return [GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                     share_embeddings_and_output_weights=False, vp_stage=v) for v in range(vpp)]


def full_weights(*, moe: bool = False, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """The one-process model's parameters (call with parallel state of size 1 everywhere)."""
    model = build(moe=moe, layers=layers)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy ``full`` into this rank's model as Megatron lays it out: tensor-parallel weights
    cut along ``partition_dim``, this stage's layers, this expert-parallel rank's experts."""
    from megatron.core import parallel_state as ps

    layer_offset = _first_layer(model)
    for name, p in model.named_parameters():
        key = _global_name(name, model, layer_offset)
        value = full[key]
        if getattr(p, "tensor_model_parallel", False):
            expert = not getattr(p, "allreduce", True)
            size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
            rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            value = torch.chunk(value, size, dim=p.partition_dim)[rank]
        with torch.no_grad():
            p.copy_(value)


def _first_layer(model: torch.nn.Module) -> int:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    return layers[0].layer_number - 1 if layers else 0


def _global_name(name: str, model: torch.nn.Module, layer_offset: int) -> str:
    from megatron.core import parallel_state as ps

    parts = name.removeprefix("module.").split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        local = EXPERTS // ps.get_expert_model_parallel_world_size()
        parts[i] = str(int(parts[i]) + ps.get_expert_model_parallel_rank() * local)
    return ".".join(parts)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens and labels ``[BATCH, SEQ]``."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the global batch."""
    from megatron.core import parallel_state as ps

    tokens, labels = batch(step)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return tokens.chunk(dp)[rank], labels.chunk(dp)[rank]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss of the local rows (Megatron's DDP averages gradients over data-parallel
    ranks, so they are the full batch's)."""
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.tril(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool)).logical_not()
    out = model(tokens, position_ids, mask, labels=labels)
    return out.float().mean()


def train_step(model: Any, tokens: torch.Tensor, labels: torch.Tensor, micro_batches: int = 1) -> None:
    """Forward and backward of one batch, pipelined by hand over two stages when pp = 2 (stage
    0 sends its output, stage 1 sends back its input's gradient); virtual pipeline chunks (a
    list) by Megatron's interleaved schedule (two micro-batches). ``micro_batches`` (one
    stage): the rows in that many micro-batches, each loss divided by their count and the
    gradients accumulated in order, as Megatron's schedules do."""
    from megatron.core import parallel_state as ps

    if isinstance(model, list):
        _interleaved_step(model, tokens, labels)
        return
    unwrapped = getattr(model, "module", model)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        for t, lab in zip(tokens.chunk(micro_batches), labels.chunk(micro_batches)):
            (loss_of(model, t, lab) / micro_batches).backward()
        return
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    shape = (tokens.shape[1], tokens.shape[0], HIDDEN)
    if ps.is_pipeline_first_stage():
        unwrapped.set_input_tensor(None)
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        mask = torch.tril(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool)).logical_not()
        hidden = model(tokens, position_ids, mask)
        dist.send(hidden.detach().contiguous(), ranks[1], group=group)
        grad = torch.empty(shape)
        dist.recv(grad, ranks[1], group=group)
        hidden.backward(grad)
    else:
        hidden = torch.empty(shape)
        dist.recv(hidden, ranks[0], group=group)
        hidden.requires_grad_(True)
        unwrapped.set_input_tensor(hidden)
        loss_of(model, tokens, labels).backward()
        dist.send(hidden.grad.contiguous(), ranks[0], group=group)


def _interleaved_step(chunks: list, tokens: torch.Tensor, labels: torch.Tensor) -> None:
    """Forward and backward through virtual pipeline chunks with Megatron's own interleaved
    1F1B schedule (``get_forward_backward_func``), two micro-batches of this rank's rows (each
    loss a mean, which the schedule divides by the micro-batch count: the batch mean)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = tokens.shape[0] // 2

    def micro_batches():
        for i in range(0, tokens.shape[0], rows):
            yield tokens[i:i + rows], labels[i:i + rows]

    def forward_step(data, chunk):
        t, lab = next(data)
        position_ids = torch.arange(t.shape[1]).expand_as(t)
        mask = torch.tril(torch.ones(1, 1, t.shape[1], t.shape[1], dtype=torch.bool)).logical_not()
        return chunk(t, position_ids, mask, labels=lab), lambda out: (out.float().mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=[micro_batches() for _ in chunks],
                                model=chunks, num_microbatches=2, seq_length=tokens.shape[1], micro_batch_size=rows)
