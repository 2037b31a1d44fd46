"""The end of a due step of a :class:`~tmetrics_core.tensor_metrics.TensorMetrics`.

At the step's end the executor reduces every due metric in one pass
(:meth:`~tmetrics_core.distributed.executor.Executor.launch`); the results are read at once or,
with ``run.read_results: next-step``, at the next step scope's end, when their copy has landed.
Failures and metrics that found nothing are said once (:class:`~tmetrics_core.reporter.Reporter`),
and the records go to the sinks.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from tmetrics_core.distributed.agreement import MetricFailure
from tmetrics_core.distributed.executor import Executor, Pending
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.naming.signature import parameter_signature
from tmetrics_core.records import MetricRecord
from tmetrics_core.reporter import Reporter
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.kinds import TOKEN_KINDS, what_feeds
from tmetrics_core.sources.param_observer import ParamObserver
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS
from tmetrics_core.sources.token_plan import TokenPlan
from tmetrics_core.sources.tokens import TokenObserver

__all__ = ["StepEnd"]

_PARAM_SIDE = PARAM_KINDS | OPTIMIZER_KINDS

_CHANGED = ("the model's parameters changed since tmetrics planned them (a parameter added, removed or replaced, "
            "e.g. a layer appended or an embedding resized; a requires_grad or dtype changed): this step was read "
            "with the old plan and is left out; every rank re-plans at the next due step, whose records cover the "
            "model as it is then")


class StepEnd:
    """The due step's reduction, delivery and warnings, mixed into
    :class:`~tmetrics_core.tensor_metrics.TensorMetrics` (whose state they read)."""

    model: torch.nn.Module
    metrics: list[tuple[TensorMetric, int]]
    modules: Mapping[str, Sequence[str]]
    manifest: Manifest
    params: ParamObserver
    tokens: TokenPlan
    executor: Executor
    reporter: Reporter
    hub: Any
    check_plan: str
    read_results: str
    last_records: list[MetricRecord]
    failures: list[MetricFailure]
    _signature: Any
    _stale: bool
    _due: list[tuple[TensorMetric, int]]
    _checked: set[str]
    _unfed: set[str]
    _no_grad_said: bool
    _replan_due: bool
    _closed_by_signal: bool
    _in_flight: tuple[int, Pending] | None
    _read_pre: Callable[[], None]
    """Reads the parameters and gradients (:meth:`~tmetrics_core.scope.optimizer_steps.OptimizerSteps._read_pre`)."""

    @torch.no_grad()
    def _finish_step(self, step: int, observer: TokenObserver | None) -> None:
        """Launch the reduction of step ``step``'s due metrics (one executor pass, on every rank
        alike) and deliver it now or, with ``read_results: next-step``, at the next scope's end."""
        if not self.params.done("pre"):
            self._read_pre()
        prepared = self.params.finish()
        sites: dict[SiteKey, Site] = dict(self.params.sites)
        changed = False
        if observer is not None:
            observer.finish()
            changed = self.tokens.sync(observer, self.executor)
            sites.update(self.tokens.sites)
        due = []
        for metric, _ in self._due:
            if observer is not None and set(metric.source_kinds) & TOKEN_KINDS:
                state, error = self.tokens.state_for(metric, observer)
                if not len(observer.states.get(metric.name, {})):
                    self._unfed.add(metric.name)
            else:
                state, error = prepared.get(metric.name, ({}, None))
            due.append((metric, state, error))
        check = self.check_plan == "always" or (
            self.check_plan == "first" and (changed or any(m.name not in self._checked for m, _, _ in due)))
        say = not self._no_grad_said and any("grad" in m.source_kinds for m, _ in self._due)
        # A change before the read: read with the old plan, so left out on every rank (the failure
        # agreement). A change after it (an optimizer that resized a parameter): this step's
        # reads stand; the next due step re-plans either way.
        changed = self._stale or parameter_signature(self.model) != self._signature
        if self._stale:
            due = [(m, s, _CHANGED if set(m.source_kinds) & _PARAM_SIDE else e) for m, s, e in due]
        self._deliver_earlier(step)
        pending = self.executor.launch(due, sites, check=check, unfed=self._unfed | self.params.unfed, step=step,
                                       flag=bool(self.params.no_grad) if say else None,
                                       checks=observer.device_checks() if observer is not None else (),
                                       changed=changed)
        self._replan_due = self.executor.changed
        if say:
            self._say_missing_gradients(step)
        self._checked.update(m.name for m, _, _ in due)
        if self.read_results == "next-step":
            self._in_flight = (step, pending)
        else:
            self._deliver(step, pending)

    def _deliver_earlier(self, step: int) -> None:
        """Deliver the results launched at a step before ``step`` (``read_results: next-step``):
        their copy has landed by now, so reading it waits for nothing."""
        if self._in_flight is not None and self._in_flight[0] < step:
            earlier, self._in_flight = self._in_flight, None
            self._deliver(*earlier)

    def _deliver(self, step: int, pending: Pending) -> None:
        """The results of due step ``step`` read (:meth:`Executor.collect`), warned about, kept
        in :attr:`last_records` and submitted to the sinks."""
        # A step read a step later is read where ranks need not be in step (a scope whose body
        # raised on one rank, close()): nothing may be exchanged there.
        results, failures = self.executor.collect(pending, gather=self.read_results == "now")
        records = [MetricRecord(name, step, r.value, r.labels) for name, rs in results.items() for r in rs]
        self.last_records = records
        self.failures.extend(failures)
        # After SIGTERM closed this object its hooks are gone: steps that still run (for the
        # ranks' collectives) find nothing and fail their update metrics, which says nothing
        # about the model; the failures are kept, not warned about.
        quiet = self._closed_by_signal
        for failure in failures if not quiet else ():
            self.reporter.once(("failed", failure.metric),
                               "tmetrics: metric %r skipped at step %d on every rank (raised on ranks %s): %s. "
                               "Further failures of this metric are counted silently.", failure.metric, step,
                               list(failure.ranks), failure.error)
        for name in pending.unfed if not quiet else ():
            if self.reporter.first(("unfed", name)):
                metric = next(m for m, _ in self.metrics if m.name == name)  # _due: another step's, a step later
                self.reporter.warning("tmetrics: metric %r found nothing to measure on any rank at step %d and wrote no record: "
                            "%s. Said once; later steps without anything to measure write no record either.",
                                      name, step, what_feeds(metric.source_kinds,
                                                             self.modules.get(name, getattr(metric, "modules", ()))))
        if self.hub is not None and records:
            self.hub.submit(records, step)

    def _say_missing_gradients(self, step: int) -> None:
        """At the first due step that reads gradients, warn once (logging rank) which parameters
        had none on some rank: they are left out of gradient statistics, not counted as zeros.
        Whether any rank lacked one rode on the executor's agreement (``flagged``); only then
        one gather of the names, on every rank alike."""
        self._no_grad_said = True
        if not self.executor.flagged:
            return
        everyone = self.executor.gather_objects(sorted(self.params.no_grad))
        if not self.reporter.speaks or not any(everyone):
            return
        # Frozen tensors (requires_grad False everywhere: PEFT's base weights) have none by design.
        frozen = {e.name for e in self.manifest.entries if e.frozen}
        missing = sorted({name for names in everyone for name in names} - frozen)
        ranks = [r for r, names in enumerate(everyone) if set(names) - frozen]
        if not missing:
            return
        self.reporter.warning("tmetrics: at step %d, %d parameter(s) had no gradient (.grad and .main_grad None) on "
                              "rank(s) %s and are left out of gradient statistics (not counted as zeros): %s%s", step,
                              len(missing), ranks, missing[:20], " ..." if len(missing) > 20 else "")
