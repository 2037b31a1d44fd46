"""Apply a :class:`ParallelDegrees` to the demo model, and run one exact forward/backward on it.

What each rank holds, and how gradients come to equal single-process training on the global
batch (loss = mean cross-entropy over all tokens of the global batch):

- **Data parallel** (``dp``): every rank computes the mean loss of its rows; gradients are
  averaged over ``dp`` by ``DistributedDataParallel``. With tensor parallelism too, DDP cannot
  hold DTensor parameters, so the FSDP2-based ``replicate`` (same averaging; parameters become
  DTensors ``(Replicate() on dp, Shard on tp)``) takes its place.
- **FSDP2** (``--fsdp``): ``fully_shard`` on every block, then on the root, over ``dp`` (or the
  2-D ``dp_rep`` x ``dp_shard`` mesh for HSDP); parameters and gradients are DTensor ``Shard(0)``
  and reduce-scatter averages the gradients.
- **Tensor parallel** (``tp``): ``parallelize_module`` splits ``q``, ``k``, ``v``, ``gate``,
  ``up``/``fc1`` by columns (whole heads per rank) and ``o``, ``down``/``fc2`` by rows; norms,
  embedding, router and head stay replicated (their gradients are equal on every ``tp`` rank).
  Experts then run on all tokens, unrouted ones at gate weight 0 (``fixed_shape_dispatch``):
  token counts per expert change every step, and DTensor re-plans every op whose input shape is
  new (about 3x slower per step than the fixed shapes, measured on the default model).
- **Expert parallel** (``ep``): each rank owns ``n_experts / ep`` experts (global indices) and its
  own rows of the batch. Each MoE block routes its own tokens, all-gathers tokens, choices and
  gate weights over ``ep`` (autograd-aware), runs its local experts on all tokens and
  reduce-scatters the sum back. The non-expert parameters are DDP-averaged over ``ep``; an
  expert's gradient arrives summed over the ``ep`` ranks' losses, so a post-accumulate hook
  divides it by ``ep``.
- **Pipeline** (``pp``): stage ``s`` owns contiguous layers (the first also ``embed``, the last
  ``final_norm`` and ``head``). The schedule is GPipe with one micro-batch: stage ``s`` receives
  its input from ``s - 1``, runs forward, sends the output on; the last stage computes the loss
  and backward; each stage sends the gradient of its input back to ``s - 1`` (blocking
  point-to-point on the ``pp`` group). Exact, with no overlap between stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from tmetrics_core.demo.expert_collectives import all_gather, reduce_scatter
from tmetrics_core.demo.model import Attention, ModelConfig, MoE, Transformer, fixed_shape_dispatch
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.errors import ConfigError
from tmetrics_core import torch_private

__all__ = ["ExpertParallelDispatch", "FullTensors", "ParallelModel", "parallelize"]


class ExpertParallelDispatch:
    """MoE dispatch over an expert-parallel group; equal token counts on every rank.

    ``tokens`` [N, d], ``topk_idx`` [N, k], ``weights`` [N, k] of this rank are all-gathered to
    [ep * N, ...]; the local experts' weighted outputs [ep * N, d] are reduce-scattered (sum) so
    each rank gets back [N, d] for its own tokens. Both collectives are autograd-aware, so
    gradients of tokens and gate weights return to the rank that owns them.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, moe: MoE, tokens: torch.Tensor, topk_idx: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        all_tokens = all_gather(tokens, self.group)        # (ep*N, d)
        all_weights = all_gather(weights, self.group)      # (ep*N, k)
        all_idx = all_gather(topk_idx, self.group)         # (ep*N, k)
        return reduce_scatter(moe.expert_outputs(all_tokens, all_idx, all_weights), self.group)


@dataclass(frozen=True, slots=True)
class FullTensors:
    """A parameter and its gradient, unsharded (full logical shape), on CPU."""

    param: torch.Tensor
    grad: torch.Tensor | None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    config = model.config
    col: tuple[str, ...] = ("gate", "up")
    row = "down"
    if config.activation == "gelu":
        col, row = ("fc1",), "fc2"
    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(),
        }
        mlps = ["mlp"]
        moe = getattr(block, "moe", None)
        if isinstance(moe, MoE):
            moe.dispatch = fixed_shape_dispatch
            mlps = [f"moe.experts.{e}" for e in moe.experts]
        for prefix in mlps:
            plan.update({f"{prefix}.{name}": ColwiseParallel() for name in col})
            plan[f"{prefix}.{row}"] = RowwiseParallel()
        parallelize_module(block, tp_mesh, plan)
        attn = block.attn
        assert isinstance(attn, Attention), "every demo block has its Attention at .attn"
        attn.heads_split = True  # q, k hold this rank's heads: their attn_qk sites say so


def _apply_expert_parallel(model: Transformer, ep_mesh: DeviceMesh) -> list[str]:
    """Install the all-gather dispatch and the 1/ep gradient hooks; return the expert param names."""
    dispatch = ExpertParallelDispatch(ep_mesh.get_group())
    scale = 1.0 / ep_mesh.size()

    def average_over_ep(param: torch.Tensor) -> None:
        assert param.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
        param.grad.mul_(scale)

    names = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            module.dispatch = dispatch
            for pname, param in module.experts.named_parameters():
                param.register_post_accumulate_grad_hook(average_over_ep)
                names.append(f"{name}.experts.{pname}")
    return names


def _apply_data_parallel(model: Transformer, topology: ParallelDegrees, mesh: DeviceMesh,
                         expert_names: list[str]) -> nn.Module:
    if topology.fsdp:
        dp_mesh = mesh[topology.dp_axes]                                  # 1-D, or 2-D for HSDP
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    if topology.dp > 1 and topology.tp > 1:
        # DDP rejects DTensor parameters; FSDP2's replicate mode takes them.
        torch_private.replicate_with_fsdp()(model, mesh=mesh["dp"])
        return model
    data_axis = "dp" if topology.dp > 1 else "ep" if topology.ep > 1 else None
    if data_axis is None:
        return model
    # Experts are owned per ep rank, not replicated: DDP must leave their gradients alone.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    return DistributedDataParallel(model, process_group=mesh[data_axis].get_group())


def parallelize(config: ModelConfig, topology: ParallelDegrees, *, seed: int, batch_size: int) -> ParallelModel:
    """Build this rank's part of the demo model and apply ``topology`` to it.

    Every rank builds its own layers and experts from ``seed`` (values depend only on the seed
    and the canonical name), then shards them. Needs an initialised default process group when
    ``topology.world_size > 1``; ``batch_size`` is the GLOBAL batch (sequences per step).

    Raises:
        ConfigError: the topology does not fit the world size, model or batch (see
            :meth:`ParallelDegrees.check`).
    """
    topology.check(config, batch_size=batch_size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != topology.world_size:
        raise ConfigError(f"the topology needs {topology.world_size} ranks ({topology}); "
                          f"{world} are running; change --nproc or the degrees", path="--nproc")
    mesh = topology.build_mesh()
    names = {name for name, _ in topology.axes}
    stage = _submesh(mesh, "pp").get_local_rank() if "pp" in names else 0
    ep_rank = _submesh(mesh, "ep").get_local_rank() if "ep" in names else 0
    model = Transformer(
        config, seed=seed, layers=topology.stage_layers(config.n_layers, stage),
        experts=topology.stage_experts(config.n_experts, ep_rank) if "ep" in names else None,
        embed=stage == 0, head=stage == topology.pp - 1,
    )
    if "tp" in names:
        _apply_tensor_parallel(model, _submesh(mesh, "tp"))
    expert_names = _apply_expert_parallel(model, _submesh(mesh, "ep")) if "ep" in names else []
    module = _apply_data_parallel(model, topology, mesh, expert_names) if mesh is not None else model
    return ParallelModel(model=model, module=module, topology=topology, mesh=mesh,
                         batch_size=batch_size, seq_len=config.seq_len)


def _submesh(mesh: DeviceMesh | None, axis: str) -> DeviceMesh:
    """``mesh[axis]`` of an axis of the degrees (size > 1, so several processes and a mesh)."""
    assert mesh is not None, f"axis {axis!r} of size > 1 without a DeviceMesh"
    return mesh[axis]


class ParallelModel:
    """This rank's stage of the demo model, wrapped for data parallelism, and its schedule.

    Attributes:
        model: the unwrapped stage; ``named_parameters()`` gives canonical names (DTensors under
            tensor parallelism or FSDP2).
        module: what runs forward (``model`` itself, or its ``DistributedDataParallel`` wrapper).
        topology, mesh: the degrees and their DeviceMesh (``None`` for one process).
    """

    def __init__(self, *, model: Transformer, module: nn.Module, topology: ParallelDegrees,
                 mesh: DeviceMesh | None, batch_size: int, seq_len: int) -> None:
        self.model = model
        self.module = module
        self.topology = topology
        self.mesh = mesh
        self._names = {name for name, _ in topology.axes}
        self.stage = _submesh(self.mesh, "pp").get_local_rank() if "pp" in self._names else 0
        self._hidden_shape = (batch_size // topology.data_parallel, seq_len, model.config.d_model)

    def axis_rank(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (0 when the axis is absent)."""
        return _submesh(self.mesh, axis).get_local_rank() if axis in self._names else 0

    @property
    def data_index(self) -> int:
        """Which slice of the global batch this rank trains on (0 .. data_parallel - 1)."""
        index = 0
        for axis, size in self.topology.axes:
            if axis in ("dp_rep", "dp", "dp_shard", "ep"):
                index = index * size + self.axis_rank(axis)
        return index

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous block of rows of the global ``batch`` [B, ...]."""
        rows = batch.shape[0] // self.topology.data_parallel
        return batch[self.data_index * rows:(self.data_index + 1) * rows]

    def forward_backward(self, batch: torch.Tensor) -> float:
        """Forward and backward on this rank's rows of ``batch`` [B, T + 1] int64.

        Leaves the gradients of the global-mean loss in this rank's parameters (synchronised by
        the data-parallel wrapper) and returns that loss, the same float on every rank.
        """
        rows = self.local_rows(batch)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        if self.topology.pp == 1:
            loss = self._loss(self.module(inputs), targets)
            loss.backward()
            return self._global_loss(loss.detach())
        group = _submesh(self.mesh, "pp").get_group()
        last = self.topology.pp - 1
        if self.stage > 0:
            inputs = torch.empty(self._hidden_shape)
            dist.recv(inputs, group=group, group_src=self.stage - 1)
            inputs.requires_grad_(True)
        out = self.module(inputs)
        if self.stage == last:
            loss = self._loss(out, targets)
            loss.backward()
            value = loss.detach()
        else:
            dist.send(out.detach().contiguous(), group=group, group_dst=self.stage + 1)
            grad = torch.empty_like(out)
            dist.recv(grad, group=group, group_src=self.stage + 1)
            out.backward(grad)
            value = torch.zeros(())
        if self.stage > 0:
            assert inputs.grad is not None  # inputs require grad and the backward reached them
            dist.send(inputs.grad.contiguous(), group=group, group_dst=self.stage - 1)
        return self._global_loss(value)

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def _global_loss(self, local: torch.Tensor) -> float:
        """Mean over data slices of the last stage's local mean loss (all ranks get it)."""
        if self.mesh is None:
            return local.item()
        total = local.reshape(1).clone()
        dist.all_reduce(total)
        return total.item() / (self.topology.world_size // self.topology.pp)

    def _counts_once(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this rank's local shard of ``tensor`` enters global sums (one copy per shard).

        A shard counts on the rank at coordinate 0 of every axis over which it is replicated:
        DTensor ``Replicate`` axes, and every axis outside its mesh except ``pp`` (stages own
        distinct layers) and, for experts, ``ep`` (ranks own distinct experts).
        """
        covered: dict[str, bool] = {}
        if isinstance(tensor, DTensor):
            mesh_names = tensor.device_mesh.mesh_dim_names or ()
            covered = {a: isinstance(p, Replicate) for a, p in zip(mesh_names, tensor.placements)}
        owned = {"pp", "ep"} if ".experts." in name else {"pp"}
        for axis in self._names:
            replicated = covered.get(axis, axis not in owned)
            if replicated and self.axis_rank(axis) != 0:
                return False
        return True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Global L2 norm of all gradients (as ``torch.nn.utils.clip_grad_norm_`` on one process).

        Each distinct gradient element counts once across all ranks (see :meth:`_counts_once`);
        one all-reduce over the world. When ``max_norm`` is set and the norm is finite, scales
        every gradient by ``max_norm / (norm + 1e-6)`` if that is below 1. Returns the norm
        before clipping (NaN or inf when a gradient is not finite; then nothing is scaled).
        """
        grads = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64)
        for name, grad in grads:
            if self._counts_once(name, grad):
                squares += _local(grad).double().pow(2).sum()
        if self.mesh is not None:
            dist.all_reduce(squares)
        norm = math.sqrt(squares.item())
        if max_norm is not None and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                torch_private.foreach_mul_([_local(g) for _, g in grads], coef)
        return norm

    def full_state(self) -> dict[str, FullTensors]:
        """Every parameter of the WHOLE model, unsharded, with its gradient, on every rank.

        Collective over the world (DTensors are gathered over their mesh, then stages and expert
        owners exchange by ``all_gather_object``); meant for tests and checks on small models.
        """
        own = {name: FullTensors(_full(p), None if p.grad is None else _full(p.grad))
               for name, p in self.model.named_parameters()}
        if self.mesh is None:
            return own
        gathered: list[dict[str, FullTensors] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        merged: dict[str, FullTensors] = {}
        for part in gathered:
            for name, tensors in (part or {}).items():
                merged.setdefault(name, tensors)
        return dict(sorted(merged.items()))
