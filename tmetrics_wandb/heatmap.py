"""``LayerHeatmap``: one per-layer series over steps, drawn as a layer x step image.

A line chart with 96 layers is hard to read; a heatmap shows at a glance which layer drifts
and when. Memory stays bounded for long runs: past ``max_columns`` steps, every other column
is dropped (the latest step always stays), so the image covers the whole run at a coarser
step spacing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LayerHeatmap"]


class LayerHeatmap:
    """Values of one per-layer series (``metric``, ``stat``) over steps.

    Args:
        title: the figure title (``"layer-grad-l2"``).
        max_columns: the most steps kept (>= 2); older columns are thinned beyond it.
    """

    __slots__ = ("title", "max_columns", "_columns", "_changed")

    def __init__(self, title: str, *, max_columns: int = 256) -> None:
        if max_columns < 2:
            raise ValueError(f"LayerHeatmap.max_columns must be >= 2; got {max_columns}")
        self.title = title
        self.max_columns = max_columns
        self._columns: dict[int, dict[int, float]] = {}
        self._changed = False

    @property
    def steps(self) -> list[int]:
        """The steps kept, increasing."""
        return sorted(self._columns)

    @property
    def changed(self) -> bool:
        """Whether a value arrived since the last :meth:`matrix` or :meth:`image`."""
        return self._changed

    def add(self, step: int, layer: int, value: float) -> None:
        """Record ``value`` of ``layer`` at ``step`` (a repeated step overwrites)."""
        self._columns.setdefault(step, {})[layer] = float(value)
        self._changed = True
        if len(self._columns) > self.max_columns:
            steps = self.steps
            keep = set(steps[::2]) | {steps[-1]}
            self._columns = {s: self._columns[s] for s in steps if s in keep}

    def matrix(self) -> tuple[np.ndarray, list[int]]:
        """``(values, steps)``: a float64 array of shape ``(num_layers, len(steps))``, row ``i``
        = layer ``i`` (layers never seen and missing values are NaN)."""
        steps = self.steps
        num_layers = 1 + max((layer for column in self._columns.values() for layer in column), default=-1)
        values = np.full((num_layers, len(steps)), np.nan)
        for j, step in enumerate(steps):
            for layer, value in self._columns[step].items():
                values[layer, j] = value
        self._changed = False
        return values, steps

    def image(self) -> np.ndarray:
        """The heatmap as an RGB ``uint8`` array of shape ``(height, width, 3)``.

        Drawn with matplotlib's Agg canvas (no pyplot, so safe on a worker thread). Layers are
        rows (layer 0 at the bottom), steps along x at their true positions; non-finite cells
        are grey. The colour scale is logarithmic when every finite value is positive and they
        span over two decades.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.figure import Figure

        values, steps = self.matrix()
        finite = values[np.isfinite(values)]
        norm: Normalize | None = None
        if finite.size and finite.min() > 0 and finite.max() / finite.min() > 100:
            norm = LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
        num_layers = max(values.shape[0], 1)
        figure = Figure(figsize=(8.0, min(2.0 + 0.12 * num_layers, 14.0)), dpi=80)
        canvas = FigureCanvasAgg(figure)  # also becomes figure.canvas
        axes = figure.add_subplot()
        shown = np.ma.masked_invalid(values) if values.size else np.ma.masked_all((1, 1))
        x = np.asarray(steps if steps else [0], dtype=np.float64)
        # Cell edges halfway between kept steps: the x axis is the step, even after thinning.
        middles = (x[1:] + x[:-1]) / 2 if x.size > 1 else np.empty(0)
        x_edges = np.concatenate([[x[0] - 0.5], middles, [x[-1] + 0.5]])
        y_edges = np.arange(shown.shape[0] + 1) - 0.5
        picture = axes.pcolormesh(x_edges, y_edges, shown, cmap=_colormap(), norm=norm, shading="flat")
        figure.colorbar(picture, ax=axes)
        axes.set_xlabel("step")
        axes.set_ylabel("layer")
        axes.set_title(self.title)
        figure.tight_layout()
        canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
        return np.ascontiguousarray(rgba[..., :3])


def _colormap():  # -> matplotlib.colors.Colormap
    from matplotlib import colormaps

    return colormaps["viridis"].with_extremes(bad="0.6")
