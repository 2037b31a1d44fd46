"""A statistic metric's prepared state held as one matrix per statistic.

``StatMetric`` states map each site key to one local vector per statistic. When every vector
comes from the fused moments rows (parameters, gradients and updates on CPU), the rows of all
sites are one matrix already; :class:`BlockState` keeps them so, and the batch plan takes its
rows by slicing instead of making one tensor per site and stacking them again (two Python-level
tensor creations per site, statistic and step saved).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch

from tmetrics_core.site import Site, SiteKey

__all__ = ["BlockState"]


class BlockState(Mapping[SiteKey, list[torch.Tensor]]):
    """``{site key: [vector per statistic]}``, held as ``matrices[j]``: float64
    ``[len(site_keys), size_j]`` with row ``i`` the vector of statistic ``j`` at ``site_keys[i]``.

    Reading it as a mapping makes the per-site vectors (views of the rows) on first use, so
    every consumer of states (micro-batch merges, token plans) works unchanged; the batch plan
    reads the matrices directly.
    """

    __slots__ = ("site_keys", "matrices", "sites", "_index")

    def __init__(self, site_keys: Sequence[SiteKey], matrices: Sequence[torch.Tensor],
                 sites: tuple[Site, ...] | None = None) -> None:
        self.site_keys = tuple(site_keys)
        self.matrices = list(matrices)
        self.sites = sites
        """The site of each key, where the producer holds them in one tuple that lives as long
        as its plan (the parameter program's, fixed per due set): the batch plan then knows its
        cut is unchanged from that tuple's identity, without a lookup per site. None: the
        batch plan looks each key up in the step's sites."""
        self._index: dict[SiteKey, int] | None = None

    def __getitem__(self, key: SiteKey) -> list[torch.Tensor]:
        i = self._positions()[key]
        return [m[i] for m in self.matrices]

    def __contains__(self, key: object) -> bool:
        return key in self._positions()  # without making the vectors, as Mapping's would

    def _positions(self) -> dict[SiteKey, int]:
        if self._index is None:
            self._index = {k: i for i, k in enumerate(self.site_keys)}
        return self._index

    def __iter__(self) -> Iterator[SiteKey]:
        return iter(self.site_keys)

    def __len__(self) -> int:
        return len(self.site_keys)
