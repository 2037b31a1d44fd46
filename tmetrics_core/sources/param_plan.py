"""What one due set fixes for the parameter side: the phases, the snapshot, the program.

Which due metrics run before the optimizer step and which after it, which parameters the update
snapshot copies (and in which order), and the due set's
:class:`~tmetrics_core.sources.param_program.ParamProgram` depend only on the names of the due
metrics: :func:`due_set_plan` finds them once per due set, and every due step of that set looks
its :class:`DueSetPlan` up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.sources.param_program import ParamProgram
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS, TOKEN_KINDS

__all__ = ["DueSetPlan", "ProgramOf", "due_set_plan", "programmable"]

ProgramOf = Callable[[Sequence[TensorMetric], Sequence[TensorMetric], Sequence[TensorMetric], frozenset[str]],
                     "ParamProgram | None"]
"""``(pre, post, from_snapshot, snapshot names)`` -> the due set's program, or None."""


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
            order the snapshot copies them: the program's parameters first, in the order it
            reads them (so it reads the snapshot as one block), then the others in manifest
            order.
        program: the due set's :class:`ParamProgram` (it prepares the metrics it plans, the
            general path the others), or None where the general path prepares every metric.
    """

    pre: tuple[TensorMetric, ...]
    post: tuple[TensorMetric, ...]
    from_snapshot: tuple[TensorMetric, ...]
    snapshot_names: tuple[str, ...]
    program: ParamProgram | None


def due_set_plan(due: Sequence[TensorMetric], reads: ParamReads, program_of: ProgramOf) -> DueSetPlan:
    """The :class:`DueSetPlan` of the due metrics ``due`` (config order); ``program_of`` plans
    the program (an error it raises leaves the due set without one: the general path then
    reports the metric's error on every rank)."""
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
    try:
        program = program_of(pre, post, before, names)
    except Exception:  # noqa: BLE001 - a metric's own code raised (e.g. kept): the
        program = None  # general path reports it per metric, on every rank
    first = program.names if program is not None else ()
    rest = frozenset(first)
    order = (*first, *(n for n in reads.manifest.local if n in names and n not in rest))
    return DueSetPlan(pre, post, before, order, program)


def programmable(reads: ParamReads) -> bool:
    """Whether a :class:`ParamProgram` may run over the parameter side: only over parameters
    held here, plain or DTensor (no flat parameter buffer or Partial placement, whose sites and
    tensors the general path changes per step). Gradients and Adam state in flat buffers (ZeRO,
    Megatron's distributed optimizer) are read from them, with their FlatShard sites (not with
    DTensor parameters)."""
    return not (set(reads.flat) & {"param", "update"} or reads.facts.partial_params
                or any(s.partial for s in reads.kind_sites["grad"])
                or any(p is None for p in reads.facts.local)
                or (reads.flat and reads.facts.dtensor_params))
