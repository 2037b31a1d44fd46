"""DeepSpeed ZeRO read where it keeps things: each rank's own partition, as ``FlatShard`` on ``dp``.

ZeRO partitions over DeepSpeed's (sequence-)data-parallel group. What each rank holds, and
where tmetrics reads it (never an all-gather; a copy only for ZeRO 3's updates):

``param``
    ZeRO 1/2: the model parameter itself, whole on every rank after DeepSpeed's all-gather
    (read as usual, a verified ``Replica``). ZeRO 3: ``param.ds_tensor``, the partition the
    forward gathers (bf16/fp16 where DeepSpeed keeps the weights so); its range is
    ``[r*s, (r+1)*s)`` clipped to the parameter's ``ds_numel`` (``s`` the partition size
    ``ds_tensor.ds_numel``), so the last partition's padding is never read.
``grad``
    ZeRO 1/2: ``param._hp_mapping.get_lp_grad_fragment(i)``, the reduced, averaged gradient
    fragment of rank ``r``'s partition that DeepSpeed's clipping norm reads (its CPU copy under
    optimizer offload); the range is ``_hp_mapping.lp_fragment_address`` (none: the rank owns
    nothing of the parameter). ZeRO 3: ``deepspeed.utils.safe_get_local_grad``. Under fp16,
    divided by DeepSpeed's loss scale (:func:`_unscaled`).
``exp_avg``, ``exp_avg_sq``
    ZeRO 1/2: the inner torch optimizer's state of the parameter group's fp32 partition
    (``single_partition_of_fp32_groups``), at ``_hp_mapping.hp_fragment_address``. Not
    DeepSpeed's ``optim_fragment`` views: 0.19.8 links them once, after the first group's first
    step, so with several parameter groups (the Trainer's decay / no-decay groups) the later
    groups' views stay empty. ZeRO 3: ``deepspeed.utils.safe_get_local_optimizer_state``.
``update``
    ZeRO 1/2: the change of the model parameter (read as usual, from tmetrics' snapshot of
    the whole weights). ZeRO 3: the change of ``ds_tensor`` over the step
    (:class:`Zero3Updates`: a copy of this rank's partitions on due steps only).

The public ``safe_get_local_*`` helpers of ``deepspeed.utils`` are defined for ZeRO 3 only;
for ZeRO 1 and 2 the fragment map DeepSpeed itself builds for them (``_hp_mapping``, used by
``safe_get_full_grad``) is read here, and nowhere else in tmetrics.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from tmetrics_core.distributed import world
from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.megatron_shards import OwnedRanges

__all__ = ["KINDS", "Zero3Updates", "partitions"]

KINDS = ("grad", "exp_avg", "exp_avg_sq")
"""The kinds read from the partitions under every stage (ZeRO 3 adds ``param``)."""

Fetch = Callable[[torch.nn.Parameter], "tuple[torch.Tensor, int] | None"]


def partitions(optimizer: Any, stage: int, dp_ranks: tuple[int, ...]
               ) -> tuple[list[OwnedRanges], Zero3Updates | None]:
    """One :class:`OwnedRanges` per kind read from ZeRO ``optimizer``'s partitions (stage 1, 2
    or 3), sharded on ``dp``; under ZeRO 3 also the :class:`Zero3Updates` their ``update``
    reads (its copies are taken by the integration's step hooks).

    Raises:
        ConfigError: the optimizer partitions over other ranks than ``dp_ranks`` (ZeRO++
            hierarchical partitions, expert groups).
    """
    if stage == 3:
        return _stage3(optimizer, dp_ranks)
    return _stage12(optimizer, dp_ranks), None


def _check_group(group: Any, dp_ranks: tuple[int, ...], what: str) -> None:
    ranks = world.group_ranks(group)
    if sorted(ranks) != sorted(dp_ranks):
        raise ConfigError(f"DeepSpeed partitions {what} over ranks {sorted(ranks)}, not its data-parallel group "
                          f"{sorted(dp_ranks)}: ZeRO++ hierarchical partitions (zero_hpz_partition_size) and "
                          "expert groups are not read by tmetrics; leave them out of the DeepSpeed config")


def _stage12(optimizer: Any, dp_ranks: tuple[int, ...]) -> list[OwnedRanges]:
    params: list[torch.nn.Parameter] = []
    ranges: dict[int, tuple[int, int]] = {}
    for group, pg in zip(optimizer.bit16_groups, optimizer.real_dp_process_group):
        _check_group(pg, dp_ranks, "a parameter group")
        for p in group:
            params.append(p)
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                address = mapping.lp_fragment_address
                ranges[id(p)] = (address.start, address.start + address.numel)

    def grad(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        try:
            fragment = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)  # type: ignore[attr-defined]
        except ValueError:  # none between a step and the next boundary's backward
            return None
        if fragment is None:
            return None
        lo, hi = ranges[id(p)]
        # A fragment is this rank's part; a whole-parameter accumulation buffer is read at lo.
        return fragment, (lo if fragment.numel() != hi - lo else 0)

    # Adam state from the inner optimizer's state of each group's fp32 partition, at the
    # fragment's place in it: DeepSpeed links its own `optim_fragment` views once, after the first
    # group's first step, so the other groups' fragments stay empty.
    inner, flats = optimizer.optimizer, optimizer.single_partition_of_fp32_groups

    def state(kind: str) -> Fetch:
        def read(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
            mapping = p._hp_mapping  # type: ignore[attr-defined]
            value = inner.state.get(flats[mapping.param_group_index], {}).get(kind)
            return (value, mapping.hp_fragment_address.start) if value is not None else None
        return read

    fetch = {"grad": _unscaled(optimizer, grad), "exp_avg": state("exp_avg"), "exp_avg_sq": state("exp_avg_sq")}
    empty = torch.empty(0)
    return [OwnedRanges(kind, "dp", params, empty, 0, ranges=ranges, fetch=fetch[kind]) for kind in KINDS]


def _unscaled(optimizer: Any, fetch: Fetch) -> Fetch:
    """``fetch`` of the gradients, divided by DeepSpeed's loss scale under fp16.

    With ``"fp16": {"enabled": true}`` the loss is multiplied by the loss scale before backward,
    so ZeRO's partitions hold ``scale * gradient`` until its ``step()`` unscales them. The scale
    (``optimizer.loss_scale``: a Python float in DeepSpeed 0.19.8, passed to the kernel as a
    scalar, a tensor on the partition's device were it one; never ``.item()``) is read with the
    gradient, in the step's pre-hook, before ``step()`` updates it. The quotient is float32 (a
    gradient below fp16's smallest normal number, 6.1e-5, is exact there); one cast and one
    division per fp16 fragment read (one division into a new tensor for float32 ones: ZeRO 3's
    partitions, offload's CPU buffers), on due steps only. Without fp16 (scale fixed at 1) ``fetch``
    is returned as it is.
    """
    if getattr(optimizer, "dtype", None) != torch.float16:
        return fetch

    def read(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        found = fetch(p)
        if found is None:
            return None
        holder, at = found
        scale = optimizer.loss_scale
        if holder.dtype == torch.float32:  # DeepSpeed's own float32 gradients: never divided in place
            return holder.detach().div(scale), at
        return holder.detach().to(torch.float32).div_(scale), at
    return read


def _stage3(optimizer: Any, dp_ranks: tuple[int, ...]) -> tuple[list[OwnedRanges], Zero3Updates]:
    from deepspeed.utils import safe_get_local_grad, safe_get_local_optimizer_state  # type: ignore[import-untyped]

    params: list[torch.nn.Parameter] = [p for group in optimizer.fp16_groups for p in group]
    ranges: dict[int, tuple[int, int]] = {}
    for p in params:
        shape = list(p.ds_shape)  # type: ignore[attr-defined]
        _check_group(p.ds_process_group, dp_ranks, f"a parameter of shape {shape}")  # type: ignore[attr-defined]
        size = int(p.ds_tensor.ds_numel)  # type: ignore[attr-defined]
        rank = world.rank(p.ds_process_group)  # type: ignore[attr-defined]
        numel = int(p.ds_numel)  # type: ignore[attr-defined]
        ranges[id(p)] = (min(size * rank, numel), min(size * (rank + 1), numel))

    def weights(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        return p.ds_tensor, 0  # type: ignore[attr-defined]

    def grad(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        try:
            value = safe_get_local_grad(p)
        except KeyError:  # no reduced gradient partition (the parameter got none)
            return None
        return (value, 0) if value is not None else None

    def state(kind: str) -> Fetch:
        def read(p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
            try:
                value = safe_get_local_optimizer_state(p, kind)
            except KeyError:  # before the first step: no state yet
                return None
            return (value, 0) if value is not None else None
        return read

    updates = Zero3Updates([p for p in params if ranges[id(p)][0] < ranges[id(p)][1]])
    fetch = {"param": weights, "grad": _unscaled(optimizer, grad), "exp_avg": state("exp_avg"),
             "exp_avg_sq": state("exp_avg_sq"),
             "update": updates.fetch}
    empty = torch.empty(0)
    return [OwnedRanges(kind, "dp", params, empty, 0, ranges=ranges, fetch=fetch[kind])
            for kind in ("param", *KINDS, "update")], updates


class Zero3Updates:
    """The update of each rank's ZeRO 3 partitions over one optimizer step: :meth:`take` copies
    the partitions (``ds_tensor``) before the step into one float32 buffer, on due steps that read
    updates only; the first :meth:`fetch` after the step subtracts it from the partitions then
    (one concatenation, one subtraction), so a bf16 update is the exact difference of two bf16
    weights, not rounded to bf16 again. Read as ``FlatShard`` like the partitions themselves.

    Attributes:
        params: the parameters this rank owns a part of, in a fixed order.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self._offsets: dict[int, int] = {}
        at = 0
        for p in self.params:
            self._offsets[id(p)] = at
            at += p.ds_tensor.numel()  # type: ignore[attr-defined]
        self._before: torch.Tensor | None = None
        self._difference: torch.Tensor | None = None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.ds_tensor.view(-1) for p in self.params]).to(torch.float32)  # type: ignore[attr-defined]

    def take(self) -> None:
        """Copy the partitions as they are before the step (float32 holds bf16/fp16 exactly)."""
        self._before = self._flat() if self.params else None
        self._difference = None

    def fetch(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
        """``(now - before of the partitions, where p's lies)``; None without a copy from
        before this step."""
        if self._difference is None:
            if self._before is None:
                return None
            self._difference = self._flat().sub_(self._before)
            self._before = None
        return self._difference, self._offsets[id(p)]

    def forget(self) -> None:
        """Drop the copy and the difference (after the step's post phase)."""
        self._before = self._difference = None
