"""The token-site plan: which activation and router sites exist on which ranks.

Token sites appear while the model runs, so unlike parameters they are not in the manifest.
At the end of each due step every rank says (one tiny world collective) whether it saw a site
not yet in the plan; if any did, all ranks share their site lists once (axis by axis, as the
manifest's holdings) and extend the plan.
Sites held by one coordinate of a non-population axis (a layer on one pipeline stage) become
``Owned`` there. Ranks that did not see a planned site this step join with placeholders, so a
stage without experts or a rank whose batch was all padding never stalls the others. A planned
site that no rank saw this step (a layer skipped by LayerDrop or an early exit) is left out of
the step's states on every rank, agreed in the same collective: its layer gets no record that
step, not a placeholder's 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, cast

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.distributed.manifest_exchange import share_holdings
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.block_state import BlockState
from tmetrics_core.manifest.holdings import Holdings
from tmetrics_core.placements import Owned, Placement
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.sources.sequence_split import split_by_sequence
from tmetrics_core.sources.tokens import TokenObserver

__all__ = ["TokenPlan"]


class TokenPlan:
    """Token sites known to every rank, in a rank-independent order."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.sites: dict[SiteKey, Site] = {}
        self.unseen: frozenset[SiteKey] = frozenset()
        """Planned sites no rank observed at the last :meth:`sync` (a layer that did not run:
        LayerDrop, an early exit): left out of that step's states, so they give no record
        rather than a placeholder's 0."""
        self._accepted: dict[str, tuple[tuple[int, frozenset[SiteKey]], tuple[SiteKey, ...]]] = {}
        """Per metric name: the number of planned sites (sites are only ever added) and the
        unseen ones when last looked at, and the sorted keys of the others the metric accepts."""

    def sync(self, observer: TokenObserver, executor: Executor) -> bool:
        """Extend the plan with sites any rank saw; True when the plan changed (on every rank).
        Also sets :attr:`unseen`, from the same collective.

        The site lists are shared as the manifest's are (``share_holdings``: exchanged only
        over the axes whose ranks saw different sites), so per-rank bytes follow the number of
        sites and the axis sizes, not the world size."""
        unplanned = [k for k in observer.sites if k not in self.sites]
        # One agreement (the plan is the same on every rank): any site unplanned, and which
        # planned sites some rank observed.
        planned = list(self.sites)
        flags = executor.any_ranks([bool(unplanned), *map(observer.sites.__contains__, planned)])
        seen = flags[1:]
        self.unseen = frozenset() if all(seen) else frozenset(k for k, s in zip(planned, seen) if not s)
        if not flags[0]:
            return False
        mine = Holdings.local([(site.key, site) for site in observer.sites.values()], self.topology.coords(),
                              self.topology.global_rank, 0)
        shared = share_holdings(mine, executor)
        found = cast(dict[SiteKey, dict[tuple[SiteKey, Site], int]], shared.rows)  # keyed as listed above
        new = [key for key in sorted(found) if key not in self.sites]
        for key in new:
            (_, site), _ = min(found[key].items(), key=lambda item: item[1])
            self.sites[key] = self._merge(site, shared.held[key])
        split_by_sequence(self.sites, new, observer.first_sumsq, executor, self.topology, observer.reporter)
        return True

    def _accepted_keys(self, metric: TensorMetric) -> tuple[SiteKey, ...]:
        """The sorted keys of the planned sites some rank observed this step that ``metric``
        accepts (looked at again only when the plan or its unseen sites changed)."""
        version = (len(self.sites), self.unseen)
        known = self._accepted.get(metric.name)
        if known is None or known[0] != version:
            known = self._accepted[metric.name] = (version, tuple(sorted(
                k for k, s in self.sites.items() if k not in self.unseen and metric.accepts(s))))
        return known[1]

    def _merge(self, site: Site, held: Mapping[str, set[int]]) -> Site:
        placements: list[tuple[str, Placement]] = list(site.placements)
        present = {a for a, _ in placements}
        for axis in self.topology.names:
            size = self.topology.axes[axis].size
            if size == 1 or axis in present:
                continue
            coords = sorted(held.get(axis, {0}))
            if len(coords) == 1:
                placements.append((axis, Owned(coords[0])))
        order = {a: i for i, a in enumerate(self.topology.names)}
        placements.sort(key=lambda ap: order[ap[0]])
        return dataclasses.replace(site, placements=tuple(placements))

    def state_for(self, metric: TensorMetric, observer: TokenObserver) -> tuple[Mapping[SiteKey, Any], str | None]:
        """The metric's prepared state over every planned site it accepts, placeholders for
        the sites this rank did not see; or its local error."""
        if metric.name in observer.errors:
            return {}, observer.errors[metric.name]
        prepared = observer.states.get(metric.name, {})
        if isinstance(prepared, BlockState) and prepared.site_keys == self._accepted_keys(metric):
            return prepared, None  # every accepted site, in plan order: kept as matrices, no vector per site
        unseen = self.unseen
        missing = [s for k, s in self.sites.items() if k not in prepared and k not in unseen and metric.accepts(s)]
        state = dict(prepared)
        try:
            if missing:
                state.update(metric.prepare(missing, [None] * len(missing), self.topology, {}))
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            return {}, f"{type(exc).__name__}: {exc}"
        return {k: state[k] for k in sorted(state) if k in self.sites and k not in unseen}, None
