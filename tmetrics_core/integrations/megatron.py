"""Megatron-Core, natively: after ``initialize_model_parallel(...)`` a user writes only
``tm.TensorMetrics.from_config(cfg, model=model, optimizer=optimizer)``.

Megatron is never imported here unless the user already did: :func:`active` looks for its
parallel state in ``sys.modules`` and asks whether it is initialized.

**Axes** (outer to inner), from Megatron's parallel state (``mesh=``/``axes=`` given to
``from_config`` win):

======  ===================================================================================
``pp``  pipeline-model-parallel group: each stage holds contiguous layers (``Owned``)
``dp``  data parallel. Dense: Megatron's data-parallel group (context parallel excluded).
        With expert parallelism: Megatron's *expert-data-parallel* group, and the dense
        data-parallel group is then ``dp`` x ``ep``
``ep``  expert-model-parallel group: rank ``r`` owns experts ``r*E/ep .. (r+1)*E/ep - 1``
``cp``  context parallel: each rank holds a chunk of every sequence, weights replicated
``tp``  tensor-model-parallel group; Megatron's expert-tensor-parallel group must be this same
        group (checked), so expert weights are sharded on ``tp`` too
======  ===================================================================================

The axes must tile the world as a grid (each axis group = the ranks differing only along it);
this is checked at start-up and a layout that is not one (expert parallelism cutting across
context parallelism, an expert-tensor-parallel size other than ``tp``) is a ``ConfigError``
asking for ``axes=``. Ranks hold different tokens on ``dp``, ``ep`` and ``cp`` (and on ``tp``
under sequence parallelism): those are the population axes of activations and router outputs.

**Placements** from parameter attributes: ``tensor_model_parallel`` with ``partition_dim`` d
is ``Shard(d)`` on ``tp`` (a ``partition_stride`` other than 1 is refused: strided shards are
not contiguous chunks); an expert weight under expert parallelism (``allreduce == False``) is
``Owned(ep rank)`` on ``ep``; everything else (norms, sequence-parallel norms whose gradients
Megatron all-reduces, biases of row-parallel layers, the router) is left to tmetrics'
inference, which finds it replicated or owned by a pipeline stage, and verifies replicas.
The config's ``placements:`` win over these.

**Global indices**: a stage's first layer is ``TransformerLayer.layer_number - 1`` of its first
block; an expert-parallel rank's first expert is ``MoELayer.local_expert_indices[0]``. Both
are checked to be one offset per model chunk. Virtual pipeline chunks (a list of models) are
joined into one module whose layers carry their global numbers (:func:`joined`).

**Optimizers**: a Megatron optimizer (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``, ``ChainedOptimizer`` of them) is not a ``torch.optim.Optimizer``;
:class:`MegatronSteps` gives tmetrics its step hooks and reads Adam state from its inner torch
optimizers (through the fp32 main copy of a float16 parameter). Its hooks wrap Megatron's whole
``step()``, not the inner torch optimizer's: gradients are read before Megatron clips them
(``main_grad`` under Megatron's DDP), and parameters after Megatron copied its fp32 main params
back into the model. A ``DistributedOptimizer``'s gradients and Adam state are flat shards over
``dp``, read from its range map (:mod:`tmetrics_core.integrations.megatron_shards`).

*Parameters in bf16*: parameter metrics and the update ratio read the **model's bf16 weights**
(what the forward uses; the update is the change of those weights, so an update smaller than
half a bf16 step shows as 0), not the fp32 main params; Adam state is the fp32 main params'.
fp16 with loss scaling is refused (``main_grad`` is still scaled when the step begins).

**Router**: each ``TopKRouter`` reports its logits ``[tokens, E]`` (from ``gating()``) and the
global expert ids it chose ``[tokens, k]`` (from its ``routing_map``) through
:func:`tmetrics_core.observe` (:mod:`tmetrics_core.integrations.megatron_routers`), which costs
one context-variable read on steps where no router metric is due.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core import torch_private
from tmetrics_core.distributed import world
from tmetrics_core.distributed.grid_check import check_grid
from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.adapter import BaseAdapter, Prepared
from tmetrics_core.integrations.megatron_routers import observe_routers
from tmetrics_core.integrations.megatron_shards import is_distributed_optimizer, owned_ranges
from tmetrics_core.integrations.step_hooks import StepHooks
from tmetrics_core.placements import Owned, Placement, Shard
from tmetrics_core.topology import Topology

__all__ = ["Megatron", "MegatronSteps", "active", "placements", "setup", "topology"]


AXES = ("pp", "dp", "ep", "cp", "tp")
"""Axis names in reduction order (outer to inner)."""


def _state() -> Any:
    return sys.modules.get("megatron.core.parallel_state")


def active() -> bool:
    """Whether Megatron-Core is imported and its model-parallel state initialized."""
    ps = _state()
    return ps is not None and bool(ps.model_parallel_is_initialized())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``):
    modules of Megatron that hold no parameter of their own and keep the model at ``.module``."""
    inner = getattr(model, "module", None)
    while type(model).__module__.startswith("megatron.") and isinstance(inner, torch.nn.Module) \
            and next(model.parameters(recurse=False), None) is None:
        model, inner = inner, getattr(inner, "module", None)
    return model


def chunks(model: Any) -> list[torch.nn.Module]:
    """The model chunks: a list/tuple of them (virtual pipeline) or one module."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def topology(model: Any = None, *, timeout_s: float = 60.0) -> Topology:
    """The axes of Megatron's initialized parallel state (see the module docstring).

    Raises:
        ConfigError: the expert-tensor-parallel size differs from ``tp``, or the groups do not
            tile the world as a grid of the axes (say which; pass ``axes=`` yourself then),
            checked in a fixed number of bounded collectives
            (:func:`~tmetrics_core.distributed.grid_check.check_grid`).
    """
    ps = _state()
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    if etp != tp:
        raise ConfigError(f"Megatron's expert-tensor-parallel size {etp} differs from its tensor-parallel size {tp}; "
                          "tmetrics maps both to one axis tp. Pass axes={...} with the groups you want measured")
    groups = {
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_expert_data_parallel_group() if ep > 1 else ps.get_data_parallel_group(),
        "ep": ps.get_expert_model_parallel_group() if ep > 1 else None,
        "cp": ps.get_context_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
    }
    expert_tp = ps.get_expert_tensor_parallel_group() if ep > 1 and tp > 1 else groups["tp"]
    if world.group_ranks(expert_tp) != world.group_ranks(groups["tp"]):
        raise ConfigError("Megatron's expert-tensor-parallel group is not its tensor-parallel group; pass axes={...}")
    check_grid(groups, framework="Megatron", timeout_s=timeout_s)
    sequence_parallel = any(getattr(getattr(unwrap(m), "config", None), "sequence_parallel", False)
                            for m in chunks(model) if m is not None)
    population = ("dp", "ep", "cp") + (("tp",) if sequence_parallel else ())
    return Topology.from_groups({a: groups[a] if len(world.group_ranks(groups[a])) > 1 else None for a in AXES},
                                population_axes=population)


def offsets(model: torch.nn.Module) -> tuple[int, int]:
    """``(first global layer, first global expert)`` of this rank's model, from Megatron's
    ``TransformerLayer.layer_number`` (1-based, global) and ``MoELayer.local_expert_indices``.

    Raises:
        ConfigError: layers whose global numbers are not one offset from their positions.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer  # type: ignore[import-untyped]

    layer_offsets, expert_offsets = set(), set()
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            position = name.rpartition(".")[2]
            if position.isdigit():
                layer_offsets.add(module.layer_number - 1 - int(position))
        indices = getattr(module, "local_expert_indices", None)
        if indices:
            if list(indices) != list(range(indices[0], indices[0] + len(indices))):
                raise ConfigError(f"Megatron MoE layer {name!r} holds experts {list(indices)}, not a contiguous range")
            expert_offsets.add(int(indices[0]))
    if len(layer_offsets) > 1 or len(expert_offsets) > 1:
        raise ConfigError(f"one model chunk with layer offsets {sorted(layer_offsets)} and expert offsets "
                          f"{sorted(expert_offsets)}; tmetrics takes one of each per chunk")
    return min(layer_offsets, default=0), min(expert_offsets, default=0)


def joined(parts: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """Virtual pipeline chunks as one module named as the whole model: each chunk's
    ``decoder.layers.<i>`` registered as ``decoder.layers.<global layer>`` (the chunk's offset
    from :func:`offsets`), its other parameter-holding children (embedding, final norm, output
    layer) under their own names. Only registers the chunks' modules: the same parameters, the
    chunks still run the forward.

    Raises:
        ConfigError: two chunks with a parameter-holding child of the same name, or chunks
            whose layers give one global layer twice, or whose expert offsets differ.
    """
    whole, decoder = torch.nn.Module(), torch.nn.Module()
    layers: dict[str, torch.nn.Module] = {}
    expert_offsets = set()
    for part in parts:
        layer_offset, expert_offset = offsets(part)
        expert_offsets.add(expert_offset)
        for name, child in part.named_children():
            if name == "decoder":
                for sub, grandchild in child.named_children():
                    if sub == "layers":
                        for position, layer in grandchild.named_children():
                            key = str(layer_offset + int(position))
                            if key in layers:
                                raise ConfigError(f"two virtual pipeline chunks hold global layer {key}")
                            layers[key] = layer
                    else:
                        _register(decoder, f"decoder.{sub}", sub, grandchild)
            else:
                _register(whole, name, name, child)
    if len(expert_offsets) > 1:
        raise ConfigError(f"virtual pipeline chunks with expert offsets {sorted(expert_offsets)}; one per rank")
    decoder.add_module("layers", torch.nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)}))
    whole.add_module("decoder", decoder)
    return whole


def _register(parent: torch.nn.Module, path: str, name: str, child: torch.nn.Module) -> None:
    if next(child.parameters(), None) is None:
        return  # no parameter: nothing tmetrics reads (rotary embeddings)
    if name in torch_private.child_modules(parent):
        raise ConfigError(f"two virtual pipeline chunks hold parameters under {path!r}; tmetrics joins chunks "
                          "that split the decoder's layers only")
    parent.add_module(name, child)


def placements(model: torch.nn.Module, topology: Topology) -> dict[str, dict[str, Placement]]:
    """``{parameter name: {axis: placement}}`` from Megatron's parameter attributes (names as
    ``model.named_parameters()`` gives them), for ``TensorMetrics(framework_placements=)``.

    Raises:
        ConfigError: a tensor-parallel weight with ``partition_stride`` other than 1; a
            tensor-parallel or expert-parallel model whose topology lacks ``tp``/``ep`` of
            Megatron's size.
    """
    sizes = {a: topology.axes[a].size for a in topology.names}
    out: dict[str, dict[str, Placement]] = {}
    for name, p in model.named_parameters():
        spec: dict[str, Placement] = {}
        if getattr(p, "tensor_model_parallel", False) and _size("tp", sizes, name) > 1:
            stride = getattr(p, "partition_stride", 1)
            if stride != 1:
                raise ConfigError(f"Megatron parameter {name!r} is tensor-parallel with partition_stride {stride}: "
                                  "its shards are strided, not chunks; declare its placement in the config's "
                                  "placements: or leave it out with select", path="placements")
            spec["tp"] = Shard(int(getattr(p, "partition_dim")))
        if not getattr(p, "allreduce", True) and _size("ep", sizes, name) > 1:
            spec["ep"] = Owned(topology.axes["ep"].rank)
        if spec:
            out[name] = spec
    return out


def _size(axis: str, sizes: Mapping[str, int], name: str) -> int:
    ps = _state()
    want = (ps.get_tensor_model_parallel_world_size() if axis == "tp"
            else ps.get_expert_model_parallel_world_size())
    if want > 1 and sizes.get(axis, 1) != want:
        raise ConfigError(f"Megatron parameter {name!r} is split over {want} {axis} ranks, but the topology has "
                          f"{axis} of size {sizes.get(axis, 1)}; name Megatron's {axis} group in axes= (or leave "
                          "axes= out to take Megatron's parallel state)")
    return want


class _StateView:
    """``state.get(model param)``: the inner torch optimizer's state of the parameter it updates
    (the parameter itself, or the fp32 main copy of a float16 one)."""

    def __init__(self, steps: "MegatronSteps") -> None:
        self._steps = steps

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        for inner, main_of in self._steps.inner:
            main = main_of.get(id(param), param)
            if main in inner.state:
                state = inner.state[main]
                if main.shape == param.shape:
                    return state
                # A distributed optimizer on one data-parallel rank: its shard is the whole
                # parameter, flattened.
                return {k: v.view(param.shape) if isinstance(v, torch.Tensor) and v.numel() == param.numel() else v
                        for k, v in state.items()}
        return default


class MegatronSteps(StepHooks):
    """A Megatron optimizer seen as tmetrics sees a torch one: step pre/post hooks around its
    ``step()`` (gradients are read before it: ``main_grad`` under Megatron's DDP, the update
    after it), ``defaults`` and ``state`` of its inner torch optimizer(s).

    Raises ``ConfigError`` for a Megatron optimizer without a reachable torch optimizer, or
    one that scales the loss (fp16).
    """

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.inner = [(o.optimizer, _main_copies(o)) for o in _leaves(optimizer)]
        self.state = _StateView(self)

    @property
    def torch_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The inner torch optimizers, whose state :attr:`state` reads."""
        return tuple(inner for inner, _ in self.inner)

    @property
    def defaults(self) -> dict[str, Any]:
        """The first inner torch optimizer's defaults (``betas`` tells Adam)."""
        return dict(self.inner[0][0].defaults) if self.inner else {}


def is_megatron_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of Megatron's (``megatron.core.optimizer``) classes."""
    return any(c.__module__.startswith("megatron.core.optimizer") for c in type(optimizer).__mro__)


def _leaves(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [leaf for o in chained for leaf in _leaves(o)]
    if getattr(optimizer, "grad_scaler", None) is not None:
        raise ConfigError(f"{type(optimizer).__name__} scales the loss (fp16 with a grad scaler): the gradients in "
                          "main_grad are scaled when its step begins; tmetrics reads Megatron's fp32 and bf16 "
                          "optimizers, not fp16 with loss scaling yet")
    if not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        raise ConfigError(f"optimizer {type(optimizer).__name__} is a Megatron optimizer without a torch optimizer "
                          "at .optimizer; tmetrics reads FP32Optimizer, Float16OptimizerWithFloat16Params, "
                          "DistributedOptimizer and a ChainedOptimizer of them")
    return [optimizer]


def _main_copies(optimizer: Any) -> dict[int, torch.Tensor]:
    """``id(model param) -> fp32 main param`` of a mixed-precision Megatron optimizer (of a
    ``DistributedOptimizer``: the shard main param, 1-D, of the part this rank owns)."""
    out: dict[int, torch.Tensor] = {}
    if is_distributed_optimizer(optimizer):
        for model_group, shard_group in zip(optimizer.model_fp32_groups + optimizer.model_float16_groups,
                                            optimizer.shard_fp32_groups + optimizer.shard_fp32_from_float16_groups):
            for model_param, shard_main in zip(model_group, shard_group):
                out[id(model_param)] = shard_main
        return out
    for model_group, main_group in zip(getattr(optimizer, "float16_groups", ()),
                                       getattr(optimizer, "fp32_from_float16_groups", ())):
        for model_param, main_param in zip(model_group, main_group):
            out[id(model_param)] = main_param
    return out


def setup(model: Any, optimizer: Any, topology: Topology) -> Prepared:
    """The model inside Megatron's wrappers, the optimizer (a Megatron one adapted by
    :class:`MegatronSteps`), placements from parameter attributes (the config's
    ``placements:`` win over them), the global offsets and the router observation handles.

    Raises:
        ConfigError: those of :func:`joined` (virtual pipeline chunks), :func:`offsets`,
            :func:`placements`, :class:`MegatronSteps`,
            :func:`~tmetrics_core.integrations.megatron_shards.owned_ranges`.
    """
    parts = [unwrap(m) for m in chunks(model)]
    inner = parts[0] if len(parts) == 1 else joined(parts)
    offset = offsets(inner)
    found = placements(inner, topology)
    # Last, after every check: the adapter wraps the optimizer's step (a pass-through once
    # TensorMetrics removes its hooks) and the routers report until the handles are removed.
    megatron_optimizer = optimizer is not None and is_megatron_optimizer(optimizer)
    shards = [s for leaf in (_leaves(optimizer) if megatron_optimizer else ()) if is_distributed_optimizer(leaf)
              for s in owned_ranges(leaf, topology)]
    steps = MegatronSteps(optimizer) if megatron_optimizer else optimizer
    return Prepared(model=inner, optimizer=steps, placements=found, offsets=offset, flat_buffers=shards,
                    handles=[*observe_routers(inner), *([steps] if megatron_optimizer else [])])


class Megatron(BaseAdapter):
    """The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of Megatron-Core: detected
    when its parallel state is initialized; the topology from it unless ``mesh=`` or ``axes=``
    is given; the rest from :func:`setup`."""

    name = "megatron"
    layouts: tuple[str, ...] = ("megatron",)

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return active()

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        return topology(model, timeout_s=timeout_s) if mesh is None and axes is None else None

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        return setup(model, optimizer, topology)
