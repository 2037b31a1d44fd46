"""The custom-scalars layout: the per-layer dashboard a person would build by hand.

TensorBoard's *Custom Scalars* tab draws one chart per entry of a ``Layout`` proto; a
multi-line chart takes a regular expression and draws every scalar tag that matches it. The
layout grows with the label sets the sink sees, one category per metric:

========================  =====================================  ==============================
labels                    chart                                  lines
========================  =====================================  ==============================
layer (+ stat)            one per metric (and stat)              every layer
layer, expert (+ stat)    one per layer (and stat)               every expert of that layer
expert (+ stat)           one per metric (and stat)              every expert
tensor ``layers.3.x``     one per tensor family ``layers.*.x``   every layer (and expert)
tensor without index      one per tensor                         that tensor
none (global)             one per metric, in category "global"   the metric
========================  =====================================  ==============================

Colours and legend: the ``Layout`` proto has no field for either (``Category``: ``title``,
``chart``, ``closed``; ``Chart``: ``title`` and one of ``multiline`` (``tag``, regexes) or
``margin`` (``series``: ``value``, ``lower``, ``upper`` tags)). The dashboard names each line
``"<tag> (<run>)"`` and colours it by the run parsed back from that name, so every layer of one run
is drawn in the run's colour (TensorBoard 2.x, ``tf-custom-scalar-multi-line-chart-card``). What
stands in for a legend: the chart's "Matches" list names every tag drawn, and its tooltip names
the tag of each line under the cursor; per-layer colours are in the Time Series tab's one card
per layer and in the layer x expert heatmaps.

TensorBoard reads the layout from the tag ``custom_scalars__config__``; its data provider always
keeps the most recent event of a tag, so writing a grown layout at a later step replaces the
earlier one.
"""

from __future__ import annotations

import re

from tmetrics_core.records import Labels
from tmetrics_core.sinks.keys import TENSORBOARD_RULES

__all__ = ["CONFIG_TAG", "ScalarLayout"]

CONFIG_TAG = "custom_scalars__config__"
"""The tag TensorBoard's custom-scalars plugin reads the layout from."""

GLOBAL_CATEGORY = "global"

_INDEX_IN_NAME = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def _literal(segment: str) -> str:
    """A rendered TensorBoard key segment as a regex; of ``[-/\\w.]`` only ``.`` is special."""
    return segment.replace(".", r"\.")


def _tensor_family(tensor: str) -> list[str]:
    """The literal pieces of ``tensor`` around its wildcarded indices.

    ``layers.3.attn.q.weight`` -> ``["layers.", ".attn.q.weight"]`` (family
    ``layers.*.attn.q.weight``); with two or more indices the first stays, so one chart holds
    one layer's experts: ``layers.3.moe.experts.5.up.weight`` -> ``["layers.3.moe.experts.",
    ".up.weight"]``. A name without indices is one piece.
    """
    indices = list(_INDEX_IN_NAME.finditer(tensor))
    wild = indices[1:] if len(indices) >= 2 else indices
    pieces, start = [], 0
    for match in wild:
        pieces.append(tensor[start : match.start()])
        start = match.end()
    pieces.append(tensor[start:])
    return pieces


class ScalarLayout:
    """Charts (category -> chart title -> tag regex) grown from the scalar label sets seen.

    Args:
        layer_width: the zero-padding width of layer indices in keys (for chart titles).
        prefix: the text before every tag (the sink's ``prefix``).
    """

    __slots__ = ("_categories", "_seen", "_layer_width", "_prefix")

    def __init__(self, *, layer_width: int = 2, prefix: str = "") -> None:
        self._categories: dict[str, dict[str, str]] = {}
        self._seen: set[tuple[str, Labels]] = set()
        self._layer_width = layer_width
        self._prefix = _literal(prefix)

    @property
    def categories(self) -> dict[str, dict[str, str]]:
        """Category title -> chart title -> tag regex, in the order they first appeared."""
        return {title: dict(charts) for title, charts in self._categories.items()}

    def add(self, metric: str, labels: Labels) -> bool:
        """Place the scalar series ``metric`` with ``labels``; True when this added a chart."""
        if (metric, labels) in self._seen:
            return False
        self._seen.add((metric, labels))
        category, title, regex = self._chart(metric, labels)
        charts = self._categories.setdefault(category, {})
        if title in charts:
            return False
        charts[title] = regex
        return True

    def _chart(self, metric: str, labels: Labels) -> tuple[str, str, str]:
        layer, expert, tensor, stat = labels.layer, labels.expert, labels.tensor, labels.stat
        seg = TENSORBOARD_RULES.segment
        head = self._prefix + _literal(seg(metric))
        tail = "" if stat is None else "/" + _literal(seg(stat))
        suffix = "" if stat is None else f" {stat}"
        if tensor is not None:
            pieces = _tensor_family(tensor)
            family = "*".join(pieces)
            if len(pieces) == 1:
                pattern = _literal(seg(tensor))
            else:
                pattern = r"\d+".join(_literal(TENSORBOARD_RULES.clean(piece)) for piece in pieces)
            index = "" if layer is None else rf"/layer_\d+"
            index += "" if expert is None else rf"/expert_\d+"
            return metric, f"{metric} {family}{suffix}", f"^{head}/{pattern}{index}{tail}$"
        if layer is not None and expert is not None:
            name = f"layer_{layer:0{self._layer_width}d}"
            return metric, f"{metric} {name}{suffix}", rf"^{head}/{name}/expert_\d+{tail}$"
        if layer is not None:
            return metric, f"{metric}{suffix} (all layers)", rf"^{head}/layer_\d+{tail}$"
        if expert is not None:
            return metric, f"{metric}{suffix} (all experts)", rf"^{head}/expert_\d+{tail}$"
        return GLOBAL_CATEGORY, f"{metric}{suffix}", f"^{head}{tail}$"

    def proto(self):  # -> tensorboard.plugins.custom_scalar.layout_pb2.Layout
        """The layout as TensorBoard's ``Layout`` proto: multi-line charts only."""
        from tensorboard.plugins.custom_scalar import layout_pb2

        layout = layout_pb2.Layout()
        for title, charts in self._categories.items():
            category = layout.category.add(title=title)
            for chart_title, regex in charts.items():
                chart = category.chart.add(title=chart_title)
                chart.multiline.tag.append(regex)
        return layout
