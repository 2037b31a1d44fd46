"""Residual streams split by sequence across an axis that tmetrics took for a replica.

A block's input and output are observed by a forward hook as the tensors the block gets and
returns. Under sequence parallelism (torch's ``SequenceParallel`` plan, torchtitan's tensor
parallelism by default) they are plain local tensors holding each tensor-parallel rank's part
of the sequence: the same shape on every rank, so nothing in the observation says that the
ranks hold different tokens, and a site left ``Replica`` on ``tp`` is measured from one rank's
tokens (an L2 norm 1/sqrt(tp) of the whole).

So a residual site (and a module output's cotangent, :data:`SEQUENCE_CHECKED`) is checked
when it first enters the token plan: the sum of squares of its
first micro-batch is compared across every axis it is claimed ``Replica`` on (one
``all_reduce(MAX)`` of ``[v, -v]`` per such axis, for all new sites at once; then one host
agreement over the world, so every rank decides alike). Where the ranks' values differ
(relative spread above :data:`SPREAD`: copies of one tensor are bitwise equal, different
tokens differ at the first digit) the axis splits the site's rows: its placement there becomes
the population split ``Shard(None)``, from this step on, and the logging rank says so once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.placements import Shard
from tmetrics_core.reporter import Reporter
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.kinds import SEQUENCE_CHECKED
from tmetrics_core.topology import Topology

__all__ = ["SPREAD", "split_by_sequence"]

log = logging.getLogger("tmetrics")

SPREAD = 1e-6
"""Relative spread of the ranks' sums of squares above which a residual site's rows differ."""


def split_by_sequence(sites: dict[SiteKey, Site], new: Sequence[SiteKey],
                      sumsq: Callable[[SiteKey], torch.Tensor | None], executor: Executor,
                      topology: Topology, reporter: Reporter) -> list[tuple[SiteKey, str]]:
    """Check the new residual sites' ``Replica`` claims and make the axes whose ranks hold
    different rows a population split in ``sites`` (in place); call on every rank alike.

    Args:
        sites: the token plan's sites (the same on every rank).
        new: keys of the sites added to it at this step, in plan order.
        sumsq: this rank's sum of squares of a site's first observation this step (a 0-d
            float64 tensor on its device), or None where it has none (not observed here). Read
            on the host once per axis, after the all-reduce: at a site's first due step only.

    Returns:
        ``(site key, axis)`` of each claim found not to hold.
    """
    checked = [(k, axis) for k in new if sites[k].kind in SEQUENCE_CHECKED
               for axis in _replica_axes(sites[k], topology)]
    if not checked:
        return []
    spread: list[bool] = []
    order: list[tuple[SiteKey, str]] = []
    for axis in dict.fromkeys(a for _, a in checked):
        keys = [k for k, a in checked if a == axis]
        order += [(k, axis) for k in keys]
        none = torch.full((), -math.inf, dtype=torch.float64, device=executor.device)
        mine = [sumsq(k) for k in keys]
        v = torch.stack([none if x is None else x.to(executor.device, torch.float64) for x in mine])
        held = torch.tensor([x is not None for x in mine], device=executor.device)
        both = torch.cat([v, torch.where(held, -v, none)])
        executor.all_reduce(both, "max", axis)
        top, bottom = both[:len(keys)].tolist(), (-both[len(keys):]).tolist()
        spread += [math.isfinite(hi) and math.isfinite(lo) and hi - lo > SPREAD * max(abs(hi), abs(lo))
                   for hi, lo in zip(top, bottom)]
    split = [pair for pair, differs in zip(order, executor.any_ranks(spread)) if differs]
    axes_order = {a: i for i, a in enumerate(topology.names)}
    for key, axis in split:
        site = sites[key]
        placements = sorted((*site.placements, (axis, Shard(None))), key=lambda ap: axes_order[ap[0]])
        sites[key] = dataclasses.replace(site, placements=tuple(placements))
        if reporter.speaks:
            log.info("tmetrics: %s (%s) holds different tokens on the ranks of axis %r (sequence parallel): "
                     "measured as split by sequence there, not as one copy", site.name, site.kind, axis)
    return split


def _replica_axes(site: Site, topology: Topology) -> list[str]:
    """Axes of size > 1 with a group on which ``site`` has no placement (a Replica claim), less
    those whose ranks all lie in the group of an axis it is placed on (torchtitan's ``efsdp``
    or ``ep`` inside ``fsdp``): the placed axis already says how the site lies on those ranks,
    and their different tokens are its."""
    placed = {a for a, _ in site.placements}
    spans = [frozenset(topology.axes[a].ranks) for a in placed]
    return [a for a in topology.names
            if a not in placed and topology.axes[a].size > 1 and topology.axes[a].group is not None
            and not any(frozenset(topology.axes[a].ranks) <= span for span in spans)]
