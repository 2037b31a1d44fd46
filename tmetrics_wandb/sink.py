"""``WandbSink``: records as one W&B ``log`` call per step, with sections, histograms and heatmaps.

Keys are those of :mod:`tmetrics_core.sinks.keys` under :data:`~tmetrics_core.sinks.keys.WANDB_RULES`; W&B
makes a section of the text before the first ``/``, so each metric family is one section with
one chart per layer (``layer-grad-l2/layer_03``).

One run by default: when the process has a W&B run as the sink is built (``wandb.run``: the
user's ``wandb.init``, the Trainer's ``WandbCallback``, Lightning's ``WandbLogger``, accelerate's
tracker), the sink writes into it: every key under ``tmetrics/`` (one section beside the owner's;
W&B's workspace setting "group by all segments" gives one per metric), the config under
``tmetrics`` in the run config, each step merged into one of the owner's open rows
(``commit=False``, so W&B's own step, which the owner may set with ``log(step=...)``, moves only
with the owner's calls while training; at ``close``, steps still waiting for a row get rows of
their own, see ``WandbSink._drain``), and ``close`` leaves the run open.

The step is a logged field, ``tmetrics/step``, declared with ``define_metric`` and used as the
x axis of every other key (in a shared run, of tmetrics' keys only). Each metric family is
declared as it first appears (``define_metric("<metric>/*", step_metric="tmetrics/step",
summary="last,max")``), so its panels plot against the step and its runs compare by the last
and the largest value. W&B's own ``_step`` only counts ``log`` calls, so a late or repeated
step (a hub retry, a resumed run) is stored, never dropped as it would be with ``log(step=...)``.

Values:

- scalar: the number (NaN and infinities as such);
- histogram: a ``wandb.Histogram`` from the bin edges and counts; exact zeros are added to the
  bin holding 0, or to an extra bin ``[0, first edge)``; NaN and infinities, which
  ``wandb.Histogram`` refuses, are counted in the scalar ``<key>/nonfinite``
  (``<key>/<stat>-nonfinite`` with a stat) whenever there are any;
- vector: a ``wandb.Histogram`` of its finite elements, plus the same ``nonfinite`` scalar, and
  its elements as scalars (element ``i`` is expert ``i``, see
  :class:`~tmetrics_core.sinks.render.StepRenderer`);
- per-(layer, expert) scalars (``layer-router-expert-bias``, tokens per expert): one
  ``wandb.Image`` per metric and step, layers x experts (``<metric>/layer_x_expert``, the value
  range in its caption), instead of a line per expert unless ``expert_scalars`` is true.

Every ``heatmap_every`` steps, each per-layer scalar series (layer label, no expert or tensor)
is also logged as an image ``<metric>/heatmap`` (``<metric>/<stat>-heatmap``): layers x steps.

Alerts: each opening is a W&B alert (``run.alert``, level ERROR for non-finite values, WARN
otherwise; in offline mode it is stored in the run file and sent by ``wandb sync``), and every
step that raises alerts logs the table ``tmetrics/alerts`` of all alert events so far (columns
:data:`~tmetrics_core.alerts.alert.COLUMNS`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal, Sequence, cast

from tmetrics_core.alerts.alert import COLUMNS, Alert
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import WANDB_RULES, KeyRules
from tmetrics_core.sinks.render import StepRenderer
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo, RunStatus
from tmetrics_wandb.api_key import api_key_configured
from tmetrics_wandb.heatmap import LayerHeatmap
from tmetrics_wandb.histograms import bins_with_zeros, vector_histogram

__all__ = ["ALERTS_KEY", "JOINED_PREFIX", "STEP_KEY", "WandbSink"]

_log = logging.getLogger("tmetrics.wandb")

STEP_KEY = "tmetrics/step"
"""The logged step field, the x axis of every tmetrics chart in W&B."""

ALERTS_KEY = "tmetrics/alerts"
"""The key of the alerts table."""

JOINED_PREFIX = "tmetrics/"
"""Put before every key in a run the sink shares with its owner."""

_OPTIONS = ("project", "entity", "mode", "dir", "name", "tags", "heatmap_every", "heatmap_metrics", "reuse_run",
            "expert_scalars")
_MODES = ("online", "offline", "disabled")
_Mode = Literal["online", "offline", "disabled"]
_MAX_WAITING = 100
# Directories W&B would otherwise create under HOME; set (unless already set) below `dir`.
_HOME_DIRS = {
    "WANDB_CACHE_DIR": "cache",
    "WANDB_CONFIG_DIR": "config",
    "WANDB_DATA_DIR": "data",
    "WANDB_ARTIFACT_DIR": "artifacts",
}


def _option_error(option: str, message: str) -> ConfigError:
    return ConfigError(message, path=f"sinks.wandb.{option}")


def _optional_str(option: str, value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise _option_error(option, f"got {value!r}; need a non-empty string")
    return value


class WandbSink:
    """Writes records to a Weights & Biases run.

    Keyword args:
        project (str, optional): the W&B project; default ``"tmetrics"``.
        entity (str, optional): the W&B team or user; default W&B's default entity.
        mode (str, optional): ``"online"``, ``"offline"`` or ``"disabled"``; default ``"offline"``
            when no API key is configured (``WANDB_API_KEY`` or a ``netrc`` entry for the W&B
            host), with a warning on the ``tmetrics.wandb`` logger that says so and how to
            sync later; ``"online"`` otherwise.
        dir (str, optional): where W&B writes (``<dir>/wandb/...``) and keeps its cache, config
            and data directories unless ``WANDB_*_DIR`` are set; default ``<run.dir>``.
        name (str, optional): the run's display name; default the tmetrics run name.
        tags (list of str, optional): W&B tags; ``key=value`` tags for the run's topology and
            model (``RunInfo.tags``) are added.
        heatmap_every (int, optional): log the layer x step heatmaps every this many steps
            (default 100); 0 turns them off.
        heatmap_metrics (list of str, optional): the per-layer metrics drawn as heatmaps;
            default every per-layer scalar metric.
        reuse_run (bool, optional): log into the process's active run (``wandb.run``, e.g. the
            one the Hugging Face Trainer's ``report_to="wandb"`` started) instead of starting
            one; ``project``, ``entity``, ``mode``, ``dir``, ``name`` and ``tags`` are then
            unused, keys go under ``tmetrics/`` and only they get ``tmetrics/step`` as their x
            axis, the config goes under ``tmetrics`` in the run config, and ``close`` leaves the
            run to its owner. Default: when the process has a run as the sink is built; true:
            it must have one by ``open``; false: a run of tmetrics' own.
        expert_scalars (bool, optional): also log every per-(layer, expert) value as its own
            scalar; default when layers x experts is at most 256 (always one layer x expert
            image per metric and step).

    Raises:
        ConfigError: an unknown option or an invalid value (path ``sinks.wandb.<option>``).
    """

    name = "wandb"
    key_rules: KeyRules = WANDB_RULES
    requires = ("wandb", "matplotlib")

    def __init__(
        self,
        *,
        project: str = "tmetrics",
        entity: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        heatmap_every: int = 100,
        heatmap_metrics: Sequence[str] | None = None,
        reuse_run: bool | None = None,
        expert_scalars: bool | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            bad = sorted(unknown)[0]
            raise _option_error(bad, f"unknown option {bad!r}; valid options are {', '.join(_OPTIONS)}")
        self.project = _optional_str("project", project)
        self.entity = _optional_str("entity", entity)
        if mode is not None and mode not in _MODES:
            raise _option_error("mode", f"got {mode!r}; valid modes are {', '.join(_MODES)} (or leave it unset)")
        self.mode = cast("_Mode | None", mode)  # one of _MODES, checked above
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            raise _option_error("dir", f"got {dir!r}; need a directory path (a string)")
        self.dir = None if dir is None else Path(dir)
        self.run_name = _optional_str("name", name)
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
            raise _option_error("tags", f"got {tags!r}; need a list of non-empty strings")
        self.tags = tuple(tags)
        if isinstance(heatmap_every, bool) or not isinstance(heatmap_every, int) or heatmap_every < 0:
            raise _option_error("heatmap_every", f"got {heatmap_every!r}; need a whole number of steps >= 0 (0: off)")
        self.heatmap_every = heatmap_every
        if heatmap_metrics is not None and (
            isinstance(heatmap_metrics, str) or not all(isinstance(m, str) for m in heatmap_metrics)
        ):
            raise _option_error("heatmap_metrics", f"got {heatmap_metrics!r}; need a list of metric names")
        self.heatmap_metrics = None if heatmap_metrics is None else frozenset(heatmap_metrics)
        for option, flag in (("reuse_run", reuse_run), ("expert_scalars", expert_scalars)):
            if flag is not None and not isinstance(flag, bool):
                raise _option_error(option, f"got {flag!r}; need true or false (or leave it unset)")
        if reuse_run is None:  # decided on the thread that builds the sink, before any worker starts
            wandb = sys.modules.get("wandb")
            reuse_run = wandb is not None and getattr(wandb, "run", None) is not None
        self.reuse_run = reuse_run
        self.prefix = JOINED_PREFIX if reuse_run else ""
        self._renderer = StepRenderer(WANDB_RULES, distributions=True, heatmaps=True, expert_scalars=expert_scalars,
                                      prefix=self.prefix)
        self._declared: set[str] = set()
        self._open_row: tuple[int, int] = (-1, -1)  # (W&B's step, tmetrics' step) of the last shared-run log
        self._waiting: list[dict[str, Any]] = []  # shared run: steps waiting for an open row of their own
        self._run: Any = None
        self._alert_rows: list[list[Any]] = []
        self._set_env: list[str] = []
        self._heatmaps: dict[tuple[str, str | None], LayerHeatmap] = {}
        self._next_heatmap = heatmap_every
        self._last_step = 0

    def open(self, run: RunInfo) -> None:
        """Start the W&B run, or with ``reuse_run`` take the process's (``wandb.run``). A retry
        after a failed ``open`` reuses the run already started.

        Raises:
            ImportError: ``wandb`` is missing (``pip install tmetrics[wandb]``).
            wandb.errors.UsageError: ``mode="online"`` without a usable API key.
            RuntimeError: ``reuse_run`` and the process has no run.
        """
        import wandb

        if self._run is not None:
            self._declare_step()
            return
        self._renderer.open(run)
        if self.reuse_run:
            if wandb.run is None:
                raise RuntimeError("reuse_run: no active W&B run in this process (wandb.run is None); start it "
                                   "before tmetrics opens its sinks, or drop reuse_run for a run of tmetrics' own")
            self._run = wandb.run
            self._declare_step()
            return
        base = self.dir if self.dir is not None else Path(run.dir)
        base.mkdir(parents=True, exist_ok=True)
        for variable, sub in _HOME_DIRS.items():
            if variable not in os.environ:  # the user's own settings win; ours are undone at close
                os.environ[variable] = str(base / "wandb-home" / sub)
                self._set_env.append(variable)
        mode = self.mode or ("online" if api_key_configured() else "offline")
        if self.mode is None and mode == "offline":
            _log.warning(
                "W&B: no API key found (WANDB_API_KEY or a netrc entry for the W&B host), so this run is "
                "logged offline under %s; upload it later with `wandb sync %s`, or run `wandb login` "
                "(or set mode: offline to silence this)",
                base / "wandb",
                base / "wandb" / "offline-run-*",
            )
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name or run.name,
            dir=str(base),
            mode=mode,
            tags=[*self.tags, *(f"{k}={v}"[:64] for k, v in run.tags.items())],
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self._declare_step()

    def _declare_step(self) -> None:
        self._run.define_metric(STEP_KEY)
        if not self.reuse_run:
            self._run.define_metric("*", step_metric=STEP_KEY)
        for metric in sorted(self._declared):  # again after a retried open
            self._declare(metric)

    def _declare(self, metric: str) -> None:
        """A metric family's keys plot against ``tmetrics/step`` and summarize by their last and
        largest values (in a shared run only tmetrics' keys, never the owner's)."""
        head = self.prefix + WANDB_RULES.segment(metric)
        self._run.define_metric(head, step_metric=STEP_KEY, summary="last,max")
        self._run.define_metric(f"{head}/*", step_metric=STEP_KEY, summary="last,max")

    def log_config(self, config: dict[str, Any]) -> None:
        """Store ``config`` as the W&B run config (under ``tmetrics`` in a reused run; values may
        change on a later call)."""
        self._require_open().config.update({"tmetrics": config} if self.reuse_run else config, allow_val_change=True)

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Log every record of one step with exactly one ``run.log`` call.

        Raises:
            ConfigError: two label sets render to one key (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
            RuntimeError: the sink is not open.
        """
        import wandb

        run = self._require_open()
        for metric in {r.metric for r in records} - self._declared:
            self._declare(metric)
            self._declared.add(metric)
        rendered = self._renderer.render(records)
        data: dict[str, Any] = {STEP_KEY: step}
        data.update(rendered.scalars)
        for key, value in rendered.distributions:
            # wandb annotates np_histogram as two ndarrays; it takes lists as well (it calls
            # .tolist() only where there is one), and lists keep the counts exact ints.
            data[key] = (wandb.Histogram(np_histogram=bins_with_zeros(value))  # type: ignore[arg-type]
                         if isinstance(value, Histogram) else vector_histogram(wandb, value))
        for key, heatmap in rendered.heatmaps:
            data[key] = wandb.Image(heatmap.image(), caption=heatmap.caption())
        for record in records:
            if self._draws_heatmap(record):
                self._heatmap(record.metric, record.labels.stat).add(step, record.labels.layer, record.value)  # type: ignore[arg-type]
        if self.heatmap_every and step >= self._next_heatmap:
            data.update(self._heatmap_images(wandb))
            self._next_heatmap = step + self.heatmap_every
        self._log(run, data)
        self._last_step = max(self._last_step, step)

    def _log(self, run: Any, data: dict[str, Any]) -> None:
        """One ``log`` call, or in a shared run one step's data queued for the owner's open row
        (see :meth:`_drain`)."""
        if not self.reuse_run:
            run.log(data)
            return
        if self._waiting and self._waiting[-1][STEP_KEY] == data[STEP_KEY]:
            self._waiting[-1].update(data)
        else:
            self._waiting.append(data)
        self._drain(run, final=len(self._waiting) > _MAX_WAITING)

    def _drain(self, run: Any, *, final: bool) -> None:
        """Log the queued steps into the owner's open rows (``commit=False``), one step per row:
        W&B's step moves with the owner's ``log`` calls only, so an owner's ``log(step=s)`` is
        not refused as too small. A step waits while tmetrics' previous step still sits in the
        open row (the owner logs less often than tmetrics); with ``final`` (``close``, or more
        than ``_MAX_WAITING`` steps waiting) tmetrics commits those rows itself, moving W&B's
        step by one per row."""
        while self._waiting:
            step = self._waiting[0][STEP_KEY]
            if run.step == self._open_row[0] and step != self._open_row[1]:
                if not final:
                    return
                run.log({}, commit=True)
            run.log(self._waiting.pop(0), commit=False)
            self._open_row = (run.step, step)

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Send a W&B alert per opening and log the alerts table (see the module docstring).

        Raises:
            RuntimeError: the sink is not open.
        """
        import wandb

        run = self._require_open()
        for alert in alerts:
            if alert.state == "open":
                run.alert(title=f"tmetrics: {alert.rule} {alert.where()}"[:63], text=alert.describe(),
                          level="ERROR" if alert.kind == "nonfinite" else "WARN", wait_duration=1)
        self._alert_rows.extend([_cell(v) for v in a.row()] for a in alerts)
        # mixed types: a NaN value is the text "nan" in a column of numbers, a missing label None
        table = wandb.Table(columns=list(COLUMNS), data=self._alert_rows, allow_mixed_types=True)
        self._log(run, {STEP_KEY: step, ALERTS_KEY: table})

    def flush(self) -> None:
        """Nothing to do: each ``log`` call is handed to W&B's service process at once, which
        persists it on its own. Raises RuntimeError when the sink is not open."""
        self._require_open()

    def close(self, status: RunStatus) -> None:
        """Log the heatmaps once more if they changed, then ``finish`` the run with exit code
        0 for ``"finished"`` and 1 otherwise (W&B shows 1 as *failed*); a reused run is left open."""
        if self._run is None:
            return
        import wandb

        images = self._heatmap_images(wandb) if self.heatmap_every else {}
        if images:
            self._log(self._run, {STEP_KEY: self._last_step, **images})
        self._drain(self._run, final=True)
        if not self.reuse_run:
            self._run.finish(exit_code=0 if status == "finished" else 1)
        self._run = None
        for variable in self._set_env:
            os.environ.pop(variable, None)
        self._set_env.clear()

    def _require_open(self) -> Any:
        if self._run is None:
            raise RuntimeError("WandbSink is not open: call open(run) first (or it was closed)")
        return self._run

    def _draws_heatmap(self, record: MetricRecord) -> bool:
        labels = record.labels
        if not self.heatmap_every or record.kind != "scalar" or labels.layer is None or labels.expert is not None \
                or labels.tensor is not None:
            return False
        return self.heatmap_metrics is None or record.metric in self.heatmap_metrics

    def _heatmap(self, metric: str, stat: str | None) -> LayerHeatmap:
        heatmap = self._heatmaps.get((metric, stat))
        if heatmap is None:
            heatmap = LayerHeatmap(metric if stat is None else f"{metric} {stat}")
            self._heatmaps[(metric, stat)] = heatmap
        return heatmap

    def _heatmap_images(self, wandb: Any) -> dict[str, Any]:
        images: dict[str, Any] = {}
        for (metric, stat), heatmap in self._heatmaps.items():
            if heatmap.changed:
                key = self._renderer.book.add(metric, Labels(stat=stat).substat("heatmap"))
                images[key] = wandb.Image(heatmap.image(), caption=f"{heatmap.title}: layer x step")
        return images


def _cell(value: Any) -> Any:
    """A table cell W&B accepts: None for a missing value, text for a non-finite number."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
