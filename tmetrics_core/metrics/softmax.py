"""Per-row softmax summaries of ``[rows, classes]`` tensors: entropy and log-partition.

One statistic serves output-logit entropy, router decision entropy and the router z-loss.
Each row ``z`` (logits) defines ``p = softmax(z)``; the statistic sums, over the rows of a
group, ``H(p) = -sum_j p_j log p_j`` (nats), ``H(p) / log C`` (``C`` classes), the log-partition
``lse = log sum_j exp(z_j)`` and ``lse**2``, and counts the rows. Rows given as probabilities
(router scores) are read as ``z = log p``: the row is normalized to sum 1 and ``lse`` is the log
of the row sum (0 for a softmax output).

Rows may be split across ranks along the class dim (``Shard(1)`` on ``tp``: a vocab-parallel
head, or router logits split by expert). Each rank then summarizes its part of every row as
``(m, s, t)`` with ``m = max z``, ``s = sum exp(z - m)``, ``t = sum exp(z - m) (z - m)`` and puts
the triple into its own slot of a vector ``[slots, rows, 3]`` (slots: one per rank of the axes
that cut rows); one SUM over those axes hands every rank all parts, which combine exactly:
``M = max m_k``, ``S = sum s_k e^(m_k - M)``, ``T = sum (t_k + s_k (m_k - M)) e^(m_k - M)``,
``lse = M + log S``, ``H = log S - T / S``. A second stage sums the row summaries over the axes
that split the row population (tokens across ``dp``, ``Owned`` on ``pp``).
All arithmetic is float64, in chunks of rows.

Local vectors start with a header: 0 for finished row sums, the slot count for a slot table.
Micro-batches merge by adding finished sums and by appending the rows of slot tables
(:meth:`RowSoftmax.merge_vectors`, used by :class:`RowSoftmaxMetric`); after the SUM over the
cut axes the header is ignored.
"""

from __future__ import annotations

import math

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.statistics import Stage, Statistic
from tmetrics_core.site import Site

__all__ = ["ROW_FIELDS", "RowSoftmax", "RowSoftmaxMetric"]

ROW_FIELDS = ("entropy", "normalized_entropy", "lse", "lse_sq", "rows")
"""Entries of the finished vector, all sums over rows."""

_CHUNK_ELEMENTS = 1 << 20


class RowSoftmax(Statistic):
    """Sums over rows of ``[H, H / log C, lse, lse**2]`` and the row count (``ROW_FIELDS``).

    Args:
        probability_kinds: site kinds whose rows are probabilities, not logits.

    Sites must be 2-D ``[rows, classes]``. Supported placements: population splits of rows
    (``Shard(None)``, ``Shard(0)``), ``Owned``, ``Replica``, ``Shard(1)`` (class split, see the
    module docstring); ``Partial`` is materialized first. ``FlatShard`` is rejected: a flat range
    cuts rows at arbitrary points.
    """

    op = "sum"

    between_agreed = True

    def __init__(self, probability_kinds: frozenset[str] = frozenset()) -> None:
        self.probability_kinds = frozenset(probability_kinds)
        kinds = ",".join(sorted(self.probability_kinds))
        self.name = f"softmax_rows[{kinds}]"

    def check(self, site: Site, topology: Topology) -> None:
        if len(site.logical_shape) != 2:
            raise PlacementError(
                f"{self.name}: needs a [rows, classes] tensor; got {site.describe()}. Token sites "
                "are flattened to [tokens, features] by the sources; observe a 2-D tensor"
            )
        for axis, p in site.placements:
            if p.is_flat_shard():
                raise PlacementError(
                    f"{self.name}: a FlatShard on axis {axis!r} cuts rows at arbitrary points, so row "
                    f"softmax cannot be formed; got {site.describe()}. Observe the tensor as Shard(0) "
                    "or Shard(1), or replicated"
                )
            dim = p.shard_dim()
            if dim is not None and dim > 1:
                raise PlacementError(f"{self.name}: {p} (dim {dim}) on a 2-D tensor; got {site.describe()}")
            if p.is_strided_shard() and dim == 1:
                raise PlacementError(
                    f"{self.name}: {p} on axis {axis!r} interleaves the classes across ranks; a class split "
                    f"must be a plain Shard(1); got {site.describe()}")

    def _split(self, site: Site, topology: Topology) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(axes that cut rows, axes that split the row population), in topology order."""
        cut: list[str] = []
        population: list[str] = []
        for name in topology.names:
            p = site.placement(name)
            if topology.axes[name].size == 1 or not p.splits():
                continue
            (cut if p.is_shard(1) else population).append(name)
        return tuple(cut), tuple(population)

    def stages(self, site: Site, topology: Topology) -> tuple[Stage, ...]:
        cut, population = self._split(site, topology)
        if not cut:
            return (Stage(population, "sum", 1 + len(ROW_FIELDS)),)
        # Placeholders (sites held elsewhere) are placeholders on the whole cut group, so they
        # agree on a table without rows.
        return (Stage(cut, "sum", 1), Stage(population, "sum", 1 + len(ROW_FIELDS)))

    def uniform(self, site: Site, topology: Topology, index: int) -> bool:
        """The finished sums have one length everywhere; a slot table (class split) has the
        local rows in it."""
        return index > 0 or not self._split(site, topology)[0]

    def compute(self, tensors, sites, topology, rows):
        out = []
        for tensor, site in zip(tensors, sites):
            cut, _ = self._split(site, topology)
            classes = site.logical_shape[-1]
            if not cut:
                if site.kind in self.probability_kinds:
                    out.append(_summed(*_probability_rows(tensor), classes))
                else:
                    out.append(_finished(*_row_parts(tensor, False), classes))
                continue
            slots = math.prod(topology.axes[a].size for a in cut)
            slot = 0
            for a in cut:
                slot = slot * topology.axes[a].size + topology.axes[a].rank
            m, s, t = _row_parts(tensor, site.kind in self.probability_kinds)
            # Zeros elsewhere: the SUM leaves each slot exactly as its owner wrote it.
            table = torch.zeros((slots, m.numel(), 3), dtype=torch.float64, device=tensor.device)
            table[slot] = torch.stack([m, s, t], dim=1)
            header = torch.full((1,), float(slots), dtype=torch.float64, device=tensor.device)
            out.append(torch.cat([header, table.reshape(-1)]))
        return out

    def merge_vectors(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two observations of one site: finished sums add; slot tables append their rows."""
        slots = int(a[0])
        if slots == 0:
            return a + b
        rows = torch.cat([a[1:].reshape(slots, -1, 3), b[1:].reshape(slots, -1, 3)], dim=1)
        return torch.cat([a[:1], rows.reshape(-1)])

    def between(self, index, vector, site, topology):
        if vector.numel() <= 1:
            return torch.zeros(1 + len(ROW_FIELDS), dtype=torch.float64, device=vector.device)
        cut, _ = self._split(site, topology)
        slots = math.prod(topology.axes[a].size for a in cut)
        table = vector[1:].reshape(slots, -1, 3)
        # An empty shard wrote m = -inf, s = 0: it weighs nothing.
        m, s, t = table[:, :, 0], table[:, :, 1], table[:, :, 2]
        top = m.max(dim=0).values
        scale = torch.where(s > 0, torch.exp(m - top), torch.zeros_like(s))
        total_s = (s * scale).sum(dim=0)
        total_t = ((t + s * (m - top).nan_to_num(neginf=0.0)) * scale).sum(dim=0)
        return _finished(top, total_s, total_t, site.logical_shape[-1])


def _row_parts(tensor: torch.Tensor, probabilities: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(m, s, t)`` of a local ``[rows, c]`` tensor in float64 (empty rows: -inf, 0, 0)."""
    x = tensor.detach()
    rows = x.shape[0] if x.dim() else 0
    width = x.shape[1] if x.dim() == 2 else 0
    if not rows or not width:
        empty = torch.zeros(rows, dtype=torch.float64, device=x.device)
        return empty - math.inf, empty.clone(), empty.clone()
    ms, ss, ts = [], [], []
    step = max(1, _CHUNK_ELEMENTS // width)
    for block in x.split(step):
        z = block.to(torch.float64)
        if probabilities:
            z = torch.log(z)
        m = z.max(dim=1).values
        shifted = z - m.unsqueeze(1)
        e = torch.exp(shifted)
        ms.append(m)
        ss.append(e.sum(dim=1))
        ts.append(torch.where(e > 0, e * shifted, torch.zeros_like(e)).sum(dim=1))
    return torch.cat(ms), torch.cat(ss), torch.cat(ts)


def _probability_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(H, lse)`` of a whole ``[rows, c]`` table of probabilities in float64, without
    logarithms of the table: with ``S = sum_j p_j``, ``H = log S + sum_j entr(p_j) / S`` (the
    entropy of ``p / S``; ``entr(x) = -x log x``, 0 at 0) and ``lse = log S``."""
    p = tensor.detach()
    if p.dim() != 2 or not p.shape[0] or not p.shape[1]:
        empty = torch.zeros(p.shape[0] if p.dim() else 0, dtype=torch.float64, device=p.device)
        return empty, empty
    p = p.to(torch.float64)
    total = p.sum(dim=1)
    lse = torch.log(total)
    return lse + torch.special.entr(p).sum(dim=1) / total, lse


def _finished(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor, classes: int) -> torch.Tensor:
    """``[0 (header), sum H, sum H / log C, sum lse, sum lse**2, rows]`` from per-row parts."""
    return _summed(torch.log(s) - t / s, m + torch.log(s), classes)


def _summed(entropy: torch.Tensor, lse: torch.Tensor, classes: int) -> torch.Tensor:
    """``[0 (header), sum H, sum H / log C, sum lse, sum lse**2, rows]`` from per-row ``H``, ``lse``."""
    rows = entropy.numel()
    if not rows:
        return torch.zeros(1 + len(ROW_FIELDS), dtype=torch.float64, device=entropy.device)
    norm = math.log(classes) if classes > 1 else math.nan
    total = entropy.sum()
    zero = torch.zeros((), dtype=torch.float64, device=entropy.device)
    return torch.stack([zero, total, total / norm, lse.sum(), lse.square().sum(),
                        torch.full((), float(rows), dtype=torch.float64, device=entropy.device)])


class RowSoftmaxMetric(StatMetric):
    """Base of metrics on one :class:`RowSoftmax` statistic: merges micro-batches with
    :meth:`RowSoftmax.merge_vectors` and hands ``finalize`` the finished sums by field name
    (``stats["entropy"]``, ``stats["rows"]``...)."""

    def merge(self, a, b):
        stat = self.statistics[0]
        out = dict(a)
        for key, vectors in b.items():
            out[key] = [stat.merge_vectors(out[key][0], vectors[0])] if key in out else vectors  # type: ignore[attr-defined]
        return out

    def finalize(self, stats):
        sums = stats[self.statistics[0].name][1:]
        return self.from_rows(dict(zip(ROW_FIELDS, sums)))

    def from_rows(self, sums: dict[str, float]) -> float:
        """The value from the row sums of the group (fields of :data:`ROW_FIELDS`)."""
        raise NotImplementedError(f"{type(self).__name__}.from_rows")
