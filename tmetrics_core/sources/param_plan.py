"""What one due set fixes for the parameter side: the phases, the snapshot, the program.

Which due metrics run before the optimizer step and which after it, which parameters the update
snapshot copies (and in which order), and the due set's
:class:`~tmetrics_core.sources.param_program.ParamProgram` depend only on the names of the due
metrics: :func:`due_set_plan` finds them once per due set, and every due step of that set looks
its :class:`DueSetPlan` up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.sources.param_program import ParamProgram, Picks
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS, TOKEN_KINDS

__all__ = ["DueSetPlan", "due_set_plan"]



@dataclass(frozen=True, slots=True)
class DueSetPlan:
    """What one due set (the names of the due metrics) fixes for the parameter side.

    Attributes:
        pre: the due metrics of parameters and gradients only, prepared before the update
            (less those of ``from_snapshot``).
        post: the due metrics reading Adam state or updates, prepared after the update.
        from_snapshot: the due metrics of parameters alone whose every tensor is in the
            update snapshot: prepared after the step on the snapshot (the parameters as they
            were before it), so no pass over the parameters runs before the step.
        snapshot_names: canonical names of the parameters the due update metrics read, in the
            order the snapshot copies them: those the program reads from the snapshot first, in
            the order it reads them, then the others in manifest order.
        program: the due set's :class:`ParamProgram`, which prepares every metric of both phases.
    """

    pre: tuple[TensorMetric, ...]
    post: tuple[TensorMetric, ...]
    from_snapshot: tuple[TensorMetric, ...]
    snapshot_names: tuple[str, ...]
    program: ParamProgram


def due_set_plan(due: Sequence[TensorMetric], reads: ParamReads, picks: Picks) -> DueSetPlan:
    """The :class:`DueSetPlan` of the due metrics ``due`` (config order); ``picks`` gives, per
    metric, the indices of the sites it accepts (``SiteChoices.of``)."""
    kind_sites = reads.kind_sites
    updates = [m for m in due if "update" in m.source_kinds]
    names = frozenset(s.name for s in kind_sites["update"] if any(m.accepts(s) for m in updates))
    later: set[str] = set()
    plain = "param" not in reads.flat and "update" not in reads.flat and not reads.facts.partial_params
    for m in due if names and plain else ():
        read = {s.name for s in kind_sites["param"] if m.accepts(s)}
        if set(m.source_kinds) == {"param"} and read and read <= names:
            later.add(m.name)

    def in_phase(m: TensorMetric, phase: str) -> bool:
        kinds = set(m.source_kinds)
        if phase == "pre":
            return bool(kinds) and kinds <= PARAM_KINDS and m.name not in later
        return bool(kinds & OPTIMIZER_KINDS) and not kinds & TOKEN_KINDS

    pre = tuple(m for m in due if in_phase(m, "pre"))
    post = tuple(m for m in due if in_phase(m, "post"))
    before = tuple(m for m in due if m.name in later)
    program = ParamProgram(pre, post, before, reads.sites_of, picks, reads.topology)
    entries = reads.manifest.entries
    first = tuple(entries[e].name for e in program.snapshot_entries())
    rest = frozenset(first)
    order = (*first, *(n for n in reads.manifest.local if n in names and n not in rest))
    return DueSetPlan(pre, post, before, order, program)
