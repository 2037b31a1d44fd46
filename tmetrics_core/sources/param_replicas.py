"""Replica claims of the parameter side, checked against the tensors themselves.

A parameter, gradient or Adam state claimed ``Replica`` on an axis must be equal across it, or
reducing it as one copy is wrong. :class:`ParamReplicas` checks the claims of what the
configured metrics read: the parameters at start-up, and each phase's sources at their first
due step (``verify_replicas="first"``) or at every one (``"always"``), in one packed collective
per axis (:mod:`tmetrics_core.distributed.replicas`). A ``pre`` read that a later
``observe_gradients()`` may supersede raises only once it is final (:meth:`ParamReplicas.settle`).
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.replicas import replica_claims, verify_replicas
from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.param_reads import ParamReads
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS
from tmetrics_core.sources.params import read_kind

__all__ = ["ParamReplicas"]


class ParamReplicas:
    """The Replica verification of the parameter side (see the module docstring).

    Args:
        reads: the parameter side's tensors and sites.
        executor: the collectives of the verification.
        metrics: every configured metric (start-up checks the parameters some reads).
        mode: ``"startup"``, ``"first"``, ``"always"`` or ``"never"`` (see ``TensorMetrics``).
        on_verified: called after a verification past start-up marked claims in the manifest
            (``TensorMetrics`` rewrites the run's ``manifest.json``).
    """

    def __init__(self, reads: ParamReads, executor: Executor, metrics: Sequence[TensorMetric], mode: str,
                 on_verified: Callable[[], None] | None) -> None:
        self.reads = reads
        self.executor = executor
        self.metrics = tuple(metrics)
        self.mode = mode
        self._on_verified = on_verified
        self._verified_kinds: set[str] = set()
        self._verified_now: set[str] = set()
        """Kinds first verified by this step's ``pre`` read (verified again if the read is superseded)."""
        self._deferred: PlacementError | None = None
        """A Replica claim that failed on this step's latest ``pre`` read, raised by :meth:`settle`."""

    def begin(self) -> None:
        """A new step: nothing deferred, nothing verified by its ``pre`` read yet."""
        self._verified_now, self._deferred = set(), None

    def supersede(self) -> None:
        """This step's ``pre`` read will be read again: its verification does not count (the
        kinds it verified first are verified again by the next read)."""
        self._verified_kinds -= self._verified_now
        self._verified_now, self._deferred = set(), None

    def settle(self) -> None:
        """The ``pre`` read is final: raise a Replica claim its verification found false.

        Raises:
            PlacementError: on every rank, as :meth:`verify` found it.
        """
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred

    def startup(self) -> None:
        """Check the Replica claims of the parameters some configured metric reads (not with a
        flat parameter buffer, which holds no Replica).

        Raises:
            PlacementError: a parameter claimed Replica differs across its axis (every rank).
        """
        kind_sites = self.reads.kind_sites
        if self.mode == "never" or "param" in self.reads.flat:
            return
        read = frozenset(s.name for m in self.metrics for kind in set(m.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS)
                         for s in kind_sites[kind] if m.accepts(s))
        self.verify(["param"], [s for s in kind_sites["param"] if s.name in read], "at start-up")

    def phase(self, phase: str, metrics: Sequence[TensorMetric], step: int | None) -> None:
        """Check the Replica claims of the sources ``metrics`` (the due metrics of ``phase``)
        read: at the first due step of each (``first``) or at every due step (``always``), all
        sources of the phase in one verification; flat buffers hold no Replica. A failed claim
        of the ``pre`` phase is raised by :meth:`settle`.

        Raises:
            PlacementError: a claim of the ``post`` phase that does not hold (every rank).
        """
        if self.mode not in ("first", "always"):
            return
        kind_sites = self.reads.kind_sites
        kinds = {k for m in metrics for k in m.source_kinds} & {"param", "grad", "exp_avg", "exp_avg_sq"}
        due = sorted(k for k in kinds - set(self.reads.flat) if self.mode == "always" or k not in self._verified_kinds)
        sites: list[Site] = []
        absent: set[SiteKey] = set()
        for kind in due:
            sites += [s for s in kind_sites[kind] if any(m.accepts(s) for m in metrics if kind in m.source_kinds)]
            if kind == "grad":
                # A gradient placed otherwise than its parameter here (a DTensor Partial gradient)
                # is no replica; it is left out locally, so the claims are the same on every rank.
                absent = {g.key for g, s in zip(self.reads.grad_sites(), kind_sites[kind]) if g != s}
        if not due:
            return
        if phase != "pre":
            self.verify(due, sites, f"at step {step}", absent)
            return
        self._verified_now.update(due)
        try:  # a read that a later observe_gradients() may supersede: raised when it is final (settle)
            self.verify(due, sites, f"at step {step}", absent)
        except PlacementError as exc:
            self._deferred = exc

    def verify(self, kinds: Sequence[str], sites: list[Site], when: str, absent: Collection[SiteKey] = ()) -> None:
        """Compare the local tensors of ``sites`` (of the source ``kinds``) claimed Replica across
        their axes (one packed collective per axis for all of them; see
        :mod:`tmetrics_core.distributed.replicas`), not reading the site keys in ``absent``, and
        record the claims that held in the manifest.

        Raises:
            PlacementError: a claim that does not hold, on every rank.
        """
        manifest = self.reads.manifest
        self._verified_kinds.update(kinds)
        origins = {e.name: dict(e.origins) for e in manifest.entries}
        claims = replica_claims(sites, self.reads.topology, origins)
        if not claims:
            return
        wanted = {c.site.key for c in claims} - set(absent)
        tensors: dict[tuple[str, str], torch.Tensor | None] = {}
        for kind in kinds:
            tensors.update(((e.name, kind), t) for e, t in zip(manifest.entries,
                                                               read_kind(kind, manifest, self.reads.optimizer,
                                                                         keys=self.reads.state_keys))
                           if (e.name, kind) in wanted)
        checked = verify_replicas(claims, tensors, topology=self.reads.topology, executor=self.executor, when=when)
        for kind in kinds:
            manifest.mark_verified(kind, [(name, axis) for name, k, axis in checked if k == kind])
        if list(kinds) != ["param"] and self._on_verified is not None:
            self._on_verified()

