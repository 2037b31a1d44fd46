"""A layer x expert heatmap drawn as a person reads it: axes with layer and expert ticks, a colour
bar with its range, the metric and the step in the title, dead experts marked.

Drawn with matplotlib's Agg canvas (no pyplot: safe on a sink's worker thread). The figure grows
with the grid (about 0.3 inch per expert and per layer, from 5 x 3.5 to 16 x 12 inches at 80 dpi),
so 4 x 8 cells stay large and 64 x 256 still fit a screen. Ticks name every layer and expert up to
32 of them, else evenly spaced integers.

Colours: ``viridis`` on a linear scale from the smallest to the largest finite value (the colour
bar shows both ends); NaN and infinite cells magenta, cells without a value black. Where the
metric counts tokens (:data:`DEAD_MARKED`), a cell of 0 (an expert that got no token in that
layer) carries a red ``x`` and the legend says so.
"""

from __future__ import annotations

import io
import numpy as np

__all__ = ["DEAD_MARKED", "draw"]

DEAD_MARKED = frozenset({"layer-expert-tokens"})
"""Metrics whose 0 means a dead expert (no token routed to it)."""

_DPI = 80
_ALL_TICKS = 32


def draw(metric: str, title: str, step: int, values: np.ndarray, present: np.ndarray,
         across: str = "experts") -> tuple[np.ndarray, bytes]:
    """The heatmap as ``(rgb, png)``: an RGB ``uint8`` array ``(height, width, 3)`` and the same
    picture as PNG, whose text chunks ``Title`` and ``Description`` say what is drawn (metric,
    step, axes, colour range, dead experts) for readers that cannot see it.

    Args:
        metric: the catalogue name (decides whether zeros are marked dead).
        title: what the title names (the metric, with its stat).
        step: the training step of the values.
        values: float64 ``(num_layers, num_experts)``; row ``i`` layer ``i``, column ``j`` expert ``j``.
        present: bool, same shape: which cells hold a value.
        across: what the columns are, ``experts`` or ``heads`` (global attention heads).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.image import imsave
    from matplotlib.ticker import MaxNLocator

    layers, experts = values.shape
    finite = present & np.isfinite(values)
    low, high = (float(values[finite].min()), float(values[finite].max())) if finite.any() else (0.0, 1.0)
    if high == low:
        low, high = low - 0.5, high + 0.5
    figure = Figure(figsize=(min(16.0, max(5.0, 2.5 + 0.3 * experts)), min(12.0, max(3.5, 1.8 + 0.3 * layers))),
                    dpi=_DPI)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad=(1.0, 0.0, 1.0))
    shown = np.ma.masked_where(~finite, values)
    picture = axes.imshow(shown, cmap=cmap, vmin=low, vmax=high, aspect="auto", interpolation="nearest")
    if (~present).any():
        axes.imshow(np.ma.masked_where(present, np.zeros(values.shape)), cmap=ListedColormap(["black"]),
                    aspect="auto", interpolation="nearest")
    dead = present & (values == 0) if metric in DEAD_MARKED else np.zeros(values.shape, dtype=bool)
    rows, columns = np.nonzero(dead)
    if rows.size:
        axes.scatter(columns, rows, marker="x", color="red", s=max(12.0, 300.0 / max(layers, experts)),
                     label=f"0 tokens: dead ({rows.size})")
        axes.legend(loc="upper left", bbox_to_anchor=(0.0, -0.12), fontsize=8, frameon=False)
    for axis, count in ((axes.xaxis, experts), (axes.yaxis, layers)):
        if count <= _ALL_TICKS:
            axis.set_ticks(range(count))
        else:
            axis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    axes.tick_params(labelsize=8)
    axes.set_xlabel(across.rstrip("s"))
    axes.set_ylabel("layer")
    heading = f"{title}, step {step}"
    axes.set_title(heading, fontsize=10)
    bar = figure.colorbar(picture, ax=axes)
    bar.set_label(f"min {low:.4g} .. max {high:.4g}" if finite.any() else "no finite value", fontsize=8)
    bar.ax.tick_params(labelsize=8)
    figure.tight_layout()
    canvas.draw()
    rgb = np.ascontiguousarray(np.asarray(canvas.buffer_rgba())[..., :3])
    described = (f"{layers} layers (y axis, ticks 0..{layers - 1}) x {experts} {across} (x axis, ticks 0..{experts - 1}); "
                 f"colour bar viridis {'from ' + format(low, '.6g') + ' to ' + format(high, '.6g') if finite.any() else 'no finite value'}"
                 f"; magenta NaN or infinite, black no value; dead experts marked: {int(rows.size)}")
    buffer = io.BytesIO()
    imsave(buffer, rgb, format="png", metadata={"Title": heading, "Description": described})
    return rgb, buffer.getvalue()

