"""From one step's records to what a tracker stores: keyed scalars, distributions and heatmaps.

Written once for every tracker sink (TensorBoard, W&B, MLflow), which then only turn these
items into their own objects. Per record:

- scalar: one scalar under the record's key;
- histogram: with ``distributions``, the histogram under the record's key; else its three counts
  as scalars, stats ``total``, ``zeros`` and ``nonfinite`` (``<stat>-total`` ... with a stat);
- vector (tokens per expert of a layer): one scalar per element, labelled by
  :meth:`~tmetrics_core.records.MetricRecord.elements` (element ``i`` is expert ``i``), and with
  ``distributions`` the vector itself as a distribution of its finite elements;
- with ``distributions``, a histogram or vector holding NaN or infinite values also gives the
  scalar count ``nonfinite`` (``<stat>-nonfinite``): those values have no bin.

With ``heatmaps``, the scalars that carry both a layer and an expert label (and no tensor) are
gathered per metric and stat into one :class:`Heatmap`, rows layers, columns experts, key stat
``layer_x_expert`` (``layer-router-expert-bias/layer_x_expert``); those scalars are then left
out unless ``expert_scalars`` keeps them. A model with 64 layers and 256 experts is one image per
metric and step instead of 16k series.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo, show_value
from tmetrics_core.sinks.keys import KeyBook, KeyRules, index_widths

__all__ = ["HEATMAP_STAT", "Heatmap", "Rendered", "StepRenderer"]

HEATMAP_STAT = "layer_x_expert"
"""The stat of a layer x expert heatmap's key (``<stat>-layer_x_expert`` under a stat)."""

_NONFINITE_RGB = (255, 0, 255)
_ABSENT_RGB = (0, 0, 0)
_TARGET_PIXELS = 256
_MAX_CELL_PIXELS = 16


@dataclass
class Heatmap:
    """One metric's per-(layer, expert) values at one step.

    ``values`` is a float64 array of shape ``(num_layers, num_experts)``: row ``i`` is layer
    ``i``, column ``j`` expert ``j`` (global indices); ``present`` (bool, same shape) says which
    cells have a value. ``metric`` and ``labels`` (tensor and stat of the series, no layer or
    expert) name what is drawn.
    """

    metric: str
    labels: Labels
    values: np.ndarray
    present: np.ndarray

    @property
    def cell_pixels(self) -> int:
        """Pixels per cell side in :meth:`image`: about 256 pixels along the longer side, 1 to 16."""
        return max(1, min(_MAX_CELL_PIXELS, _TARGET_PIXELS // max(self.values.shape, default=1)))

    def bounds(self) -> tuple[float, float] | None:
        """``(min, max)`` of the finite values, or None when there is none."""
        finite = self.values[self.present & np.isfinite(self.values)]
        return (float(finite.min()), float(finite.max())) if finite.size else None

    def caption(self) -> str:
        """``layer-router-expert-bias: 4 layers x 8 experts, min -1 max 2.5 (viridis, ...)``."""
        bounds = self.bounds()
        rows, columns = self.values.shape
        scale = "no finite value" if bounds is None else f"min {show_value(bounds[0])} max {show_value(bounds[1])}"
        title = self.metric if self.labels.stat is None else f"{self.metric} {self.labels.stat}"
        return (f"{title}: {rows} layers (rows) x {columns} experts (columns), {scale} "
                f"(viridis, linear; magenta: NaN or infinite; black: no value)")

    def image(self) -> np.ndarray:
        """The heatmap as an RGB ``uint8`` array of shape ``(num_layers * p, num_experts * p, 3)``
        with ``p`` = :attr:`cell_pixels`: layer 0 the top row of cells, expert 0 the left column.

        Colours: matplotlib's ``viridis`` on a linear scale from the smallest to the largest
        finite value (dark blue to yellow; the brightest cell holds the largest value; one
        value alone is the middle colour); NaN and infinite cells magenta, cells without a value
        black.
        """
        from matplotlib import colormaps

        bounds = self.bounds()
        finite = self.present & np.isfinite(self.values)
        if bounds is None or bounds[1] == bounds[0]:
            scaled = np.full(self.values.shape, 0.5)
        else:
            scaled = (np.where(finite, self.values, bounds[0]) - bounds[0]) / (bounds[1] - bounds[0])
        rgb = colormaps["viridis"](scaled, bytes=True)[..., :3]
        rgb[self.present & ~finite] = _NONFINITE_RGB
        rgb[~self.present] = _ABSENT_RGB
        p = self.cell_pixels
        return np.ascontiguousarray(rgb.repeat(p, axis=0).repeat(p, axis=1))

    def png(self) -> bytes:
        """:meth:`image` encoded as PNG."""
        from matplotlib.image import imsave

        buffer = io.BytesIO()
        imsave(buffer, self.image(), format="png")
        return buffer.getvalue()


@dataclass
class Rendered:
    """One step for one backend: ``(key, value)`` items, keys from the renderer's KeyBook."""

    scalars: list[tuple[str, float]] = field(default_factory=list)
    distributions: list[tuple[str, Histogram | tuple[float, ...]]] = field(default_factory=list)
    heatmaps: list[tuple[str, Heatmap]] = field(default_factory=list)


class StepRenderer:
    """Turns records into one backend's keyed items (see the module docstring).

    Args:
        rules: the backend's key rules.
        distributions: the backend stores histograms (TensorBoard, W&B); else histograms become
            counts and vectors only their elements (MLflow).
        heatmaps: gather per-(layer, expert) scalars into layer x expert heatmaps.
        expert_scalars: with ``heatmaps``, keep those scalars as well.
    """

    __slots__ = ("book", "distributions", "heatmaps", "expert_scalars", "_grid")

    def __init__(self, rules: KeyRules, *, distributions: bool, heatmaps: bool = False,
                 expert_scalars: bool = False) -> None:
        self.book = KeyBook(rules)
        self.distributions = distributions
        self.heatmaps = heatmaps
        self.expert_scalars = expert_scalars
        self._grid = (0, 0)

    def open(self, run: RunInfo) -> None:
        """Size the key indices and the heatmaps from the run's layer and expert counts."""
        layer_width, expert_width = index_widths(run.num_layers, run.num_experts)
        self.book = KeyBook(self.book.rules, layer_width=layer_width, expert_width=expert_width)
        self._grid = (run.num_layers, run.num_experts)

    def render(self, records: Sequence[MetricRecord]) -> Rendered:
        """The keyed items of ``records``.

        Raises:
            ConfigError: two series render to one key (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
            ValueError: a negative layer or expert index.
        """
        out = Rendered()
        add = self.book.add
        cells: dict[tuple[str, str | None], list[tuple[int, int, float]]] = {}
        for record in records:
            metric, labels, value = record.metric, record.labels, record.value
            if isinstance(value, Histogram):
                nonfinite = value.nan + value.posinf + value.neginf
                if self.distributions:
                    out.distributions.append((add(metric, labels), value))
                else:
                    for stat, count in (("total", value.total), ("zeros", value.zeros), ("nonfinite", nonfinite)):
                        out.scalars.append((add(metric, labels.substat(stat)), float(count)))
                    continue
            elif isinstance(value, tuple):
                nonfinite = sum(1 for v in value if not math.isfinite(v))
                if self.distributions:
                    out.distributions.append((add(metric, labels), value))
                for element_labels, element in record.elements():
                    self._scalar(out, cells, metric, element_labels, element)
                if not self.distributions:
                    continue
            else:
                self._scalar(out, cells, metric, labels, float(value))
                continue
            if nonfinite:
                out.scalars.append((add(metric, labels.substat("nonfinite")), float(nonfinite)))
        for (name, grid_stat), items in cells.items():
            grid = Labels(stat=grid_stat)
            out.heatmaps.append((add(name, grid.substat(HEATMAP_STAT)), self._heatmap(name, grid, items)))
        return out

    def _scalar(self, out: Rendered, cells: dict[tuple[str, str | None], list[tuple[int, int, float]]],
                metric: str, labels: Labels, value: float) -> None:
        layer, expert = labels.layer, labels.expert
        if self.heatmaps and layer is not None and expert is not None and labels.tensor is None:
            if layer < 0 or expert < 0:
                raise ValueError(f"{metric}: layer and expert indices must be >= 0; got {labels.where()}")
            cells.setdefault((metric, labels.stat), []).append((layer, expert, value))
            if not self.expert_scalars:
                return
        out.scalars.append((self.book.add(metric, labels), value))

    def _heatmap(self, metric: str, labels: Labels, items: list[tuple[int, int, float]]) -> Heatmap:
        rows = max(self._grid[0], 1 + max(layer for layer, _, _ in items))
        columns = max(self._grid[1], 1 + max(expert for _, expert, _ in items))
        values = np.full((rows, columns), np.nan)
        present = np.zeros((rows, columns), dtype=bool)
        for layer, expert, value in items:
            values[layer, expert] = value
            present[layer, expert] = True
        return Heatmap(metric, labels, values, present)
