"""Megatron-Core's ``DistributedOptimizer`` read where it keeps things: flat shards over the
data-parallel group.

Megatron's distributed optimizer (ZeRO-1) lays the parameters of each ``_ParamAndGradBuffer``
end to end (each start padded to 64 elements) and gives data-parallel rank ``r`` the ``r``-th
contiguous slice of every bucket. Its range map (``model_param_gbuf_map``, ``gbuf_ranges``: per
owned parameter a ``"param"`` range within the parameter's own flattening) says which part of
which parameter rank ``r`` owns; a range may cut rows and a rank may own nothing of a parameter.
After Megatron's reduce-scatter only the owned part of ``param.main_grad`` holds the reduced
gradient (the rest holds this rank's unreduced one), and the Adam state exists only for the owned
parts (keyed by the shard main params). Each of them is therefore read as a ``FlatShard`` of the
parameter on ``dp``, from the optimizer's own ranges:

=============  ==============================================================================
``grad``       ``param.main_grad.view(-1)[start:end]`` (the reduced part of the grad buffer)
``exp_avg``,   the inner torch optimizer's state of the shard main param (1-D, ``end - start``)
``exp_avg_sq``
=============  ==============================================================================

Parameters and updates are read from the model parameters, which Megatron all-gathers at the
end of its step (with fp32 parameters the main params are views of them: the same numbers);
an overlapped all-gather (``overlap_param_gather``) would leave them stale then, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from tmetrics_core.distributed import world
from tmetrics_core.errors import ConfigError
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.site import Site
from tmetrics_core.sources.flat import FlatBuffer, Memory, Reader, _range_of, kept, owned_part
from tmetrics_core.topology import Topology

__all__ = ["OwnedRanges", "is_distributed_optimizer", "owned_ranges"]

KINDS = ("grad", "exp_avg", "exp_avg_sq")


def is_distributed_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Megatron's ``DistributedOptimizer`` (by class name along its MRO)."""
    return any(c.__name__ == "DistributedOptimizer" and c.__module__.startswith("megatron.")
               for c in type(optimizer).__mro__)


@dataclass(frozen=True)
class OwnedRanges(FlatBuffer):
    """Source ``kind`` of ``params`` where each rank of ``axis`` owns one contiguous range of
    each parameter's row-major flattening (possibly empty), held as a separate 1-D tensor per
    parameter (``buffer`` and ``offset`` of :class:`FlatBuffer` are unused: empty and 0).

    Attributes:
        ranges: ``id(param) -> (start, end)``, this rank's range of the parameter's flattening;
            parameters absent here are owned elsewhere (an empty range).
        fetch: ``param -> (holder, at)``, asked at each due step: this rank's part is elements
            ``[at, at + end - start)`` of ``holder``'s flattening (a contiguous tensor: the
            gradient buffer's view ``main_grad`` at ``start``, an Adam state tensor of the part
            at 0); None when there is none yet (Adam state before the first step). A part is
            viewed again only when its holder is another tensor or moved.
    """

    ranges: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    fetch: Callable[[torch.nn.Parameter], tuple[torch.Tensor, int] | None] = lambda p: None

    def layout(self, manifest: Manifest, topology_axes: Sequence[str]) -> tuple[list[Site], Reader]:
        """Sites (``FlatShard`` on ``axis``) for every manifest entry, in manifest order (entries
        not listed keep their site), and the reader of this rank's part of each at a due step:
        a view of the fetched range, empty where this rank owns no element of the entry, None
        where the entry is not listed or ``fetch`` has no value yet (Adam state before the
        first step).

        Raises ``ConfigError`` for an axis not in the topology.
        """
        if self.axis not in topology_axes:
            raise ConfigError(f"Megatron's distributed optimizer shards over {self.axis!r}, not an axis of the "
                              f"topology {list(topology_axes)}")
        listed = {id(p) for p in self.params}
        sites: list[Site] = []
        # Per entry: (parameter, [a, b) of its owned part, whether the rank owns any of it).
        pieces: list[tuple[torch.nn.Parameter, int, int, bool] | None] = []
        for entry in manifest.entries:
            site = entry.site(self.kind)
            param = manifest.local.get(entry.name)
            if param is None or id(param) not in listed:
                sites.append(site)
                pieces.append(None)
                continue
            lo, hi = self.ranges.get(id(param), (0, 0))
            owned, a, b = owned_part(site, entry.shape, _range_of(entry.name, manifest, param, (0, param.numel())),
                                     (lo, hi), self.axis, topology_axes)
            sites.append(owned)
            pieces.append((param, a - lo, b - lo, lo < hi) if a < b else (param, 0, 0, lo < hi))
        fetch = self.fetch
        # Per entry: the holder's memory and the view of the part, kept while the holder keeps
        # its memory (a fresh holder object over the same memory keeps it too).
        viewed: list[tuple[Memory, torch.Tensor] | None] = [None] * len(pieces)

        def read() -> list[torch.Tensor | None]:
            out: list[torch.Tensor | None] = []
            for k, piece in enumerate(pieces):
                if piece is None:
                    out.append(None)
                    continue
                param, start, end, owns = piece
                found = fetch(param) if owns else None
                if found is None and owns:
                    out.append(None)
                    continue
                holder, at = found if found is not None else (param, 0)
                last = viewed[k]
                if last is None or not kept(last[0], holder):
                    # Owning nothing: an empty tensor like the parameter. Else a view, not a
                    # reshape: a holder that is not contiguous raises (a copy kept here would go
                    # stale) and the metrics reading it fail with that error.
                    part = (holder.detach().view(-1)[at + start:at + end] if owns
                            else holder.detach().new_empty(0))
                    last = viewed[k] = (Memory.of(holder), part)
                out.append(last[1])
            return out
        return sites, read


def owned_ranges(optimizer: Any, topology: Topology) -> list[OwnedRanges]:
    """One :class:`OwnedRanges` per kind (gradients, Adam's two moments) of a
    ``DistributedOptimizer`` sharding over more than one rank (none for one rank: it owns
    whole parameters, read as usual).

    Raises:
        ConfigError: its data-parallel group is not the topology's ``dp`` (expert parallelism or
            context parallelism with the distributed optimizer, not supported yet); it overlaps
            the parameter all-gather with the next forward (``overlap_param_gather``: the
            model's parameters are stale after the step); it uses Megatron-FSDP or a
            precision-aware optimizer (other layouts).
    """
    ddp = optimizer.ddp_config
    if ddp.use_megatron_fsdp or optimizer.config.use_precision_aware_optimizer:
        raise ConfigError("Megatron's distributed optimizer with Megatron-FSDP or a precision-aware optimizer keeps "
                          "its shards in another layout; tmetrics reads the ZeRO-1 layout only")
    if ddp.overlap_param_gather:
        raise ConfigError("Megatron's DDP overlaps the parameter all-gather with the next forward "
                          "(overlap_param_gather=True): after optimizer.step() each rank's model holds only its own "
                          "updated range, so parameter and update metrics would mix old and new weights. Set "
                          "overlap_param_gather=False, or measure only gradient metrics with optimizer= left out")
    group = optimizer.data_parallel_group
    size = world.world_size(group) if group is not None else 1
    if size == 1:
        return []
    ranks = world.group_ranks(group)
    dp = topology.axes.get("dp")
    if dp is None or tuple(sorted(dp.ranks)) != tuple(sorted(ranks)):
        raise ConfigError(f"Megatron's distributed optimizer shards over ranks {sorted(ranks)}, but the topology's dp "
                          f"axis is {sorted(dp.ranks) if dp else 'absent'}; with expert or context parallelism "
                          "tmetrics does not read it yet (use_distributed_optimizer=False)")
    params = [p for buffer in optimizer.buffers for p in buffer.params]
    ranges: dict[int, tuple[int, int]] = {}
    main: dict[int, torch.Tensor] = {}
    for model_group, shard_group in zip(optimizer.model_fp32_groups + optimizer.model_float16_groups,
                                        optimizer.shard_fp32_groups + optimizer.shard_fp32_from_float16_groups):
        for model_param, shard_main in zip(model_group, shard_group):
            piece = optimizer._get_model_param_range_map(model_param)["param"]
            ranges[id(model_param)] = (piece.start, piece.end)
            main[id(model_param)] = shard_main
    inner = optimizer.optimizer

    def grad(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        main: torch.Tensor | None = getattr(p, "main_grad", None)  # Megatron's DDP: a view of its grad buffer
        return (main, ranges[id(p)][0]) if main is not None else None

    def state(kind: str) -> Callable[[torch.nn.Parameter], tuple[torch.Tensor, int] | None]:
        def read(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
            value = inner.state.get(main[id(p)], {}).get(kind)
            return (value, 0) if value is not None else None
        return read

    empty = torch.empty(0)
    return [OwnedRanges(kind, "dp", params, empty, 0, ranges=ranges, fetch=grad if kind == "grad" else state(kind))
            for kind in KINDS]
