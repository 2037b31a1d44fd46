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
metric and step instead of 16k series. Vectors over attention heads (stat ``heads``, one per
layer) likewise become one layer x head heatmap per metric, key stat ``layer_x_head``
(``layer-attn-entropy/layer_x_head``), their per-head scalars kept only with ``expert_scalars``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tmetrics_core.records import HEADS_STAT, Histogram, Labels, MetricRecord, RunInfo, show_value
from tmetrics_core.sinks.keys import KeyBook, KeyRules, index_widths

__all__ = ["EXPERT_SCALARS_UP_TO", "HEAD_HEATMAP_STAT", "HEATMAP_STAT", "Heatmap", "Rendered", "StepRenderer"]

HEATMAP_STAT = "layer_x_expert"
"""The stat of a layer x expert heatmap's key (``<stat>-layer_x_expert`` under a stat)."""

EXPERT_SCALARS_UP_TO = 256
"""The most layers x experts for which per-expert scalars are kept by default beside the heatmaps."""

HEAD_HEATMAP_STAT = "layer_x_head"
"""The stat of a layer x attention-head heatmap's key."""



@dataclass
class Heatmap:
    """One metric's per-(layer, expert) values at one step.

    ``values`` is a float64 array of shape ``(num_layers, num_experts)``: row ``i`` is layer
    ``i``, column ``j`` expert ``j`` (global indices); ``present`` (bool, same shape) says which
    cells have a value. ``metric`` and ``labels`` (tensor and stat of the series, no layer or
    expert) name what is drawn; ``step`` is the training step of the values.
    """

    metric: str
    labels: Labels
    values: np.ndarray
    present: np.ndarray
    step: int = 0
    columns: str = "experts"
    """What the columns are: ``experts`` or ``heads`` (global attention heads)."""
    _drawn: tuple[np.ndarray, bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def title(self) -> str:
        """The metric, with the stat of the series when it has one."""
        return self.metric if self.labels.stat is None else f"{self.metric} {self.labels.stat}"

    def bounds(self) -> tuple[float, float] | None:
        """``(min, max)`` of the finite values, or None when there is none."""
        finite = self.values[self.present & np.isfinite(self.values)]
        return (float(finite.min()), float(finite.max())) if finite.size else None

    def caption(self) -> str:
        """``layer-router-expert-bias, step 5: 4 layers x 8 experts, min -1 max 2.5 (viridis, ...)``."""
        bounds = self.bounds()
        rows, columns = self.values.shape
        scale = "no finite value" if bounds is None else f"min {show_value(bounds[0])} max {show_value(bounds[1])}"
        return (f"{self.title}, step {self.step}: {rows} layers (rows) x {columns} {self.columns} (columns), {scale} "
                f"(viridis, linear; magenta: NaN or infinite; black: no value)")

    def image(self) -> np.ndarray:
        """The heatmap as a figure, an RGB ``uint8`` array ``(height, width, 3)``: layer 0 the top
        row, expert 0 the left column, axes, colour bar and title as
        :func:`~tmetrics_core.sinks.heatmap_figure.draw` draws them (drawn once per object)."""
        return self._draw()[0]

    def png(self) -> bytes:
        """:meth:`image` as PNG, with ``Title`` and ``Description`` text chunks."""
        return self._draw()[1]

    def _draw(self) -> tuple[np.ndarray, bytes]:
        if self._drawn is None:
            from tmetrics_core.sinks.heatmap_figure import draw

            self._drawn = draw(self.metric, self.title, self.step, self.values, self.present, self.columns)
        return self._drawn


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
        expert_scalars: with ``heatmaps``, keep those scalars as well; None (the default) keeps
            them when the run's layers x experts is at most :data:`EXPERT_SCALARS_UP_TO` (one
            readable chart per layer with a line per expert), decided at :meth:`open`.
        prefix: put before every key (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
    """

    __slots__ = ("book", "distributions", "heatmaps", "expert_scalars", "_asked", "_grid")

    def __init__(self, rules: KeyRules, *, distributions: bool, heatmaps: bool = False,
                 expert_scalars: bool | None = None, prefix: str = "") -> None:
        self.book = KeyBook(rules, prefix=prefix)
        self.distributions = distributions
        self.heatmaps = heatmaps
        self._asked = expert_scalars
        self.expert_scalars = bool(expert_scalars)
        self._grid = (0, 0)

    def open(self, run: RunInfo) -> None:
        """Size the key indices and the heatmaps from the run's layer and expert counts."""
        layer_width, expert_width = index_widths(run.num_layers, run.num_experts)
        self.book = KeyBook(self.book.rules, layer_width=layer_width, expert_width=expert_width,
                            prefix=self.book.prefix)
        self._grid = (run.num_layers, run.num_experts)
        cells = run.num_layers * run.num_experts
        self.expert_scalars = 0 < cells <= EXPERT_SCALARS_UP_TO if self._asked is None else self._asked

    def render(self, records: Sequence[MetricRecord]) -> Rendered:
        """The keyed items of ``records``.

        Raises:
            ConfigError: two series render to one key (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
            ValueError: a negative layer or expert index.
        """
        out = Rendered()
        add = self.book.add
        cells: dict[tuple[str, str | None], list[tuple[int, int, float]]] = {}
        heads: dict[str, list[tuple[int, int, float]]] = {}
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
                if self.heatmaps and labels.stat == HEADS_STAT and labels.layer is not None:
                    heads.setdefault(metric, []).extend((labels.layer, i, v) for i, v in enumerate(value))
                    if not self.expert_scalars:
                        continue
                for element_labels, element in record.elements():
                    self._scalar(out, cells, metric, element_labels, element)
                if not self.distributions:
                    continue
            else:
                self._scalar(out, cells, metric, labels, float(value))
                continue
            if nonfinite:
                out.scalars.append((add(metric, labels.substat("nonfinite")), float(nonfinite)))
        step = max((r.step for r in records), default=0)  # one step's records
        for (name, grid_stat), items in cells.items():
            grid = Labels(stat=grid_stat)
            out.heatmaps.append((add(name, grid.substat(HEATMAP_STAT)), self._heatmap(name, grid, items, step)))
        for name, items in heads.items():
            out.heatmaps.append((add(name, Labels(stat=HEAD_HEATMAP_STAT)),
                                 self._heatmap(name, Labels(), items, step, "heads")))
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

    def _heatmap(self, metric: str, labels: Labels, items: list[tuple[int, int, float]], step: int,
                 columns_are: str = "experts") -> Heatmap:
        rows = max(self._grid[0], 1 + max(layer for layer, _, _ in items))
        known = self._grid[1] if columns_are == "experts" else 0
        columns = max(known, 1 + max(column for _, column, _ in items))
        values = np.full((rows, columns), np.nan)
        present = np.zeros((rows, columns), dtype=bool)
        for layer, expert, value in items:
            values[layer, expert] = value
            present[layer, expert] = True
        return Heatmap(metric, labels, values, present, step, columns_are)
