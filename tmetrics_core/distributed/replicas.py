"""Replica verification: a ``Replica`` placement is checked against the values, never trusted.

A tensor that is ``Replica`` on an axis is counted once, so if the ranks of that axis in fact
hold different values (a Megatron-style tensor-parallel weight: a plain tensor of the same shape
on every rank; an all-gather MoE dispatcher's expert slices; experts numbered locally under
expert parallelism; a replica whose copy drifted) every norm would be silently wrong and
depend on the rank. Every Replica claim, whatever its origin (declared, framework, DTensor
``Replicate``, inferred), is therefore compared across its axis:

* each rank computes a fingerprint per tensor (:func:`fingerprints`, float64): presence, the
  sum, the sum of squares, the largest and smallest element (one read of the tensor with the
  fused moments kernel where it takes the tensor), and a position-weighted sum of
  ``SAMPLE`` evenly spaced elements, so pieces holding the same values in another order differ;
* the fingerprints of every checked tensor, of every source checked at that moment, are packed
  into one table and compared ONCE per axis by two all-reduces over the axis group (bounded by
  the collective timeout): a MAX of each column and of its negation (the group's max and min:
  equal exactly when every rank holding the tensor has the same value; NaN rides as a flag
  column) and a SUM of the presence column (how many ranks hold it). Per-rank bytes follow the
  number of claims, not the axis size; only when some copies differ is the table all-gathered
  over the axis, to name the ranks and their fingerprints;
* one tiny world collective agrees whether any rank found a difference, so the
  :class:`~tmetrics_core.errors.PlacementError` is raised on EVERY rank (ranks of other groups
  of the axis included), never leaving one waiting in a collective; where every checked axis
  spans the whole world (plain DDP), every rank saw the same tables and this step is skipped.

NOTE [exact comparison]: fingerprints are compared for equality, bit for bit, with no
tolerance. Replicas are bitwise equal by construction: DDP, FSDP/HSDP and DTensor ``Replicate``
make them from one all-reduce result that every rank receives identically, and the optimizer then
applies the same deterministic arithmetic to the same bits; the fingerprint of equal bits is the
same float64 number on every rank (same kernel, shape, dtype and device type). A tolerance would
let a replica that drifted by a few ulps pass, and gains nothing: a NaN or Inf compares equal
to itself here. Ranks of one axis on different device types (a CPU and a GPU rank of one group)
could differ in the last bits of a float64 sum; tmetrics does not support such mixed groups.

Tensors absent on a rank (held elsewhere, or a gradient that is None) are not compared there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence, cast

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.errors import PlacementError
from tmetrics_core.kernels.rows import rows
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.topology import Topology

__all__ = ["FINGERPRINT", "ReplicaClaim", "fingerprints", "replica_claims", "verify_replicas"]

FINGERPRINT = ("present", "sum", "sumsq", "max", "min", "sampled")
"""The columns of :func:`fingerprints`."""

SAMPLE = 64
"""Elements, evenly spaced in the flattening, in the position-weighted column."""

_SHOWN = 4
"""Tensors named in full in one error; the others are counted."""

_ROW_PARALLEL = ("attn.o", "mlp.down", "mlp.fc2", "down", "fc2", "o_proj", "down_proj", "linear_proj", "linear_fc2")
"""Components whose tensor-parallel split is along the input features (dim 1, row parallel)."""


@dataclass(frozen=True, slots=True)
class ReplicaClaim:
    """One tensor claimed ``Replica`` on ``axis``: its site (whose ``kind`` is the source:
    ``param``, ``grad``...) and where the claim came from (``declared``, ``framework``,
    ``dtensor``, ``inferred``)."""

    site: Site
    axis: str
    origin: str


def replica_claims(sites: Sequence[Site], topology: Topology, origins: Mapping[str, Mapping[str, str]]
                   ) -> list[ReplicaClaim]:
    """Every ``(site, axis)`` whose placement on an axis of size > 1 is ``Replica``, in site
    order then axis order (rank-symmetric: sites are). ``origins``: canonical name ->
    ``{axis: origin}`` from the manifest; an axis ``covered`` by the tensor's own DTensor mesh
    is no claim."""
    claims = []
    for site in sites:
        held = site.placement_map
        for axis in topology.names:
            origin = origins.get(site.name, {}).get(axis, "inferred")
            if topology.axes[axis].size > 1 and axis not in held and origin != "covered":
                claims.append(ReplicaClaim(site, axis, origin))
    return claims


@torch.no_grad()
def fingerprints(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``[len(tensors), 6]`` float64 on ``device``: per tensor the columns of :data:`FINGERPRINT`;
    a None tensor is a row of zeros (``present`` 0), an empty one ``[1, 0, 0, -inf, inf, 0]``.

    The sums and extremes are one rows pass over all the tensors
    (:func:`~tmetrics_core.kernels.rows.rows`, batched ops, float64 accumulation on CPU): a
    tensor's row is a deterministic function of its bits, its shape, its dtype and its device
    type, which are the same on every rank of an axis (the ranks hold the same kind of tensor
    there); one copy to the host for all of them. The ``sampled`` column is ``sum(w_i * x[p_i])`` over
    ``SAMPLE`` evenly spaced flat positions ``p_i`` (rounded; repeated in tensors of fewer
    elements) with weights ``w_i = 1..SAMPLE``.
    """
    out = torch.zeros(len(tensors), len(FINGERPRINT), dtype=torch.float64)
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return out.to(device)
    out[present, 0] = 1.0
    held = [cast("torch.Tensor", tensors[i]).detach() for i in present]
    # rows' fields are (sumsq, sum, max, min, zeros): the fingerprint's are (sum, sumsq, max, min)
    out[present, 1:5] = rows(held, ("sumsq", "sum", "max", "min"))[:, [1, 0, 2, 3]].cpu()
    sampled = [k for k, t in enumerate(held) if t.numel()]
    if sampled:
        picks = torch.stack([_sample(held[k]) for k in sampled]).cpu()
        out[[present[k] for k in sampled], 5] = picks @ torch.arange(1, SAMPLE + 1, dtype=torch.float64)
    return out.to(device)


def _sample(x: torch.Tensor) -> torch.Tensor:
    """``SAMPLE`` elements of ``x`` (non-empty) at evenly spaced flat positions (repeated when
    ``x`` has fewer), as float64."""
    return x.reshape(-1)[_positions(x.numel(), x.device)].to(torch.float64)


@functools.lru_cache(maxsize=256)
def _positions(numel: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(0, numel - 1, SAMPLE, dtype=torch.float64, device=device).round().long()


def verify_replicas(claims: Sequence[ReplicaClaim], tensors: Mapping[SiteKey, torch.Tensor | None], *,
                    topology: Topology, executor: Executor, when: str) -> list[tuple[str, str, str]]:
    """Check every claim of ``claims`` (rank-symmetric) against the local ``tensors`` (site key
    ``(canonical name, kind)`` -> this rank's local tensor, None or absent when not held): one
    comparison of a packed fingerprint table per axis (two all-reduces; the table is gathered
    only where copies differ), then one world agreement.

    Args:
        when: for the message, e.g. ``"at start-up"`` or ``"at step 3"``.

    Returns:
        ``(canonical name, kind, axis)`` of every claim that held on every rank of this rank's
        group of the axis (at least two of them holding the tensor).

    Raises:
        PlacementError: on every rank when the copies of some claimed Replica differ on any
            group of its axis; the message names each tensor, the axis, the global ranks, their
            fingerprints and the likely fix.
    """
    by_axis: dict[str, list[ReplicaClaim]] = {}
    for claim in claims:
        by_axis.setdefault(claim.axis, []).append(claim)
    problems: list[str] = []
    checked: list[tuple[str, str, str]] = []
    for axis, group in by_axis.items():
        mine = fingerprints([tensors.get(c.site.key) for c in group], executor.device)
        holding, differs = _compare(mine, axis, executor)
        if not differs.any():
            checked.extend((c.site.name, c.site.kind, axis) for c, n in zip(group, holding.tolist()) if n >= 2)
            continue
        table = torch.stack(executor.gather(mine, axis)).cpu()  # [axis ranks, claims, columns]
        ranks = topology.axes[axis].ranks
        for index, claim in enumerate(group):
            rows = table[:, index]
            present = [r for r in range(rows.shape[0]) if rows[r, 0] != 0]
            if len(present) < 2:  # nothing to compare in this group
                continue
            if all(_same(rows[present[0]], rows[r]) for r in present[1:]):
                checked.append((claim.site.name, claim.site.kind, axis))
                continue
            problems.append(_describe(claim, [(ranks[r], rows[r]) for r in present], topology))
    # Where every checked axis spans the world, every rank saw the same tables: no agreement needed.
    alone = all(topology.axes[a].size == topology.world_size for a in by_axis)
    if problems if alone else executor.any_rank(bool(problems)):
        everyone = [problems] if alone else executor.gather_objects(problems)
        unique = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
        shown = "\n  ".join(unique[:_SHOWN])
        more = f"\n  ... and {len(unique) - _SHOWN} more" if len(unique) > _SHOWN else ""
        raise PlacementError(
            f"tensors claimed Replica differ across ranks ({when}); measuring them as replicas would count "
            f"one rank's copy as the whole tensor:\n  {shown}{more}\nIf the copies were meant to be equal (data "
            "parallel replicas), their synchronisation failed: check the gradient all-reduce. To skip this check "
            "(not advised), set distributed.verify_replicas: never."
        )
    return checked


def _compare(mine: torch.Tensor, axis: str, executor: Executor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``mine`` (this rank's ``[claims, 6]`` fingerprints): how many ranks of the
    axis group hold the tensor, and whether the holders' fingerprints differ in any bit (NaN
    equal to NaN, NOTE [exact comparison]); two all-reduces over the axis, on CPU results."""
    present = mine[:, 0] != 0
    values = mine[:, 1:]
    columns = torch.cat([values.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf), values.isnan().double()], 1)
    spread = torch.cat([columns, -columns], 1)
    spread[~present] = -math.inf  # absent: no say in the max nor the min
    executor.all_reduce(spread, "max", axis)
    holding = present.to(torch.int64)
    executor.all_reduce(holding, "sum", axis)
    width = columns.shape[1]
    differs = (spread[:, :width] != -spread[:, width:]).any(1) & (holding >= 2)
    return holding.cpu(), differs.cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two fingerprint rows, NaN equal to NaN (NOTE [exact comparison])."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _describe(claim: ReplicaClaim, rows: list[tuple[int, torch.Tensor]], topology: Topology) -> str:
    site, axis = claim.site, claim.axis
    size = topology.axes[axis].size
    shape = list(site.local_shape(topology.coords(), {a.name: a.size for a in topology.axes.values()}))
    prints = "; ".join(f"rank {rank}: sum={row[1].item():.9g} sumsq={row[2].item():.9g} "
                       f"max={row[3].item():.9g} min={row[4].item():.9g} sampled={row[5].item():.9g}"
                       for rank, row in rows)
    return (f"{site.name!r} [{site.kind}] {claim.origin} Replica on axis {axis!r}, local shape {shape}, differs on global "
            f"ranks {[rank for rank, _ in rows]} ({prints}). Likely fix: {_fix(site, axis, size, shape, claim.origin)}")


def _fix(site: Site, axis: str, size: int, shape: list[int], origin: str) -> str:
    """What to declare: the shard dim the shapes suggest, expert_offset for locally numbered
    experts, or Owned when one rank's copy is the one to measure."""
    fixes = []
    if site.expert is not None:
        fixes.append(f"experts numbered locally on each {axis!r} rank: pass expert_offset= (the first global "
                     "expert index this rank holds) so each expert gets its global name")
    if shape:
        component = site.name.rsplit(".", 1)[0]
        dim = 1 if len(shape) > 1 and component.endswith(_ROW_PARALLEL) else 0
        full = list(shape)
        full[dim] *= size
        fixes.append(f"a plain tensor split across {axis!r} (tensor parallel without DTensor, full shape {full}): "
                     f"declare placements: {{'{site.name}': {{'{axis}': 'S{dim}'}}}}")
    fixes.append(f"one rank's copy is the tensor: placements: {{'{site.name}': {{'{axis}': 'O0'}}}}")
    if origin == "declared":
        fixes.insert(0, f"the config's placements: declare it Replica on {axis!r}; fix that entry")
    return "; or ".join(fixes)
