"""Read a TensorBoard log directory back through tensorboard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

__all__ = ["TensorBoardLog", "read_log"]

CONFIG_TAG = "custom_scalars__config__"


class TensorBoardLog:
    """Everything one event directory holds: scalars, histograms, images, text and the layout."""

    def __init__(self, accumulator: EventAccumulator) -> None:
        self._acc = accumulator
        tags = accumulator.Tags()
        self.scalar_tags: set[str] = set(tags["scalars"])
        self.histogram_tags: set[str] = set(tags["histograms"])
        self.tensor_tags: set[str] = set(tags["tensors"])
        self.image_tags: set[str] = set(tags["images"])

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in self._acc.Scalars(tag)]

    def histograms(self, tag: str) -> list[tuple[int, Any]]:
        """``(step, HistogramValue(min, max, num, sum, sum_squares, bucket_limit, bucket))``."""
        return [(e.step, e.histogram_value) for e in self._acc.Histograms(tag)]

    def images(self, tag: str) -> list[tuple[int, int, int, bytes]]:
        """``(step, height, width, PNG bytes)`` per image event of ``tag``."""
        return [(e.step, e.height, e.width, e.encoded_image_string) for e in self._acc.Images(tag)]

    def text(self, tag: str) -> str:
        events = self._acc.Tensors(tag)
        return events[-1].tensor_proto.string_val[0].decode("utf-8")

    def layout(self) -> layout_pb2.Layout:
        """The most recent custom-scalars layout (what TensorBoard shows)."""
        events = self._acc.Tensors(CONFIG_TAG)
        layout = layout_pb2.Layout()
        layout.ParseFromString(events[-1].tensor_proto.string_val[0])
        return layout

    def layout_charts(self) -> dict[str, dict[str, list[str]]]:
        """Category -> chart title -> the regexes of its multi-line chart."""
        return {
            category.title: {chart.title: list(chart.multiline.tag) for chart in category.chart}
            for category in self.layout().category
        }


def read_log(log_dir: str | Path) -> TensorBoardLog:
    """The run in ``log_dir``, or in its one sub-directory holding event files (the sink's default
    ``<run.dir>/tb/<run name>`` read as ``<run.dir>/tb``)."""
    runs = sorted({p.parent for p in Path(log_dir).rglob("*tfevents*")})
    if not list(Path(log_dir).glob("*tfevents*")) and len(runs) == 1:
        log_dir = runs[0]
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return TensorBoardLog(accumulator)
