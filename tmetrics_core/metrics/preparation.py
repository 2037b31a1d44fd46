"""From observed local tensors to prepared metric states.

``prepare_states`` is the local half of a step: each metric prepares the sites it accepts,
sharing statistics between metrics through a per-step memo. Errors are caught per metric and
returned, so the executor can make every rank skip a metric that raised on any rank.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.site import Site, SiteKey
from tmetrics_core.topology import Topology

__all__ = ["PreparedStep", "SiteChoices", "prepare_states"]

PreparedStep = list[tuple[TensorMetric, dict[SiteKey, Any], str | None]]
"""``(metric, state, local error text or None)`` per due metric, in config order."""


class SiteChoices:
    """Which sites each metric accepts, remembered per list of site objects: a due step over
    the same sites (the manifest's, built once) skips a Python ``accepts`` call per metric and
    tensor. Keyed by the identity of the sites, which the entry keeps alive; a few lists at
    most are kept (transient sites, e.g. resolved Partial ones, are new objects every step)."""

    _KEEP = 8

    def __init__(self) -> None:
        self._known: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[Sequence[Site], list[list[int]]]] = {}

    def of(self, metrics: Sequence[TensorMetric], sites: Sequence[Site]) -> list[list[int]]:
        """Per metric, the indices of the sites it accepts, in order."""
        key = (tuple(m.name for m in metrics), tuple(map(id, sites)))
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= self._KEEP:
                self._known.clear()
            picks = [[i for i, s in enumerate(sites) if m.accepts(s)] for m in metrics]
            known = self._known[key] = (list(sites), picks)
        return known[1]


def prepare_states(metrics: Sequence[TensorMetric], sites: Sequence[Site],
                   tensors: Sequence[torch.Tensor | None], topology: Topology,
                   memo: dict[Hashable, torch.Tensor] | None = None,
                   choices: SiteChoices | None = None) -> PreparedStep:
    """Prepare every metric on the sites it accepts; a metric that raises gets its error text
    instead of a state (its other sites are not prepared). ``choices``, kept by the caller
    across steps, remembers which of the same site objects each metric accepts."""
    memo = {} if memo is None else memo
    picks = (choices or SiteChoices()).of(metrics, sites)
    out: PreparedStep = []
    for metric, picked in zip(metrics, picks):
        try:
            state = metric.prepare([sites[i] for i in picked], [tensors[i] for i in picked], topology, memo)
            out.append((metric, state, None))
        except Exception as exc:  # noqa: BLE001 - reported, and skipped on every rank
            out.append((metric, {}, f"{type(exc).__name__}: {exc}"))
    return out
