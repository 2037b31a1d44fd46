"""``TensorBoardSink``: records as TensorBoard scalars, histograms, images and a custom-scalars layout.

Everything goes into one event file in one directory (``<run.dir>/tb/<run name>`` by default): no
``add_scalars`` or ``add_hparams`` sub-runs. Each ``write`` is one event holding every value of
the step, written by :class:`~tmetrics_tb.event_file.EventFile`: for 18k scalars about 20 ms
of worker time against about 1 s for one ``SummaryWriter.add_scalar`` call per value.

Tags are the keys of :mod:`tmetrics_core.sinks.keys` under :data:`~tmetrics_core.sinks.keys.TENSORBOARD_RULES`
(``layer-grad-l2/layer_03``), so TensorBoard groups them by metric family. What each record
becomes is decided by :class:`~tmetrics_core.sinks.render.StepRenderer` (with distributions and
heatmaps); here:

- scalar: a scalar series (NaN and infinities kept as such);
- histogram: a TensorBoard histogram built from the bin edges and counts (exact zeros become a
  zero-width bucket at 0), plus the scalar ``<key>/nonfinite`` when NaN or infinite values were
  counted;
- vector (e.g. tokens per expert of a layer): a histogram of its finite elements and its
  elements as scalars (expert ``i``), plus the same ``nonfinite`` scalar;
- per-(layer, expert) scalars (``layer-router-expert-bias``, tokens per expert): one layer x
  expert image per metric and step in the Images tab (``<metric>/layer_x_expert``), instead of
  one series per expert unless ``expert_scalars`` is true.

An empty histogram (or one whose values are all non-finite) is written with zero counts, so the
series has every step.

Alerts: one text summary per step that raised any, tag ``tmetrics/alerts`` (Text tab, one line per
alert as :meth:`~tmetrics_core.alerts.alert.Alert.describe` writes it, the step's first opening
first).
"""

from __future__ import annotations

import math
import os
import re
import struct
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import TENSORBOARD_RULES, KeyRules
from tmetrics_core.sinks.render import Heatmap, StepRenderer
from tmetrics_core.records import Histogram, MetricRecord, RunInfo, RunStatus
from tmetrics_core.sinks.vector_bins import vector_bins
from tmetrics_tb.event_file import EventFile
from tmetrics_tb.layout import CONFIG_TAG, ScalarLayout

__all__ = ["TensorBoardSink"]

_OPTIONS = ("log_dir", "flush_secs", "expert_scalars", "prefix")


class TensorBoardSink:
    """Writes records to a TensorBoard event file.

    Keyword args:
        log_dir (str, optional): the event-file directory; defaults to ``<run.dir>/tb/<run.name>``
            (``tensorboard --logdir <run.dir>/tb`` then shows a run named after the run).
        flush_secs (float, optional): at most this many seconds between writes to disk
            (default 10); ``flush()`` writes at once.
        expert_scalars (bool, optional): also write every per-(layer, expert) value as its own
            scalar series; default when layers x experts is at most 256 (always one layer x
            expert image per metric and step).
        prefix (str, optional): put before every tag; ``"tmetrics/"`` when ``log_dir`` is the
            directory of the user's own ``SummaryWriter`` (``from_config(..., trackers=[writer])``),
            so TensorBoard shows one run and tmetrics' tags never meet the owner's. Default none.

    Raises:
        ConfigError: an unknown option or an invalid value (path ``sinks.tensorboard.<option>``).
    """

    name = "tensorboard"
    key_rules: KeyRules = TENSORBOARD_RULES
    requires = ("tensorboard", "yaml", "matplotlib")

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None, flush_secs: float = 10.0,
                 expert_scalars: bool | None = None, prefix: str = "", **unknown: Any) -> None:
        if unknown:
            bad = sorted(unknown)[0]
            raise ConfigError(
                f"unknown option {bad!r}; valid options are {', '.join(_OPTIONS)}", path=f"sinks.{self.name}.{bad}"
            )
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ConfigError(f"got {log_dir!r}; need a directory path (a string)", path=f"sinks.{self.name}.log_dir")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
            raise ConfigError(f"got {flush_secs!r}; need a number of seconds > 0", path=f"sinks.{self.name}.flush_secs")
        if expert_scalars is not None and not isinstance(expert_scalars, bool):
            raise ConfigError(f"got {expert_scalars!r}; need true or false (or leave it unset)",
                              path=f"sinks.{self.name}.expert_scalars")
        if not isinstance(prefix, str) or not re.fullmatch(r"[-/\w.]*", prefix, flags=re.ASCII):
            raise ConfigError(f"got {prefix!r}; need a text of characters [-/\\w.] (e.g. 'tmetrics/')",
                              path=f"sinks.{self.name}.prefix")
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_secs = float(flush_secs)
        self._writer: EventFile | None = None
        self._renderer = StepRenderer(TENSORBOARD_RULES, distributions=True, heatmaps=True, expert_scalars=expert_scalars,
                                      prefix=prefix)
        self._layout = ScalarLayout(prefix=prefix)
        self._layout_dirty = False
        self._scalar_prefixes: dict[str, bytes] = {}
        self._last_step = 0

    def open(self, run: RunInfo) -> None:
        """Create the event file in ``log_dir`` (made if missing) and write the run's facts as text.
        A retry after a failed ``open`` reuses the event file already created.

        Raises:
            ImportError: the ``tensorboard`` package is missing (``pip install tmetrics[tb]``).
        """
        if self._writer is None:
            # A directory named after the run: TensorBoard names the run by it (not ".").
            log_dir = self.log_dir if self.log_dir is not None else Path(run.dir) / "tb" / TENSORBOARD_RULES.segment(run.name)
            log_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = log_dir
            self._renderer.open(run)
            self._layout = ScalarLayout(layer_width=self._renderer.book.layer_width, prefix=self._renderer.book.prefix)
            self._writer = EventFile(log_dir, flush_secs=self.flush_secs)
        facts = {"name": run.name, "dir": run.dir, "tags": dict(run.tags), "metrics": list(run.metrics)}
        self._write_text("tmetrics/run", facts, step=0)

    def log_config(self, config: dict[str, Any]) -> None:
        """Write ``config`` as YAML text under the tag ``tmetrics/config`` (Text tab)."""
        self._write_text("tmetrics/config", config, step=0)

    def _prefix(self, key: str) -> bytes:
        """The encoded scalar-value prefix of the tag ``key`` (cached; a new tag joins the
        custom-scalars layout)."""
        prefix = self._scalar_prefixes.get(key)
        if prefix is None:
            prefix = _scalar_prefix(key)
            self._layout_dirty |= self._layout.add(*self._renderer.book.series(key))
            self._scalar_prefixes[key] = prefix
        return prefix

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Write every record of one step as a single event.

        Raises:
            ConfigError: two label sets render to one tag (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
            RuntimeError: the sink is not open.
        """
        from tensorboard.compat.proto import summary_pb2

        self._require_open()
        rendered = self._renderer.render(records)
        scalars: list[bytes] = []
        for key, value in rendered.scalars:
            scalars.append(self._prefix(key))
            scalars.append(_float32(value))
        summary = summary_pb2.Summary.FromString(b"".join(scalars))
        summary.value.extend(
            summary_pb2.Summary.Value(tag=key, histo=_histogram_proto(v) if isinstance(v, Histogram) else _vector_proto(v))
            for key, v in rendered.distributions)
        summary.value.extend(summary_pb2.Summary.Value(tag=key, image=_image_proto(h)) for key, h in rendered.heatmaps)
        if self._layout_dirty:
            summary.value.append(_layout_value(self._layout))
        self._add(summary, step)
        self._layout_dirty = False

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Write the step's alerts as one text summary, tag ``tmetrics/alerts``.

        Raises:
            RuntimeError: the sink is not open.
        """
        self._write_text("tmetrics/alerts", "\n".join(a.describe() for a in alerts), step=step)

    def flush(self) -> None:
        """Write buffered events to disk."""
        self._require_open().flush()

    def close(self, status: RunStatus) -> None:
        """Write ``status`` as text (``tmetrics/status``), flush and close the event file."""
        if self._writer is None:
            return
        self._write_text("tmetrics/status", status, step=self._last_step)
        self._writer.close()
        self._writer = None

    def _require_open(self) -> EventFile:
        if self._writer is None:
            raise RuntimeError("TensorBoardSink is not open: call open(run) first (or it was closed)")
        return self._writer

    def _add(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
        self._require_open().write(event.SerializeToString())
        self._last_step = max(self._last_step, int(step))

    def _write_text(self, tag: str, data: Any, *, step: int) -> None:
        from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text import metadata

        text = data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        # Indented four spaces: a Markdown code block, so the Text tab keeps the YAML layout.
        markdown = "\n".join("    " + line for line in text.splitlines()) or "    (empty)"
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
            string_val=[markdown.encode("utf-8")],
        )
        summary = summary_pb2.Summary()
        summary.value.add(tag=tag, tensor=tensor, metadata=metadata.create_summary_metadata(display_name="", description=""))
        self._add(summary, step)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _scalar_prefix(tag: str) -> bytes:
    """The protobuf encoding of ``Summary.value { tag: TAG, simple_value: <4 bytes> }`` up to the
    float: field 1 (length-delimited) holding field 1 (the tag string) and field 2 (fixed32).

    Encoding the value list by hand, with this prefix cached per tag, and parsing it once with
    ``Summary.FromString`` is about 2.5x faster than ``summary.value.add`` per value: it keeps a
    step of 18k scalars short on the worker thread, which shares the GIL with training.
    """
    name = tag.encode("utf-8")
    payload = 1 + len(_varint(len(name))) + len(name) + 1 + 4
    return b"\x0a" + _varint(payload) + b"\x0a" + _varint(len(name)) + name + b"\x15"


_PACK_FLOAT32 = struct.Struct("<f").pack


def _float32(value: float) -> bytes:
    """``value`` as TensorBoard's 32-bit ``simple_value``; beyond float32's range it is +-inf,
    as protobuf itself would store it."""
    try:
        return _PACK_FLOAT32(value)
    except OverflowError:
        return _PACK_FLOAT32(math.copysign(math.inf, value))


def _layout_value(layout: ScalarLayout) -> Any:
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.custom_scalar import metadata

    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[layout.proto().SerializeToString()],
    )
    return summary_pb2.Summary.Value(tag=CONFIG_TAG, tensor=tensor, metadata=metadata.create_summary_metadata())


def _image_proto(heatmap: Heatmap) -> Any:
    """TensorBoard's ``Summary.Image`` of a heatmap: the RGB PNG of its figure (axes, colour bar)."""
    from tensorboard.compat.proto import summary_pb2

    height, width, _ = heatmap.image().shape
    return summary_pb2.Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=heatmap.png())


def _histogram_proto(hist: Histogram) -> Any:
    """TensorBoard's ``HistogramProto`` for a merged histogram.

    TensorBoard buckets are ``(previous limit, limit]`` with the first starting at ``min``.
    Exact zeros go to the bin holding 0, or to a zero-width bucket at 0 (with an empty bucket
    up to the first edge) when 0 is outside the edges. ``sum`` and ``sum_squares`` are estimated
    from bin midpoints (the bins are all we have).
    """
    from tensorboard.compat.proto import summary_pb2

    lefts = list(hist.edges[:-1])
    rights = list(hist.edges[1:])
    counts = list(hist.counts)
    if hist.zeros:
        inside = [i for i, (lo, hi) in enumerate(zip(lefts, rights)) if lo <= 0.0 < hi]
        if inside:
            counts[inside[0]] += hist.zeros
        elif rights and 0.0 < lefts[0]:
            lefts, rights, counts = [0.0, 0.0] + lefts, [0.0, lefts[0]] + rights, [hist.zeros, 0] + counts
        else:
            lefts, rights, counts = lefts + [0.0], rights + [0.0], counts + [hist.zeros]
    if not rights:
        lefts, rights, counts = [0.0], [0.0], [0]
    num = sum(counts)
    filled = [i for i, c in enumerate(counts) if c]
    if filled:  # TensorBoard's first bucket runs from ``min``: drop the empty outer bins
        keep = slice(filled[0], filled[-1] + 1)
        lefts, rights, counts = lefts[keep], rights[keep], counts[keep]
        filled = [i - filled[0] for i in filled]
    mids = [(lo + hi) / 2 for lo, hi in zip(lefts, rights)]
    return summary_pb2.HistogramProto(
        min=lefts[filled[0]] if filled else 0.0,
        max=rights[filled[-1]] if filled else 0.0,
        num=float(num),
        sum=float(sum(c * m for c, m in zip(counts, mids))),
        sum_squares=float(sum(c * m * m for c, m in zip(counts, mids))),
        bucket_limit=rights,
        bucket=[float(c) for c in counts],
    )


def _vector_proto(values: tuple[float, ...]) -> Any:
    """TensorBoard's ``HistogramProto`` of the finite elements of a vector (their bins:
    :func:`~tmetrics_core.sinks.vector_bins.vector_bins`; exact min, max, sum)."""
    from tensorboard.compat.proto import summary_pb2

    bins = vector_bins(values)
    if bins is None:
        return summary_pb2.HistogramProto(min=0.0, max=0.0, num=0.0, sum=0.0, sum_squares=0.0, bucket_limit=[0.0], bucket=[0.0])
    finite = bins.finite
    return summary_pb2.HistogramProto(
        min=float(finite.min()),
        max=float(finite.max()),
        num=float(finite.size),
        sum=float(finite.sum()),
        sum_squares=float((finite * finite).sum()),
        bucket_limit=[float(e) for e in bins.edges[1:]],
        bucket=[float(c) for c in bins.counts],
    )
