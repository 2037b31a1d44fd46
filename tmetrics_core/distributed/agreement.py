"""The failure agreement of a due step: which metrics every rank skips, and why.

A metric that raises on one rank must be skipped on every rank, or the others wait in a
collective it never issues. :class:`Agreement` settles that in one ``all_reduce(MAX)`` of a
small int64 vector on the host, over the control group (no wait for the accelerator), and rides
a few more facts of the step in the same call: the metrics fed on no rank, a caller's flag,
whether the model changed, the step number (its max and its negated min: ranks at different
steps are an error), and whether any rank has device checks.

Device checks (:class:`DeviceCheck`: conditions on the step's inputs known only on the device)
are reduced with MAX over the world on the device after the rounds and read with the results'
copy (:meth:`Agreement.device_flags`, :meth:`Agreement.fail_checked`): no host read of their
own. The error texts are gathered only on the failure path.

The executor owns the collectives; this module is handed them as two calls (see
:class:`Agreement`), so every collective still goes through the executor's counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, NamedTuple, Sequence

import torch

from tmetrics_core.errors import TMetricsError
from tmetrics_core.topology import Topology

__all__ = ["Agreed", "Agreement", "DeviceCheck", "MetricFailure", "failed_checks"]


@dataclass(frozen=True, slots=True)
class MetricFailure:
    """A metric skipped on every rank at one step because it raised on ``ranks``."""

    metric: str
    ranks: tuple[int, ...]
    error: str


class DeviceCheck(NamedTuple):
    """A condition on the step's inputs known only on the device (e.g. no token dropped over an
    expert's capacity): unless ``ok`` (a 0-d bool tensor) holds, the due metrics ``metrics``
    fail with ``reason``. Read with the step's other host reads, never alone (no
    synchronisation of its own on an accelerator)."""

    ok: torch.Tensor
    reason: str
    metrics: frozenset[str]


@dataclass(frozen=True, slots=True)
class Agreed:
    """What one agreement settled, the same on every rank.

    Attributes:
        failures: the metrics that raised on some rank (ranks and the lowest one's error).
        unfed: the metrics fed on no rank (and raised on none), when ``unfed`` was asked.
        flagged: whether any rank passed a true ``flag`` (None where no flag was asked).
        changed: whether any rank passed ``changed=True`` (None where no ``changed`` was asked:
            an agreement after a round, which must not clear the step's answer).
        checks: whether any rank has device checks.
    """

    failures: list[MetricFailure]
    unfed: tuple[str, ...] | None
    flagged: bool | None
    changed: bool | None
    checks: bool


class Agreement:
    """The failure agreement over a :class:`Topology` (see the module docstring).

    Args:
        topology: the named axes (world size and this rank's global rank).
        world_max: host ints (same length on every rank) MAX-reduced over every rank: one
            counted collective over the control group (the executor's).
        gather_objects: every rank's picklable object over the world, in rank order (the
            executor's; slow paths only).
        reduce_device: a float64 tensor MAX-reduced in place over the world, on the group that
            carries its device (the executor's).
    """

    def __init__(self, topology: Topology, *, world_max: Callable[[Sequence[int]], list[int]],
                 gather_objects: Callable[[Any], list[Any]],
                 reduce_device: Callable[[torch.Tensor], None]) -> None:
        self.topology = topology
        self._world_max = world_max
        self._gather_objects = gather_objects
        self._reduce_device = reduce_device
        self._distributed = topology.world_size > 1

    def agree(self, names: Sequence[str], errors: Sequence[str | None], *, unfed: Collection[str] = (),
              flag: bool | None = None, checks: bool = False, step: int | None = None,
              changed: bool | None = None) -> Agreed:
        """Metrics (``names``, config order) that raised on any rank (``errors``: this rank's
        error text per metric, None where none), in one ``all_reduce(MAX)`` on the host over the
        world of ``[raised per metric, fed per metric, step, -step, changed, flag, checks]``.
        Only when some metric raised does a second collective gather the error texts, to name
        the failing ranks and the lowest one's error. ``unfed`` (not empty), ``flag`` and
        ``changed`` (not None) are answered only where given.

        Raises:
            TMetricsError: on every rank, when ranks passed different ``step`` numbers.
        """
        n = len(names)
        mine = [1 if e else 0 for e in errors] + [0 if name in unfed else 1 for name in names]
        mine += [step or 0, -(step or 0), 1 if changed else 0, 1 if flag else 0, 1 if checks else 0]
        agreed = self._world_max(mine) if self._distributed else mine
        if agreed[-5] != -agreed[-4]:
            raise TMetricsError(
                f"ranks measured different step numbers in one due step (from {-agreed[-4]} to {agreed[-5]}): "
                "every rank must enter metrics.step(n) with the same n, the optimizer step's number; their values "
                "would be combined across steps. Count steps the same way on every rank (e.g. from the "
                "optimizer's or the trainer's global step)")
        raised = agreed[:n]
        texts = self._gather_objects(list(errors)) if any(raised) else None
        fed_nowhere = (tuple(name for index, name in enumerate(names) if not agreed[n + index] and not raised[index])
                       if unfed else None)
        failures = []
        for index, name in enumerate(names):
            if texts is None or not raised[index]:
                continue
            ranks = tuple(r for r, theirs in enumerate(texts) if theirs[index] is not None)
            error = texts[ranks[0]][index]
            failures.append(MetricFailure(name, ranks, error or f"raised on rank(s) {list(ranks)}"))
        return Agreed(failures, fed_nowhere, bool(agreed[-2]) if flag is not None else None,
                      bool(agreed[-3]) if changed is not None else None, bool(agreed[-1]))

    def device_flags(self, names: Sequence[str], checks: Sequence[DeviceCheck],
                     device: torch.device) -> list[torch.Tensor]:
        """``[failed per metric, this rank's check flags]`` on the device, for the results' copy:
        a metric of ``names`` fails where a check that names it is false (a flag is read as a
        bool: nonzero holds), MAX-reduced over the world (every rank issues it when any rank has
        checks; a rank without checks sends zeros). ``device``: the collectives' device (one
        process: where the checks are, so no copy comes before the results')."""
        if not self._distributed and checks:
            device = checks[0].ok.device
        oks = (torch.stack([c.ok.to(device=device, dtype=torch.bool).reshape(()) for c in checks]) if checks
               else torch.ones(0, dtype=torch.bool, device=device))
        reads = torch.tensor([[n in c.metrics for n in names] for c in checks],
                             dtype=torch.bool).reshape(len(checks), len(names))
        # Per metric: world - rank where a check of this rank failed, else 0; under MAX, the
        # lowest failing rank (world - value), known without gathering anything.
        failed = (~oks[:, None] & reads.to(device, non_blocking=True)).any(0).to(torch.float64)
        failed *= self.topology.world_size - self.topology.global_rank
        if self._distributed:
            self._reduce_device(failed)
        return [failed, oks.to(torch.float64)]

    def fail_checked(self, names: Sequence[str], failures: list[MetricFailure], checks: Sequence[DeviceCheck],
                     read: Sequence[float], gather: bool) -> list[MetricFailure]:
        """``failures`` with the metrics whose check failed on some rank (``read``: the host copy
        of :meth:`device_flags`). Each fails with the reason of the lowest rank whose check
        failed, which replaces an error it already failed with. With ``gather``, the reasons are
        gathered (every rank alike: they all read the same reduced values), naming every failing
        rank; without, nothing is exchanged (a step read where ranks need not be in step): the
        lowest failing rank is named, with this rank's reason where it is that rank, else a
        reference to it."""
        n = len(names)
        lowest = {name: self.topology.world_size - int(v) for name, v in zip(names, read[:n]) if v}
        failed = list(lowest)
        if not failed:
            return failures
        mine = failed_checks(checks, [bool(v) for v in read[n:]])
        if gather and self._distributed:
            everyone = self._gather_objects(mine)
        else:
            me = self.topology.global_rank
            everyone = [{} for _ in range(self.topology.world_size)]
            for name, rank in lowest.items():
                everyone[rank][name] = (mine[name] if rank == me and name in mine else
                                        f"a device check failed on rank {rank} (its reason is in that rank's "
                                        "failures)")
        ranks = {name: tuple(r for r, reasons in enumerate(everyone) if name in reasons) for name in failed}
        out = [MetricFailure(f.metric, tuple(sorted({*f.ranks, *ranks[f.metric]})),
                             everyone[ranks[f.metric][0]][f.metric]) if f.metric in ranks else f
               for f in failures]
        said = {f.metric for f in failures}
        out.extend(MetricFailure(name, ranks[name], everyone[ranks[name][0]][name]) for name in failed
                   if name not in said)
        return out


def failed_checks(checks: Sequence[DeviceCheck], passed: Sequence[bool]) -> dict[str, str]:
    """Metric name -> the reason of the first of ``checks`` that failed for it (``passed``: each
    check's flag, read on the host)."""
    reasons: dict[str, str] = {}
    for check, ok in zip(checks, passed):
        if not ok:
            for name in check.metrics:
                reasons.setdefault(name, check.reason)
    return reasons
