"""The two-stage statistic behind mean row-wise (and column-wise) L2 norms of matrices."""

from __future__ import annotations

import math

import torch

from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.statistics import Stage, Statistic
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["RowL2"]


class RowL2(Statistic):
    """Two-stage statistic behind the mean row-wise L2 norm of a 2-D (or wider) tensor.

    The tensor is viewed as ``[rows, cols]`` with ``rows = shape[0]`` (``dim=0``) and the rest
    flattened; with ``dim=1`` the roles swap (columns of a ``[rows, cols]`` matrix).
    Stage 1: per-line sums of squares, summed over the axes that cut lines (``Shard`` on the
    other dim, ``FlatShard``); when every rank's line count follows from the site (no
    ``Shard(None)`` population split, no FlatShard), zero-padded to the lines of the largest
    shard (the first, as in ``torch.chunk``), so the vector has one length on every rank.
    Between: ``sqrt`` per local line, then ``[sum of line norms, line count]``. Stage 2: summed
    over the axes that split the line population (``Shard`` on the line dim, ``Owned``).
    Result: ``[sum of L2 norms of lines, number of lines]``.
    With a FlatShard the stage-1 vector spans all lines of its ``logical_shape``, so ranges
    that cut lines are summed exactly.
    """

    op = "sum"
    between_agreed = True

    def __init__(self, dim: int) -> None:
        assert dim in (0, 1), dim
        self.dim = dim
        self.name = "row_l2" if dim == 0 else "column_l2"

    def check(self, site: Site, topology: Topology) -> None:
        if len(site.logical_shape) < 2:
            raise PlacementError(f"{self.name} needs a tensor of 2 or more dims; got {site.describe()}")
        flats = [a for a, p in site.placements if p.is_flat_shard()]
        if len(flats) > 1:
            raise PlacementError(f"{self.name}: at most one FlatShard axis per tensor; got {site.describe()}")

    def _line_shape(self, site: Site, topology: Topology, *, largest: bool = False) -> tuple[int, int]:
        """(lines, line length) of the stage-1 vector space on this rank (``largest``: on the
        rank holding the largest shard, coordinate 0 everywhere)."""
        flat = self._flat(site, topology)
        coords = {} if largest else topology.coords()
        shape = flat.logical_shape if flat is not None else site.local_shape(
            coords, {n: a.size for n, a in topology.axes.items()})
        rows = shape[0]
        cols = 1
        for s in shape[1:]:
            cols *= s
        return (rows, cols) if self.dim == 0 else (cols, rows)

    def _flat(self, site: Site, topology: Topology):
        """The FlatShard placement, if any: the local tensor is then 1-D (even on a 1-rank axis)."""
        for _, p in site.placements:
            if p.is_flat_shard():
                return p
        return None

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        cut, population = [], []
        for name in topology.names:
            p = site.placement(name)
            if topology.axes[name].size == 1 or not p.splits():
                continue
            # A StridedShard splits its dim like a Shard: which entries a rank holds does not
            # matter to a sum over lines.
            split = p.shard_dim() if p.is_shard() or p.is_strided_shard() else -1
            if p.is_flat_shard() or (split != -1 and (split in (0, None)) != (self.dim == 0)):
                cut.append(name)
            else:
                population.append(name)
        lines, _ = self._line_shape(site, topology, largest=self._known_lines(site))
        return (Stage(tuple(cut), "sum", lines), Stage(tuple(population), "sum", 2))

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        return index > 0 or self._known_lines(site)

    @staticmethod
    def _known_lines(site: Site) -> bool:
        """Whether every rank's line count follows from the site: no population split
        (``Shard(None)``), no open dim and no FlatShard (whose logical shape is this rank's
        shard on the other axes), so stage-1 vectors can be padded to one length."""
        open_split = any(p.is_flat_shard() or (p.is_shard() and p.dim is None)  # type: ignore[attr-defined]
                         for _, p in site.placements)
        return all(d >= 0 for d in site.logical_shape) and not open_split

    def compute(self, tensors, sites, topology, rows):
        out = []
        for t, site in zip(tensors, sites):
            flat = self._flat(site, topology)
            lines, length = self._line_shape(site, topology)
            if flat is None:
                m = t.reshape(t.shape[0], math.prod(t.shape[1:]))
                if self.dim == 1:
                    m = m.t()
                sums = torch.linalg.vector_norm(m, dim=1, dtype=torch.float64).square()  # float64: no overflow
                if self._known_lines(site):
                    sums = torch.nn.functional.pad(sums, (0, self._line_shape(site, topology, largest=True)[0] - lines))
                out.append(sums)
                continue
            cols = 1
            for s in flat.logical_shape[1:]:
                cols *= s
            index = torch.arange(flat.start, flat.end, device=t.device)
            index = index // cols if self.dim == 0 else index % cols
            vec = torch.zeros(lines, dtype=torch.float64, device=t.device)
            vec.index_add_(0, index, t.reshape(-1).double().pow(2))
            out.append(vec)
        return out

    def placeholder(self, site, topology):
        """-inf per line: sums of squares are never negative, so :meth:`between` tells a tensor
        nobody read (a parameter without a gradient) from one whose lines are zero, and leaves
        its lines out of the count; summed with any rank's lines it stays -inf."""
        return torch.full((self.stages(site, topology)[0].size,), -math.inf, dtype=torch.float64)

    def between(self, index, vector, site, topology):
        lines = self._line_shape(site, topology)[0] if self._known_lines(site) else vector.numel()
        if site.holds(topology.coords()) and lines:
            # Lines of a tensor no rank read (placeholders, -inf) are not lines of the group;
            # a NaN line stays NaN. Decided on the device: no host read.
            sums = vector[:lines]
            read = sums != -math.inf
            return torch.stack([torch.where(read, sums, 0.0).sqrt().sum(), read.sum().to(torch.float64)])
        return torch.zeros(2, dtype=torch.float64, device=vector.device)
