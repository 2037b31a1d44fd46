"""``MlflowSink``: records as MLflow metrics of one run, with the config as params.

Every call uses ``MlflowClient`` with the run id this sink created: the sink runs on the hub's
worker thread, and MLflow's fluent "active run" is per thread. Metrics go in ``log_batch``
chunks of at most ``batch_size`` (MLflow accepts 1,000 per call), synchronously.

Keys are those of :mod:`tmetrics_core.sinks.keys` under :data:`~tmetrics_core.sinks.keys.MLFLOW_RULES`.
What each record becomes is decided by :class:`~tmetrics_core.sinks.render.StepRenderer`
(without distributions, with heatmaps):

- scalar: one metric (NaN is stored; MLflow stores +-Inf as +-1.797e308);
- vector: one metric per element, the element index as the expert
  (``layer-expert-tokens/layer_03/expert_017``);
- histogram: three summary metrics ``<key>/total``, ``<key>/zeros`` and ``<key>/nonfinite``
  (``<key>/<stat>-total`` ... with a stat), never the bins;
- per-(layer, expert) values (``layer-router-expert-bias``, tokens per expert): one image per
  metric and step, layers x experts, with ``log_image(key=<metric>/layer_x_expert, step=...)``
  (artifacts ``images/<metric>~layer_x_expert+step+...png``), instead of one metric per expert
  unless ``expert_scalars`` is true.

The run gets the run's topology and model as tags (``RunInfo.tags``), the config as params
(see :mod:`tmetrics_mlflow.params`) and as ``tmetrics/config.json``, the manifest as
``tmetrics/manifest.json``; ``close`` ends it FINISHED, FAILED or KILLED.

One run by default: when the process has an active MLflow run as the sink is built (the user's
``mlflow.start_run()``, the Trainer's ``MLflowCallback``, accelerate's MLflow tracker), or
``run_id`` names one, the sink writes into that run instead of starting its own: every key
under ``tmetrics/`` (``tmetrics/layer-grad-l2/layer_03``), the config as params under
``tmetrics.``, no tags, and ``close`` leaves the run's status to its owner.

Alerts: the tags ``tmetrics.alerts`` (alerts opened so far), ``tmetrics.alert.first`` (the run's
first alert, as :meth:`~tmetrics_core.alerts.alert.Alert.describe` writes it) and
``tmetrics.alert.last``, and the artifact ``tmetrics/alerts.json`` (every alert event of the run,
:meth:`~tmetrics_core.alerts.alert.Alert.to_json` objects), rewritten whenever alerts arrive and at
close.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError, SinkError
from tmetrics_core.sinks.keys import MLFLOW_RULES, KeyRules
from tmetrics_core.sinks.render import StepRenderer
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus
from tmetrics_core.config.redact import redact
from tmetrics_mlflow.params import flatten_params

__all__ = ["JOINED_PREFIX", "MlflowSink", "check_tracking_uri"]

_log = logging.getLogger("tmetrics.mlflow")

JOINED_PREFIX = "tmetrics/"
"""Put before every key in a run the sink shares with its owner."""

_OPTIONS = ("tracking_uri", "experiment", "run_name", "batch_size", "run_id", "reuse_run", "expert_scalars")
_MAX_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_TAG_VALUE_LIMIT = 5000
_DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")
_ACCEPTED = (
    "sqlite:///PATH/mlflow.db (a local file; sqlite:////abs/path also works)",
    "http://HOST:PORT or https://HOST (a tracking server)",
    "postgresql://..., mysql://..., mssql://... (a database, with an optional +driver)",
    "databricks or databricks://PROFILE",
)
_DRIVER_HINTS = {"postgresql": "pip install psycopg2-binary, with postgresql+psycopg2://",
                 "mysql": "pip install pymysql, with mysql+pymysql://", "mssql": "pip install pyodbc"}
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def check_tracking_uri(uri: Any, *, path: str = "sinks.mlflow.tracking_uri") -> str:
    """``uri`` if it is a tracking URI tmetrics accepts; checks the form only, connects nowhere.

    Raises:
        ConfigError: anything else, with the accepted forms. A plain path or ``file:`` URI is
            refused (MLflow's file store is deprecated and off by default): use ``sqlite:///``.
    """
    accepted = "; accepted forms: " + "; ".join(_ACCEPTED)
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"got {uri!r}; need a tracking URI string{accepted}", path=path)
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or len(uri) <= len("sqlite:///"):
            raise ConfigError(f"got {uri!r}; a SQLite URI needs a file path after three slashes{accepted}", path=path)
        return uri
    if scheme in ("http", "https"):
        if not parsed.hostname:
            raise ConfigError(f"got {uri!r}; an HTTP tracking URI needs a host{accepted}", path=path)
        return uri
    if scheme in _DATABASE_SCHEMES or scheme == "databricks" or uri == "databricks":
        return uri
    hint = " (a path or file: URI is MLflow's deprecated file store; use sqlite:///PATH/mlflow.db)" if scheme in ("", "file") else ""
    raise ConfigError(f"got {uri!r}{hint}{accepted}", path=path)


def _check_database_driver(uri: str, *, path: str = "sinks.mlflow.tracking_uri") -> None:
    """For a database URI (``postgresql://``, ``mysql+pymysql://``, ...), that SQLAlchemy and
    the URI's database driver import, at configuration time: MLflow finds a missing driver only
    when the sink opens, after training started.

    Raises:
        ConfigError: the driver (or SQLAlchemy) is not installed, with what to install.
    """
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme not in _DATABASE_SCHEMES:
        return
    try:
        from sqlalchemy.engine import make_url

        dialect = make_url(uri).get_dialect()
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigError(f"got {uri!r}, but its database driver cannot be imported ({exc}); install it (e.g. "
                          f"{_DRIVER_HINTS[scheme]}) or name one in the URI ({scheme}+DRIVER://...)", path=path) from exc


class MlflowSink:
    """Writes records to one MLflow run.

    Keyword args:
        tracking_uri (str, optional): where runs live; default ``sqlite:///<run.dir>/mlflow.db``
            (artifacts then go to ``<run.dir>/mlartifacts``). See :func:`check_tracking_uri`.
        experiment (str, optional): the experiment, created if missing; default the run name.
        run_name (str, optional): the MLflow run name; default the tmetrics run name.
        batch_size (int, optional): metrics per ``log_batch`` call, 1 to 1000 (default 1000).
        run_id (str, optional): log into this existing run (e.g. the one the Hugging Face
            Trainer's ``report_to="mlflow"`` started, or a Lightning ``MLFlowLogger``'s) instead
            of creating one; ``experiment`` and ``run_name`` are then unused, no tags are set,
            keys go under ``tmetrics/``, and ``close`` leaves the run's status to its owner.
        reuse_run (bool, optional): whether to write into the process's active MLflow run
            (``mlflow.active_run()`` on the thread that builds the sink) as ``run_id`` would.
            Default: when there is one and ``tracking_uri`` is unset or the same as
            ``mlflow.get_tracking_uri()``; true: there must be one; false: a run of tmetrics' own.
        expert_scalars (bool, optional): also log every per-(layer, expert) value as its own
            metric; default when layers x experts is at most 256 (always one layer x expert
            image per metric and step).

    Raises:
        ConfigError: an unknown option or an invalid value (path ``sinks.mlflow.<option>``);
            ``reuse_run: true`` with no active run.
    """

    name = "mlflow"
    key_rules: KeyRules = MLFLOW_RULES
    requires = ("mlflow", "matplotlib")

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        batch_size: int = _MAX_BATCH,
        run_id: str | None = None,
        reuse_run: bool | None = None,
        expert_scalars: bool | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            bad = sorted(unknown)[0]
            raise ConfigError(
                f"unknown option {bad!r}; valid options are {', '.join(_OPTIONS)}", path=f"sinks.{self.name}.{bad}"
            )
        self.tracking_uri = None if tracking_uri is None else check_tracking_uri(tracking_uri)
        if self.tracking_uri is not None:
            _check_database_driver(self.tracking_uri)
        for option, value in (("experiment", experiment), ("run_name", run_name)):
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ConfigError(f"got {value!r}; need a non-empty string", path=f"sinks.{self.name}.{option}")
        self.experiment = experiment
        self.run_name = run_name
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= _MAX_BATCH:
            raise ConfigError(
                f"got {batch_size!r}; need a whole number from 1 to {_MAX_BATCH} (MLflow's log_batch limit)",
                path=f"sinks.{self.name}.batch_size",
            )
        self.batch_size = batch_size
        if run_id is not None and not (isinstance(run_id, str) and run_id.strip()):
            raise ConfigError(f"got {run_id!r}; need the id of an existing MLflow run", path=f"sinks.{self.name}.run_id")
        for option, flag in (("reuse_run", reuse_run), ("expert_scalars", expert_scalars)):
            if flag is not None and not isinstance(flag, bool):
                raise ConfigError(f"got {flag!r}; need true or false (or leave it unset)", path=f"sinks.{self.name}.{option}")
        if run_id is None and reuse_run is not False:
            run_id = self._active_run_id(required=reuse_run is True)
        self._client: Any = None
        self.run_id: str | None = run_id
        self._owns_run = run_id is None
        self._renderer = StepRenderer(MLFLOW_RULES, distributions=False, heatmaps=True, expert_scalars=expert_scalars,
                                      prefix="" if self._owns_run else JOINED_PREFIX)
        self._alerts: list[dict[str, Any]] = []
        self._opened = 0

    def _active_run_id(self, *, required: bool) -> str | None:
        """The id of this thread's active MLflow run, when the sink should join it (setting
        ``tracking_uri`` to the run's store); None when there is none or it lives in another store.
        MLflow not imported means no run was started: it is not imported here."""
        mlflow: Any = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None else None
        if active is None:
            if required:
                raise ConfigError("reuse_run: true, but no MLflow run is active on this thread; call "
                                  "mlflow.start_run() before building tmetrics, or drop reuse_run",
                                  path=f"sinks.{self.name}.reuse_run")
            return None
        current = mlflow.get_tracking_uri()
        if self.tracking_uri is not None and self.tracking_uri != current:
            if required:
                raise ConfigError(f"reuse_run: true, but the active MLflow run lives in {current!r}, not in "
                                  f"tracking_uri {self.tracking_uri!r}; drop one of the two",
                                  path=f"sinks.{self.name}.reuse_run")
            _log.info("MLflow: the active run %s lives in %s, not in the configured %s: tmetrics logs a run of its own",
                      active.info.run_id, current, self.tracking_uri)
            return None
        self.tracking_uri = current
        return str(active.info.run_id)
    def probe(self, timeout: float) -> None:
        """One request to an HTTP tracking server's ``/health``, at most ``timeout`` seconds and
        no retries (MLflow's own client retries a refused connection for about 4 minutes before
        its first error). Any HTTP answer means the server is reachable. A local or database
        store is not probed here: ``open`` fails at once when it cannot be opened.

        Raises:
            SinkError: the server cannot be reached, with the URI and the cause.
        """
        uri = self.tracking_uri
        if uri is None or urlparse(uri).scheme not in ("http", "https"):
            return
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
                pass
        except urllib.error.HTTPError:
            return
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise SinkError(f"the MLflow tracking server {uri} cannot be reached within {timeout:g} s ({reason}); "
                            "check that it runs (mlflow server) and the URI") from error

    def open(self, run: RunInfo) -> None:
        """Create (or reuse) the experiment, create the run with its tags and log the manifest.

        Retrying after a failure reuses the run already created.

        Raises:
            ImportError: ``mlflow`` is missing (``pip install tmetrics[mlflow]``).
            ConfigError: the experiment exists but is deleted.
            mlflow.exceptions.MlflowException: the store is unreachable or refuses the call.
        """
        from mlflow import MlflowClient

        # Creating a sqlite store logs schema migrations at INFO on every fresh run: noise here.
        for noisy in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        uri = self.tracking_uri
        artifact_root: str | None = None
        if uri is None:
            run_dir = Path(run.dir).resolve()
            run_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{run_dir / 'mlflow.db'}"
            artifact_root = (run_dir / "mlartifacts").as_uri()
        elif uri.startswith("sqlite:///"):
            database = Path(uri[len("sqlite:///") :])
            database.parent.mkdir(parents=True, exist_ok=True)
            artifact_root = (database.resolve().parent / "mlartifacts").as_uri()
        self._renderer.open(run)
        self._client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:
            experiment_id = self._experiment_id(self.experiment or run.name, artifact_root)
            tags = {MLFLOW_RULES.clean(k)[:250]: str(v)[:_TAG_VALUE_LIMIT] for k, v in run.tags.items()}
            created = self._client.create_run(experiment_id, run_name=self.run_name or run.name, tags=tags)
            self.run_id = created.info.run_id
        manifest = json.dumps(list(run.manifest), indent=1, default=str)
        self._client.log_text(self.run_id, manifest, "tmetrics/manifest.json")

    def log_config(self, config: dict[str, Any]) -> None:
        """Log ``config`` as params (flattened, redacted, truncated; 100 per call) and, whole,
        as the artifact ``tmetrics/config.json``. Logging the same values again is allowed."""
        from mlflow.entities import Param

        client, run_id = self._require_open()
        shared = config if self._owns_run else {"tmetrics": config}
        params = [Param(key, value) for key, value in flatten_params(shared).items()]
        for start in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[start : start + _MAX_PARAMS_PER_BATCH], synchronous=True)
        client.log_text(run_id, json.dumps(redact(config), indent=2, default=str), "tmetrics/config.json")

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Log every record of one step in ``log_batch`` chunks of ``batch_size``, then its
        heatmaps as images.

        A chunk that fails raises; earlier chunks of the call stay logged (MLflow has no
        transaction across calls), so a retried step may hold a value twice, identically.

        Raises:
            ConfigError: two label sets render to one key (see :class:`~tmetrics_core.sinks.keys.KeyBook`).
            RuntimeError: the sink is not open.
            mlflow.exceptions.MlflowException: the store refused a chunk.
        """
        from mlflow.entities import Metric

        client, run_id = self._require_open()
        timestamp = int(time.time() * 1000)
        rendered = self._renderer.render(records)
        metrics = [Metric(key, value, timestamp, step) for key, value in rendered.scalars]
        for start in range(0, len(metrics), self.batch_size):
            client.log_batch(run_id, metrics=metrics[start : start + self.batch_size], synchronous=True)
        for key, heatmap in rendered.heatmaps:
            client.log_image(run_id, heatmap.image(), key=key, step=step, timestamp=timestamp, synchronous=True)

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Set the alert tags and rewrite ``tmetrics/alerts.json`` with every alert so far.

        Raises:
            RuntimeError: the sink is not open.
            mlflow.exceptions.MlflowException: the store refused a call.
        """
        client, run_id = self._require_open()
        opened = [a for a in alerts if a.state == "open"]
        if opened:
            if not self._opened:
                client.set_tag(run_id, "tmetrics.alert.first", opened[0].describe()[:_TAG_VALUE_LIMIT])
            self._opened += len(opened)
            client.set_tag(run_id, "tmetrics.alerts", str(self._opened))
            client.set_tag(run_id, "tmetrics.alert.last", opened[0].describe()[:_TAG_VALUE_LIMIT])
        self._alerts.extend(a.to_json() for a in alerts)
        client.log_text(run_id, json.dumps(self._alerts, indent=1), "tmetrics/alerts.json")

    def flush(self) -> None:
        """Nothing is buffered: every ``log_batch`` call is synchronous. Raises RuntimeError when
        the sink is not open."""
        self._require_open()

    def close(self, status: RunStatus) -> None:
        """End the run: ``set_terminated`` with FINISHED, FAILED or KILLED; a run given by
        ``run_id`` is left to its owner."""
        if self._client is None or self.run_id is None:
            return
        if self._alerts:
            self._client.log_text(self.run_id, json.dumps(self._alerts, indent=1), "tmetrics/alerts.json")
        if self._owns_run:
            self._client.set_terminated(self.run_id, _STATUS[status])
        self._client = None

    def _require_open(self) -> tuple[Any, str]:
        if self._client is None or self.run_id is None:
            raise RuntimeError("MlflowSink is not open: call open(run) first (or it was closed)")
        return self._client, self.run_id

    def _experiment_id(self, name: str, artifact_root: str | None) -> str:
        from mlflow.exceptions import MlflowException

        client = self._client
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return client.create_experiment(name, artifact_location=artifact_root)
            except MlflowException:
                experiment = client.get_experiment_by_name(name)  # created meanwhile by another process
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            raise ConfigError(
                f"the MLflow experiment {name!r} exists but is deleted; restore it "
                f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) or choose another name",
                path=f"sinks.{self.name}.experiment",
            )
        return experiment.experiment_id
