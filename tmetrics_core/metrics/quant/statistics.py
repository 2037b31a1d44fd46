"""What a recipe does to tensors, as mergeable per-tensor vectors, and the statistics that carry
them across ranks.

:func:`quant_rows` quantises a list of tensors with one recipe in a fixed number of batched ops
per block width (every tensor's blocks are stacked into one matrix; per-tensor values come
back through one ``index_add_`` and one ``scatter_reduce_``), and returns two float64 matrices:

- sums (:data:`SUM_FIELDS`, merged by SUM; counts are integers, exact below 2**53): elements,
  non-zero elements, underflows (non-zero, finite, decoded as 0), overflows (rounded beyond the
  format's largest value, so saturated), non-finite decoded values (a NaN input, or every element
  of a block whose scale a NaN poisoned), ``sum x**2`` and ``sum (x - dq(x))**2`` and
  ``sum |x - dq(x)| / |x|`` over the finite elements (``count`` of the last one's terms), and over
  the blocks whose amax is finite and non-zero: their count, ``sum log2 d`` and
  ``sum (log2 d)**2`` of the decode scale ``d``, and how many hit the scale format's limit;
- extremes (:data:`MAX_FIELDS`, merged by MAX): ``amax`` (NaN skipped, infinities kept),
  ``-min |x|`` over finite non-zero x, the largest and minus the smallest decode scale.

The scale std merges exactly across ranks from the float64 sums: ``var = S2/n - (S1/n)**2``
holds for any split of the blocks, whatever each rank's own mean (TransformerEngine pools
per-rank variances instead, which leaves out the spread between rank means).

Where a recipe needs the amax of the whole tensor before it casts (tensorwise scaling, NVFP4's
tensor scale) and the tensor is split across ranks, the statistics run in two stages: the amax
(MAX over the axes that cut the tensor), then the vectors above from a copy of the local shard
kept since it was read (:class:`Held`).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.quant.recipes import Recipe, block_rows
from tmetrics_core.metrics.statistics import Stage, Statistic, split_axes
from tmetrics_core.placements import ReduceOpName
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.topology import Topology

__all__ = ["Held", "MAX_FIELDS", "QuantStatistic", "SUM_FIELDS", "quant_rows", "scale_axes"]

SUM_FIELDS = ("elements", "nonzero", "underflow", "overflow", "nonfinite", "sumsq", "err_sumsq", "rel_sum",
              "rel_count", "blocks", "log2_scale_sum", "log2_scale_sumsq", "blocks_at_limit")
MAX_FIELDS = ("amax", "neg_min_nonzero", "scale_max", "neg_scale_min")


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 ``[rows, last dim]`` (a 0-d tensor is ``[1, 1]``)."""
    t = t.detach()
    if t.dim() == 0:
        return t.reshape(1, 1).to(torch.float32)
    cols = t.shape[-1]
    return t.reshape(t.numel() // cols if cols else 0, cols).to(torch.float32)


def quant_rows(recipe: Recipe, tensors: Sequence[torch.Tensor], tensor_amax: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor sums ``[len(tensors), len(SUM_FIELDS)]`` and extremes ``[len(tensors),
    len(MAX_FIELDS)]`` (float64, on the tensors' device) of ``recipe`` applied to each tensor.

    Args:
        tensors: local tensors (any floating dtype and shape; all on one device).
        tensor_amax: float32 ``[len(tensors)]``: each tensor's amax over every shard, for the
            recipes that scale by it (:attr:`Recipe.tensor_amax`); None: the local amax.
    """
    device = tensors[0].device
    count = len(tensors)
    sums = torch.zeros((count, len(SUM_FIELDS)), dtype=torch.float64, device=device)
    maxes = torch.full((count, len(MAX_FIELDS)), -math.inf, dtype=torch.float64, device=device)
    groups: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}
    for i, t in enumerate(tensors):
        blocks, valid = block_rows(recipe, _matrix(t))
        if blocks.shape[0]:
            groups.setdefault(blocks.shape[1], []).append((i, blocks, valid))
    for members in groups.values():
        counts = [b.shape[0] for _, b, _ in members]
        owner = torch.repeat_interleave(torch.tensor([i for i, _, _ in members], device=device),
                                        torch.tensor(counts, device=device), output_size=sum(counts))
        x = torch.cat([b for _, b, _ in members]) if len(members) > 1 else members[0][1]
        valid = None
        if any(v is not None for _, _, v in members):
            valid = torch.cat([v if v is not None else torch.ones_like(b, dtype=torch.bool) for _, b, v in members])
        if tensor_amax is not None:
            amax = tensor_amax.to(device=device, dtype=torch.float32)[owner]
        elif recipe.tensor_amax:  # each tensor's own amax (NaN kept: the cast's scale is NaN too)
            own = x.abs().amax(1)
            per = torch.full((count,), -math.inf, dtype=torch.float32, device=device)
            amax = per.scatter_reduce_(0, owner, own, "amax")[owner]
        else:
            amax = None
        block_sums, block_max = _block_stats(recipe, x, valid, amax)
        sums.index_add_(0, owner, block_sums)
        maxes.scatter_reduce_(0, owner.unsqueeze(1).expand_as(block_max), block_max, "amax")
    return sums, maxes


def _block_stats(recipe: Recipe, x: torch.Tensor, valid: torch.Tensor | None,
                 tensor_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, len(SUM_FIELDS)]`` sums and ``[blocks, len(MAX_FIELDS)]`` extremes of blocks
    given as rows (see :meth:`Recipe.quantise_blocks`)."""
    b = recipe.quantise_blocks(x, valid, tensor_amax)
    # Padding (zeros) is never non-zero, never overflows and adds nothing to the sums; only the
    # element count and the non-finite count (a NaN block's padding decodes to NaN) exclude it.
    x64 = x.to(torch.float64)
    magnitude = x64.abs()
    nonzero = (x64 != 0) & ~torch.isnan(x64)
    err = x64 - b.dq
    measured = torch.isfinite(err)  # x and dq(x) both finite
    err = torch.where(measured, err, 0.0)
    relative = measured & nonzero
    rel = torch.where(relative, err.abs() / torch.where(relative, magnitude, 1.0), 0.0)
    nonfinite = ~torch.isfinite(b.dq)
    if valid is not None:
        nonfinite &= valid
    count = valid.sum(1) if valid is not None else torch.full((x.shape[0],), x.shape[1], device=x.device)
    # A block's scale is meaningful when its amax is finite and non-zero (an all-zero block, a
    # padded one, scales nothing); with a tensor-wide scale, every block of a non-zero tensor.
    block_amax = b.amax if tensor_amax is None or recipe.name != "fp8-tensorwise" else tensor_amax
    scaled = (block_amax > 0) & torch.isfinite(block_amax) & torch.isfinite(b.decode) & (b.decode > 0)
    log2d = torch.where(scaled, torch.log2(torch.where(scaled, b.decode, 1.0)), 0.0)
    columns = [
        count, nonzero.sum(1), (nonzero & (b.dq == 0)).sum(1), b.overflow.sum(1), nonfinite.sum(1),
        torch.where(measured, x64 * x64, 0.0).sum(1), (err * err).sum(1), rel.sum(1), relative.sum(1),
        scaled, log2d, log2d * log2d, b.clamped & scaled,
    ]
    block_sums = torch.stack([c.to(torch.float64) for c in columns], 1)
    extremes = [
        torch.where(torch.isnan(x64), -math.inf, magnitude).amax(1),
        -torch.where(nonzero, magnitude, math.inf).amin(1),
        torch.where(scaled, b.decode, -math.inf),
        -torch.where(scaled, b.decode, math.inf),
    ]
    return block_sums, torch.stack(extremes, 1)


_BLOCK_FIELDS = [SUM_FIELDS.index(f) for f in ("blocks", "log2_scale_sum", "log2_scale_sumsq", "blocks_at_limit")]
_SCALE_FIELDS = [MAX_FIELDS.index(f) for f in ("scale_max", "neg_scale_min")]


def _first_shard(site: Site, topology: Topology) -> bool:
    """Whether this rank holds the tensor's first element on every axis that cuts it."""
    coords = topology.coords()
    for axis in scale_axes(site, topology):
        p = site.placement(axis)
        if (p.start != 0) if p.is_flat_shard() else coords.get(axis, 0) != 0:  # type: ignore[attr-defined]
            return False
    return True


def scale_axes(site: Site, topology: Topology) -> tuple[str, ...]:
    """Axes (of more than one rank) that cut one observation of ``site`` into shards: ``Shard``
    of a tensor dim, ``StridedShard``, ``FlatShard``. A population split (``Shard(None)``: other
    tokens on each rank) is not one: each rank casts its own tensor with its own scale."""
    out = []
    for name in topology.names:
        p = site.placement(name)
        if topology.axes[name].size > 1 and (p.is_flat_shard() or p.shard_dim() is not None):
            out.append(name)
    return tuple(out)


def check_blocks(recipe: Recipe, site: Site, topology: Topology) -> None:
    """Raise :class:`PlacementError` when a shard of ``site`` cuts ``recipe``'s scale blocks
    (the ranks would scale parts of one block apart, which no real cast does)."""
    br, bc = recipe.block
    if (br, bc) == (0, 0):
        return
    shape = site.logical_shape or (1,)
    last = len(shape) - 1
    for axis in scale_axes(site, topology):
        p = site.placement(axis)
        n = topology.axes[axis].size
        dim = p.shard_dim()
        where = f"{p} on axis {axis!r}"
        if p.is_flat_shard() or p.is_strided_shard():
            bad = f"{where} cuts the tensor at arbitrary points"
        elif dim == last:
            chunk = -(-shape[last] // n)
            bad = "" if bc and chunk % bc == 0 else f"{where} gives ranks {chunk} of {shape[last]} columns"
        elif br > 1:
            chunk = -(-shape[dim] // n) * math.prod(shape[dim + 1:last]) if dim == 0 else 0
            bad = "" if chunk and chunk % br == 0 else f"{where} cuts the rows of {br}-row blocks"
        else:
            bad = ""
        if bad:
            width = "rows" if bc == 0 else f"{br} x {bc}"
            raise PlacementError(
                f"recipe {recipe.name!r} scales blocks of {width} elements; {bad}, which splits blocks across "
                f"ranks; got {site.describe()}. Use a shard count whose shards hold whole blocks, select: other "
                "tensors, or recipe fp8-tensorwise (one scale per tensor, exact over any shards)")


class Held:
    """Copies of local shards kept for the second stage of two-stage sites, with the vectors
    computed from them (each site's copies are read once for both statistics of a recipe)."""

    def __init__(self) -> None:
        self.reading: dict[SiteKey, list[torch.Tensor]] = {}
        """Copies taken at this step's observations (one per observation, in order)."""
        self.step: dict[SiteKey, list[torch.Tensor]] = {}
        """The copies of the step whose rounds are running."""
        self.done: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self.two: set[SiteKey] = set()
        """Sites read in two stages (the tensor amax over ranks) at some step: their first-stage
        vectors hold one ``[amax, flag]`` per observation (:meth:`QuantStatistic.merge`)."""

    def begin(self) -> None:
        """Hand this step's copies to its rounds; the next observations start afresh."""
        self.step, self.reading, self.done = self.reading, {}, {}


class QuantStatistic(Statistic):
    """One half of a recipe's vectors of a site: ``part`` ``"sums"`` (op SUM) or ``"extremes"``
    (op MAX), reduced over every axis that splits the site. For a two-stage site
    (:meth:`two_stage`) stage 1 is ``[amax, NaN flag]`` per observation, MAX over
    :func:`scale_axes` (NOTE [NaN under MAX] in :mod:`tmetrics_core.metrics.statistics`)."""

    def __init__(self, recipe: Recipe, part: str, held: Held) -> None:
        self.recipe, self.part, self.held = recipe, part, held
        self.op: ReduceOpName = "sum" if part == "sums" else "max"
        r = recipe
        self.name = f"quant[{r.name},{r.element.name},{r.block[0]}x{r.block[1]},{r.scale_mode}]:{part}"
        self.width = len(SUM_FIELDS) if part == "sums" else len(MAX_FIELDS)

    def size(self, site: Site) -> int:
        return self.width

    def two_stage(self, site: Site, topology: Topology) -> bool:
        """Whether the recipe needs the tensor's amax over ranks: it scales by the tensor amax
        and some axis cuts the tensor."""
        return self.recipe.tensor_amax and bool(scale_axes(site, topology))

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        final = Stage(split_axes(site, topology, self.op, linear=False), self.op, self.width)
        if self.two_stage(site, topology):
            return (Stage(scale_axes(site, topology), "max", 2), final)
        return (final,)

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        return index > 0 or not self.two_stage(site, topology)

    def check(self, site: Site, topology: Topology) -> None:
        check_blocks(self.recipe, site, topology)

    def compute(self, tensors, sites, topology, rows):
        sums, maxes = quant_rows(self.recipe, tensors)
        return list((sums if self.part == "sums" else maxes).unbind(0))

    def merge(self, key: SiteKey, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Observations of a two-stage site under a recipe scaled by the tensor amax keep one
        ``[amax, flag]`` each (joined: each observation's copy is quantised with its own amax
        in :meth:`between`); the others merge by the op."""
        if self.recipe.tensor_amax and key in self.held.two:
            return torch.cat([x, y])
        return super().merge(key, x, y)

    def between(self, index, vector, site, topology):
        key = site.key
        done = (self.recipe, key)
        if done not in self.held.done:
            # The last copies, one per observation of this step (a step whose metric failed
            # before its rounds may have left older ones in front).
            copies = self.held.step.get(key, [])[-(vector.numel() // 2):]
            if copies:
                pairs = vector.reshape(-1, 2)
                amax = torch.where(pairs[:, 1] > 0, math.nan, pairs[:, 0])
                sums, maxes = quant_rows(self.recipe, copies, amax)
                sums, maxes = sums.sum(0), maxes.amax(0)
                if self.recipe.block == (0, 0) and not _first_shard(site, topology):
                    # One scale per tensor: counted by the shard holding element 0 alone.
                    sums[_BLOCK_FIELDS] = 0.0
                    maxes[_SCALE_FIELDS] = -math.inf
                self.held.done[done] = (sums, maxes)
            else:
                self.held.done[done] = (torch.zeros(len(SUM_FIELDS), dtype=torch.float64, device=vector.device),
                                       torch.full((len(MAX_FIELDS),), -math.inf, dtype=torch.float64,
                                                  device=vector.device))
        sums, maxes = self.held.done[done]
        return sums if self.part == "sums" else maxes
