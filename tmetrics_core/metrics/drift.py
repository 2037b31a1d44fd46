"""Data-parallel replica drift: how far tensors that should be identical across ``dp`` differ.

Data parallelism (DDP, the replicated dim of HSDP) keeps one copy of each parameter per
replica; a missed all-reduce, a non-deterministic kernel or a rank that skipped a step makes the
copies drift apart silently. These statistics reduce over the ``dp`` axis *although* the tensor
is ``Replica`` there (on purpose: they compare the copies), so they override ``stages``:

1. over the drift axes, ``MAX`` of ``[v, -v, nan]`` gives every replica ``max v``, ``-min v``
   and whether any replica's ``v`` held a NaN;
2. locally, ``max - min`` becomes a per-tensor difference ``[d, nan]``;
3. over the axes that split the tensor (``tp`` shards, ``Owned`` on ``pp``/``ep``), ``MAX``, so a
   tensor differs when any of its shards does.

A NaN travels as that flag (``v`` holds ``-inf`` in its place), never as a value: gloo's and
NCCL's MAX keep a NaN only when it comes first (NOTE [NaN under MAX] in
:mod:`~tmetrics_core.metrics.statistics`), so a NaN on one replica would otherwise vanish.
The magnitude and sampled views report NaN when any replica has a NaN among the values they
compare; the hash compares bit patterns, so a NaN on some replicas only is a difference.

Three views: an exact one (a position-weighted hash of the element bit patterns: any changed
bit changes it, except with probability about 2**-52), a magnitude (the float64 sum of the
elements) and a sampled one (the same pseudo-random ``sample`` element positions on every
replica, derived from the tensor name; the largest elementwise difference among them, a lower
bound of the true largest difference).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.statistics import Stage, Statistic, flagged_value
from tmetrics_core.site import Site

__all__ = ["DRIFT_AXES", "ReplicaDrift", "ReplicaHash", "SampledDrift", "SumDrift"]

DRIFT_AXES = ("dp",)
"""Axes compared by default: the data-parallel replicas."""

_HASH_MASK = (1 << 52) - 1
_CHUNK = 1 << 20
_MULTIPLIER = 0x9E3779B1
_OFFSET = 0x7F4A7C15
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


class _Drift(Statistic):
    """Base: stage 1 MAX of ``[v, -v, NaN flag]`` (``2 width + 1`` values) over the drift axes,
    stage 2 MAX of ``[difference, NaN flag]`` over the splitting axes."""

    between_agreed = True

    def __init__(self, axes: Sequence[str], width: int) -> None:
        self.axes = tuple(axes)
        self.width = width

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        compared = tuple(a for a in topology.names if a in self.axes and topology.axes[a].size > 1)
        split = tuple(a for a in topology.names
                      if a not in self.axes and topology.axes[a].size > 1 and site.placement(a).splits())
        return (Stage(compared, "max", self.size(site)), Stage(split, "max", 2))

    def size(self, site: Site) -> int:
        return 2 * self.width + 1

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        return True  # 2 * width + 1 values, then two

    def compute(self, tensors, sites, topology, rows):
        out = []
        for tensor, site in zip(tensors, sites):
            v = self.values(tensor.detach(), site).to(torch.float64)
            nan = torch.isnan(v)
            out.append(torch.cat([v.masked_fill(nan, -math.inf), (-v).masked_fill(nan, -math.inf),
                                  nan.any().to(torch.float64).reshape(1)]))
        return out

    def values(self, tensor: torch.Tensor, site: Site) -> torch.Tensor:
        """The ``width`` local values compared across replicas."""
        raise NotImplementedError

    def between(self, index, vector, site, topology):
        if not site.holds(topology.coords()):
            return torch.zeros(2, dtype=torch.float64, device=vector.device)
        high, neg_low, nan = vector[:self.width], vector[self.width:2 * self.width], vector[2 * self.width] > 0
        # Equal extremes (infinities included: inf - inf would be NaN) do not differ.
        spread = torch.where(high == -neg_low, torch.zeros_like(high), high + neg_low)
        difference = torch.where(nan, torch.zeros((), dtype=torch.float64, device=vector.device),
                                 self.difference(spread))
        return torch.stack([difference, nan.to(torch.float64)])

    def difference(self, spread: torch.Tensor) -> torch.Tensor:
        """One number from the per-value ``max - min`` across replicas."""
        return spread.max() if spread.numel() else torch.zeros((), dtype=torch.float64)


class ReplicaHash(_Drift):
    """Whether a tensor's replicas differ at all: 1.0 when the bit hashes differ, else 0.0.
    Merged over tensors by SUM: the number of differing tensors (exact up to 2**-52)."""

    op = "sum"

    def __init__(self, axes: Sequence[str] = DRIFT_AXES) -> None:
        super().__init__(axes, 1)
        self.name = f"drift_hash[{','.join(self.axes)}]"

    def values(self, tensor, site):
        return torch.tensor([float(_bit_hash(tensor))], dtype=torch.float64, device=tensor.device)

    def difference(self, spread):
        return (spread != 0).to(torch.float64).max()


class SumDrift(_Drift):
    """Spread across replicas of the float64 sum of the elements (units of the tensor);
    merged over tensors by MAX."""

    op = "max"

    def __init__(self, axes: Sequence[str] = DRIFT_AXES) -> None:
        super().__init__(axes, 1)
        self.name = f"drift_sum[{','.join(self.axes)}]"

    def values(self, tensor, site):
        if not tensor.numel():
            return torch.zeros(1, dtype=torch.float64, device=tensor.device)
        return tensor.sum(dtype=torch.float64).reshape(1)


class SampledDrift(_Drift):
    """Largest ``max - min`` across replicas over ``sample`` pseudo-random element positions
    (drawn with replacement from the local tensor, seeded by the tensor name, so identical on
    every replica); merged over tensors by MAX. Units of the tensor."""

    op = "max"

    def __init__(self, sample: int = 1024, axes: Sequence[str] = DRIFT_AXES) -> None:
        super().__init__(axes, sample)
        self.name = f"drift_sample[{sample};{','.join(self.axes)}]"

    def values(self, tensor, site):
        flat = tensor.reshape(-1)
        if not flat.numel():
            return torch.zeros(self.width, dtype=torch.float64, device=tensor.device)
        seed = int.from_bytes(hashlib.blake2b(site.name.encode(), digest_size=7).digest(), "big")
        generator = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, flat.numel(), (self.width,), generator=generator)
        return flat[positions.to(flat.device)].to(torch.float64)


def _bit_hash(tensor: torch.Tensor) -> int:
    """A position-weighted sum of the elements' bit patterns modulo 2**64, cut to 52 bits
    (exact in float64). Any single changed bit changes it."""
    flat = tensor.reshape(-1)
    if flat.dtype in _BITS:
        bits = flat.view(_BITS[flat.dtype])
    else:
        bits = flat
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        weight = ((position * _MULTIPLIER + _OFFSET) & 0x7FFFFFFF) | 1
        total += (chunk * weight).sum()
    return int(total) & _HASH_MASK


class ReplicaDrift(StatMetric):
    """How much tensors that should be identical across data-parallel replicas differ.

    Stats: ``tensors-differing`` (count of tensors whose replicas differ in any bit),
    ``max-sum-diff`` (largest spread of a tensor's element sum across replicas) and
    ``sampled-max-diff`` (largest elementwise spread among ``sample`` positions per tensor).
    Only sites replicated on every drift axis are compared (sharded ones have no copies).
    All three are 0 in a healthy run; with a single replica they are 0 by definition.
    ``max-sum-diff`` and ``sampled-max-diff`` are NaN on every rank when any replica holds a
    NaN among the values they compare; ``tensors-differing`` counts a tensor whose NaN bits
    are not on every replica. Infinities equal on every replica do not differ.

    Args:
        sample: element positions compared per tensor (default 1024).
        axes: the axes whose ranks hold copies (default ``("dp",)``).
    """

    formula = "max - min over dp replicas of: bit hash (count), sum(x), sampled x_i"

    def __init__(self, *, sample: int | None = None, axes: Sequence[str] = DRIFT_AXES, **kwargs) -> None:
        self.axes = tuple(axes)
        self.sample = 1024 if sample is None else sample
        self.statistics = (ReplicaHash(self.axes), SumDrift(self.axes), SampledDrift(self.sample, self.axes))
        super().__init__(**kwargs)

    def accepts(self, site: Site) -> bool:
        """Sites of the chosen kinds that are ``Replica`` on every drift axis."""
        return super().accepts(site) and all(site.placement(a).is_replica() for a in self.axes)

    def check(self, site: Site, topology: Topology) -> None:
        """Refuse a multi-rank topology without any of the drift axes: nothing would be compared
        and every value would read 0, a false all-clear.

        Raises:
            PlacementError: naming the axes looked for, the topology's axes and the fix.
        """
        if topology.world_size > 1 and not any(a in topology.axes for a in self.axes):
            raise PlacementError(
                f"it compares replicas across axis {' or '.join(repr(a) for a in self.axes)}, which the topology "
                f"{list(topology.names)} does not have, so it would always report 0. Name the data-parallel "
                "axis 'dp' (mesh_dim_names=(..., 'dp', ...) or axes={'dp': group}), or drop the metric")
        super().check(site, topology)

    def finalize(self, stats):
        hashed, summed, sampled = (flagged_value(stats[s.name]) for s in self.statistics)
        return {"tensors-differing": hashed, "max-sum-diff": summed, "sampled-max-diff": sampled}
