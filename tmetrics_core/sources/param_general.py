"""The general path of the parameter side: any metric, any placement, tensor by tensor.

What the due set's :class:`~tmetrics_core.sources.param_program.ParamProgram` does not prepare
(metrics that are no planned ``StatMetric``, Partial sites, flat parameter buffers, a DTensor
gradient placed otherwise than its parameter, a read the program failed) is prepared here: the
sites and local tensors of every kind the metrics read (:class:`GeneralPath`), Partial sites
materialized through the executor (:func:`~tmetrics_core.distributed.partials.resolve_partials`),
then each metric's own ``prepare`` (:func:`~tmetrics_core.metrics.preparation.prepare_states`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.partials import resolve_partials
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.preparation import SiteChoices, prepare_states
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.sources.params import read_kind

__all__ = ["GeneralPath", "Prepared", "StepStates"]

Prepared = tuple[Mapping[SiteKey, Any], str | None]
"""A due metric's local state and its error text (None when it prepared without one)."""


@dataclass(slots=True)
class StepStates:
    """What the parameter side prepared in one due step, filled as its phases run.

    Attributes:
        prepared: due metric name -> its state and error.
        sites: the sites the prepared states name (resolved Partial sites included).
        unfed: due metrics that read no tensor here this step.
        no_grad: parameters held here without a gradient this step.
    """

    prepared: dict[str, Prepared]
    sites: dict[SiteKey, Site]
    unfed: set[str]
    no_grad: set[str]


class GeneralPath:
    """Prepares parameter-side metrics tensor by tensor (see the module docstring).

    Args:
        reads: the parameter side's tensors and sites.
        executor: the collectives of Partial materialization.
        choices: which sites each metric accepts, remembered across steps.
    """

    def __init__(self, reads: ParamReads, executor: Executor, choices: SiteChoices) -> None:
        self.reads = reads
        self.executor = executor
        self._choices = choices

    def run(self, phase: str, metrics: list[TensorMetric], before: list[TensorMetric],
            snapshot: MutableMapping[str, torch.Tensor] | None, out: StepStates) -> None:
        """Prepare ``metrics`` (the phase's, not yet prepared) and, after the step, ``before``
        (those of ``DueSetPlan.from_snapshot``, on the parameters as they were before it: the
        ``snapshot``, which the updates then consume). A failure to read the tensors becomes
        every metric's error, with placeholders that keep this rank's collectives (Partial
        gradients) the same as the others'."""
        memo: dict = {}
        if before:
            # The snapshot as taken: read_kind("update") (in _read_phase) overwrites it with the
            # updates, after the metrics of `before` read it.
            self._prepare_before(before, dict(snapshot or {}), {}, out)
        if not metrics:
            return
        sites: list[Site] = []
        tensors: list[torch.Tensor | None] = []
        failed = None
        try:
            sites, tensors = self._read_phase(metrics, snapshot, out)
        except Exception as exc:  # noqa: BLE001 - e.g. a parameter resized by the optimizer
            failed = f"reading the {phase}-step tensors failed: {type(exc).__name__}: {exc}"
            # Reported and skipped on every rank by the executor's failure agreement.
            sites = [s for kind in sorted({k for m in metrics for k in m.source_kinds})
                     for s in (self.reads.grad_sites() if kind == "grad" else self.reads.kind_sites[kind])]
            tensors, memo = [None] * len(sites), {}
        self.prepare_from(metrics, sites, tensors, memo, failed, out)

    def prepare_from(self, metrics: list[TensorMetric], sites: list[Site], tensors: list[torch.Tensor | None],
                     memo: dict, failed: str | None, out: StepStates) -> None:
        """Prepare ``metrics`` on the local tensors of ``sites`` (Partial ones reduced first) and
        keep their states, with ``failed`` (a reading error) as every metric's error."""
        sites, tensors = resolve_partials(metrics, sites, tensors, self.reads.topology, self.executor)
        for metric, picked in zip(metrics, self._choices.of(metrics, sites) if failed is None else ()):
            if all(tensors[i] is None for i in picked):
                out.unfed.add(metric.name)
        for metric, state, error in prepare_states(metrics, sites, tensors, self.reads.topology, memo, self._choices):
            out.prepared[metric.name] = (state, failed or error)
        out.sites.update((s.key, s) for s in sites)

    def _prepare_before(self, metrics: list[TensorMetric], snapshots: dict[str, torch.Tensor], memo: dict,
                        out: StepStates) -> None:
        """Prepare the metrics of ``DueSetPlan.from_snapshot`` on the parameters as they were
        before the optimizer step: the snapshot's copies (exact); the parameters themselves when
        no step ran in the scope (then nothing changed them)."""
        manifest = self.reads.manifest
        try:
            params = read_kind("param", manifest, self.reads.optimizer)
            tensors = [snapshots.get(e.name, p) if p is not None else None for e, p in zip(manifest.entries, params)]
            failed = None
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            tensors, memo = [None] * len(manifest.entries), {}
            failed = f"reading the parameters failed: {type(exc).__name__}: {exc}"
        self.prepare_from(metrics, list(self.reads.kind_sites["param"]), tensors, memo, failed, out)

    def _read_phase(self, metrics: list[TensorMetric], snapshot: MutableMapping[str, torch.Tensor] | None,
                    out: StepStates) -> tuple[list[Site], list[torch.Tensor | None]]:
        """Sites and local tensors of every kind the phase's metrics read (rank-symmetric sites)."""
        reads = self.reads
        sites: list[Site] = []
        tensors: list[torch.Tensor | None] = []
        for kind in sorted({k for m in metrics for k in m.source_kinds}):
            if kind in reads.flat:
                read = reads.flat_tensors(kind, range(len(reads.manifest.entries)))
                sites.extend(reads.flat_sources[kind].sites)
            else:
                read = read_kind(kind, reads.manifest, reads.optimizer, snapshot, reads.state_keys)
                sites.extend(reads.kind_sites[kind] if kind != "grad" else reads.grad_sites())
            if kind == "grad":
                out.no_grad.update(e.name for e, t in zip(reads.manifest.entries, read)
                                   if t is None and e.name in reads.manifest.local)
            tensors.extend(read)
        return sites, tensors
