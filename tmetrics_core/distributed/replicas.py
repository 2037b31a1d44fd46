"""Replica verification: a ``Replica`` placement is checked against the values, never trusted.

A tensor that is ``Replica`` on an axis is counted once, so if the ranks of that axis in fact
hold different values (a Megatron-style tensor-parallel weight: a plain tensor of the same shape
on every rank; an all-gather MoE dispatcher's expert slices; experts numbered locally under
expert parallelism; a replica whose copy drifted) every norm would be silently wrong and
depend on the rank. Every Replica claim, whatever its origin (declared, framework, DTensor
``Replicate``, inferred), is therefore compared across its axis:

* each rank computes a fingerprint per tensor (:func:`fingerprints`, float64): presence, the
  sum, the sum of squares, and two position-weighted sums (weights ``1..n`` along the first and
  along the last dim), so shards that are permutations of each other differ too;
* the fingerprints of every checked tensor are packed into one ``[tensors, 5]`` table and
  all-gathered ONCE per axis (``Executor.gather``, bounded by the collective timeout);
* one tiny world collective agrees whether any rank found a difference, so the
  :class:`~tmetrics_core.errors.PlacementError` is raised on EVERY rank (ranks of other groups
  of the axis included), never leaving one waiting in a collective.

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

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.errors import PlacementError
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["FINGERPRINT", "ReplicaClaim", "fingerprints", "replica_claims", "verify_replicas"]

FINGERPRINT = ("present", "sum", "sumsq", "row-weighted", "column-weighted")
"""The columns of :func:`fingerprints`."""

_SHOWN = 4
"""Tensors named in full in one error; the others are counted."""

_ROW_PARALLEL = ("attn.o", "mlp.down", "mlp.fc2", "down", "fc2", "o_proj", "down_proj", "linear_proj", "linear_fc2")
"""Components whose tensor-parallel split is along the input features (dim 1, row parallel)."""


@dataclass(frozen=True, slots=True)
class ReplicaClaim:
    """One tensor claimed ``Replica`` on ``axis``: its site and where the claim came from
    (``declared``, ``framework``, ``dtensor``, ``inferred``)."""

    site: Site
    axis: str
    origin: str


def replica_claims(sites: Sequence[Site], topology: Topology, origins: Mapping[str, Mapping[str, str]]
                   ) -> list[ReplicaClaim]:
    """Every ``(site, axis)`` whose placement on an axis of size > 1 is ``Replica``, in site
    order then axis order (rank-symmetric: sites are). ``origins``: canonical name ->
    ``{axis: origin}`` from the manifest."""
    claims = []
    for site in sites:
        held = site.placement_map
        for axis in topology.names:
            if topology.axes[axis].size > 1 and axis not in held:
                claims.append(ReplicaClaim(site, axis, origins.get(site.name, {}).get(axis, "inferred")))
    return claims


@torch.no_grad()
def fingerprints(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``[len(tensors), 5]`` float64 on ``device``: per tensor the columns of :data:`FINGERPRINT`;
    a None tensor is a row of zeros (``present`` 0). Sums are accumulated in float64 from the
    tensor's own values; the weighted sums use weights ``1..n`` along dim 0 and along the last
    dim (a scalar's are its value), so equal multisets of values at other positions differ."""
    rows = []
    for t in tensors:
        if t is None:
            rows.append(torch.zeros(5, dtype=torch.float64, device=device))
            continue
        x = t.detach().to(torch.float64)
        if x.numel() == 0:  # an empty shard (uneven FSDP): present, all sums zero
            rows.append(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=device))
            continue
        if x.dim() == 0:
            x = x.reshape(1, 1)
        first = x.reshape(x.shape[0], -1).sum(1)
        last = x.reshape(-1, x.shape[-1]).sum(0)
        weights = (torch.arange(1, first.numel() + 1, dtype=torch.float64, device=x.device),
                   torch.arange(1, last.numel() + 1, dtype=torch.float64, device=x.device))
        row = torch.stack([torch.ones((), dtype=torch.float64, device=x.device), x.sum(), (x * x).sum(),
                           (first * weights[0]).sum(), (last * weights[1]).sum()])
        rows.append(row.to(device))
    if not rows:
        return torch.zeros(0, 5, dtype=torch.float64, device=device)
    return torch.stack(rows)


def verify_replicas(claims: Sequence[ReplicaClaim], tensors: Mapping[str, torch.Tensor | None], *, kind: str,
                    topology: Topology, executor: Executor, when: str) -> list[tuple[str, str]]:
    """Check every claim of ``claims`` (rank-symmetric) against the local ``tensors`` (canonical
    name -> this rank's local tensor of source ``kind``, None or absent when not held): one
    all_gather of a packed fingerprint table per axis, then one world agreement.

    Args:
        when: for the message, e.g. ``"at start-up"`` or ``"at step 3"``.

    Returns:
        ``(canonical name, axis)`` of every claim that held on every rank of its axis group.

    Raises:
        PlacementError: on every rank when the copies of some claimed Replica differ on any
            group of its axis; the message names each tensor, the axis, the global ranks, their
            fingerprints and the likely fix.
    """
    by_axis: dict[str, list[ReplicaClaim]] = {}
    for claim in claims:
        by_axis.setdefault(claim.axis, []).append(claim)
    problems: list[str] = []
    checked: list[tuple[str, str]] = []
    for axis, group in by_axis.items():
        mine = fingerprints([tensors.get(c.site.name) for c in group], executor.device)
        table = torch.stack(executor.gather(mine, axis)).cpu()  # [axis ranks, claims, 5]
        ranks = topology.axes[axis].ranks
        for index, claim in enumerate(group):
            rows = table[:, index]
            present = [r for r in range(rows.shape[0]) if rows[r, 0] != 0]
            if all(_same(rows[present[0]], rows[r]) for r in present[1:]):  # vacuous with 0 or 1 holders
                checked.append((claim.site.name, axis))
                continue
            problems.append(_describe(claim, kind, [(ranks[r], rows[r]) for r in present], topology))
    if executor.any_rank(bool(problems)):
        everyone = executor.gather_objects(problems)
        unique = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
        shown = "\n  ".join(unique[:_SHOWN])
        more = f"\n  ... and {len(unique) - _SHOWN} more" if len(unique) > _SHOWN else ""
        raise PlacementError(
            f"tensors claimed Replica differ across ranks ({kind}, {when}); measuring them as replicas would count "
            f"one rank's copy as the whole tensor:\n  {shown}{more}\nIf the copies were meant to be equal (data "
            "parallel replicas), their synchronisation failed: check the gradient all-reduce. To skip this check "
            "(not advised), set distributed.verify_replicas: never."
        )
    return checked


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two fingerprint rows, NaN equal to NaN (NOTE [exact comparison])."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _describe(claim: ReplicaClaim, kind: str, rows: list[tuple[int, torch.Tensor]], topology: Topology) -> str:
    site, axis = claim.site, claim.axis
    size = topology.axes[axis].size
    shape = list(site.local_shape(topology.coords(), {a.name: a.size for a in topology.axes.values()}))
    prints = "; ".join(f"rank {rank}: sum={row[1].item():.9g} sumsq={row[2].item():.9g} "
                       f"weighted={row[3].item():.9g}/{row[4].item():.9g}" for rank, row in rows)
    return (f"{site.name!r} [{kind}] {claim.origin} Replica on axis {axis!r}, local shape {shape}, differs on global "
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
