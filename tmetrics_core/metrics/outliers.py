"""Outlier features of module outputs: how unevenly the feature channels carry the activation.

Low-precision casts lose most where a few channels are far larger than the rest (the
"outlier features" of large transformers, which per-tensor and per-row scales cannot absorb).
Two metrics read the per-channel RMS ``r_c = sqrt(sum_t x_tc**2 / T_c)`` of a module's output
``x`` (``[tokens, features]``):

- ``layer-activation-channel-kurtosis``: ``mean_c (r_c - m)**4 / (mean_c (r_c - m)**2)**2``
  with ``m = mean_c r_c`` (Pearson's kurtosis over the features; 1.8 for uniform channels, 3 for
  Gaussian ones, far above 3 with outlier channels);
- ``layer-activation-outlier-ratio``: ``max_c r_c / median_c r_c`` (the lower median for an even
  feature count).

Across ranks: each rank writes the per-channel ``sum x**2`` and token count of the channels it
holds into their place in a vector of ``2 F`` entries (``F`` the logical feature count), zeros
elsewhere; one SUM over every axis that splits the site (tokens on ``dp``, features on ``tp``,
micro-batches merged by adding) gives every channel's exact sums, which are float64.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Sequence

import torch

from tmetrics_core.errors import PlacementError
from tmetrics_core.metrics.activations import DEFAULT_MODULES
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.statistics import Statistic
from tmetrics_core.placements import chunk_range
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["ChannelKurtosis", "ChannelSums", "OutlierRatio"]


class ChannelSums(Statistic):
    """``[sum_t x_tc**2 for each channel c, tokens T_c for each c]`` (float64, ``2 F``), each
    rank's channels at their global offset (``Shard`` of the feature dim: ``torch.chunk``)."""

    name, op = "channel_sumsq", "sum"

    def check(self, site: Site, topology: Topology) -> None:
        if len(site.logical_shape) != 2 or site.logical_shape[-1] < 1:
            raise PlacementError(f"{self.name}: needs [tokens, features] activations; got {site.describe()}")
        for axis, p in site.placements:
            if p.is_flat_shard() or p.is_strided_shard():
                raise PlacementError(f"{self.name}: {p} on axis {axis!r} scatters the features; observe the output "
                                     f"as Shard(1) or replicated; got {site.describe()}")

    def size(self, site: Site) -> int:
        return 2 * site.logical_shape[-1]

    def _columns(self, site: Site, topology: Topology) -> tuple[int, int]:
        """``(first channel, channels)`` this rank holds (features split as ``torch.chunk``)."""
        start, length = 0, site.logical_shape[-1]
        for axis, p in site.placements:
            if p.shard_dim() == 1 and axis in topology.axes:
                a = topology.axes[axis]
                begin, count = chunk_range(length, a.size, a.rank)
                start, length = start + begin, count
        return start, length

    def compute(self, tensors, sites, topology, rows):
        out = []
        for t, site in zip(tensors, sites):
            features = site.logical_shape[-1]
            start, length = self._columns(site, topology)
            x = t.detach().reshape(-1, length) if length else t.detach().reshape(0, 0)
            vec = torch.zeros(2 * features, dtype=torch.float64, device=t.device)
            if length:
                vec[start:start + length] = x.to(torch.float64).square().sum(0)
                vec[features + start:features + start + length] = float(x.shape[0])
            out.append(vec)
        return out


def _channel_rms(sums: Sequence[float]) -> torch.Tensor | None:
    """Per-channel RMS from the merged ``[sumsq..., tokens...]``; None without tokens."""
    v = torch.tensor(sums, dtype=torch.float64)
    features = v.numel() // 2
    tokens = v[features:]
    if not features or not bool((tokens > 0).all()):
        return None
    return (v[:features] / tokens).sqrt()


class _ChannelMetric(StatMetric):
    """Base: one :class:`ChannelSums` statistic, per chosen module (``modules`` as
    ``layer-activation-rms``)."""

    def __init__(self, *, modules: str | Sequence[str] | None = None, **kwargs) -> None:
        chosen = (modules,) if isinstance(modules, str) else tuple(modules or ())
        self.modules: tuple[str, ...] = chosen or DEFAULT_MODULES
        self.statistics = (ChannelSums(),)
        super().__init__(**kwargs)

    def accepts(self, site: Site) -> bool:
        path = dict(site.meta).get("module")
        return super().accepts(site) and any(fnmatchcase(site.name, m) or (isinstance(path, str) and fnmatchcase(path, m))
                                             for m in self.modules)


class ChannelKurtosis(_ChannelMetric):
    """Pearson's kurtosis over features of the per-channel RMS (dimensionless; NaN when every
    channel has the same RMS)."""

    formula = "mean_c (r_c - m)^4 / var_c(r)^2, r_c = sqrt(mean_t x_tc^2), m = mean_c r_c"

    def finalize(self, stats):
        r = _channel_rms(stats["channel_sumsq"])
        if r is None:
            return None
        d = r - r.mean()
        var = d.square().mean().item()
        return d.pow(4).mean().item() / (var * var) if var > 0 else math.nan


class OutlierRatio(_ChannelMetric):
    """Largest channel RMS over the (lower) median channel RMS (dimensionless, >= 1)."""

    formula = "max_c r_c / median_c r_c, r_c = sqrt(mean_t x_tc^2)"

    def finalize(self, stats):
        r = _channel_rms(stats["channel_sumsq"])
        if r is None:
            return None
        median = r.median().item()
        return r.max().item() / median if median > 0 else math.inf
