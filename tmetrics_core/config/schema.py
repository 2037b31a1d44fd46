"""The tmetrics configuration: frozen dataclasses built from YAML, TOML, JSON or a dict.

Shape (the README's Config section); every section and key is optional::

    run: {name: demo, dir: runs/demo}                 # dir defaults to runs/<name>
    metrics:
      - layer-param-l2:100                            # NAME[:INTERVAL], interval 1 when omitted
      - {name: layer-grad-l2, interval: 10, select: "layers.*.mlp.*"}
    sinks:                                            # sink name -> its options (checked by the sink)
      tensorboard: {}
      mlflow: {tracking_uri: "sqlite:///runs/mlflow.db", experiment: demo}
    placements:                                       # glob on canonical name -> {axis: placement}
      "layers.*.attn.q.weight": {tp: "Shard(0)"}
    distributed: {collective_timeout_s: 60, check_plan: first, verify_replicas: first, log_rank: 0}
    alerts: default                                   # or a list of rules: tmetrics_core.config.alerts

Per-(layer, expert) values (a record labelled with both a layer and an expert, or tokens per
expert of a layer) reach the image-capable trackers (``tensorboard``, ``wandb``, ``mlflow``) as one
layer x expert heatmap per metric and step, not one series per expert; the sink option
``expert_scalars: true`` (e.g. ``sinks: {mlflow: {expert_scalars: true}}``) logs the scalars as
well. ``jsonl`` always keeps every value.

``metrics`` may also be one string in the Megatron-LM ``--tensor-metrics`` form,
``"global-param-l2:10 layer-grad-l2:100"`` (space or comma separated), and ``sinks`` a list of
names (``[tensorboard, jsonl]``, default options each).

Every check runs when a dataclass is built, so a config is valid or does not exist. Errors are
:class:`~tmetrics_core.errors.ConfigError` with ``path`` naming the entry
(``metrics[2].interval``) and a message giving the bad value, the valid set and the fix. Names
that need the metric catalogue or the installed sinks are checked by :func:`check_names`.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

from tmetrics_core.config.alerts import AlertsConfig, parse_alerts
from tmetrics_core.config.files import SUFFIXES, read_config_file
from tmetrics_core.config.globs import expand_braces
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.placements import parse_placement

__all__ = [
    "CheckPlan",
    "Config",
    "VerifyReplicas",
    "DistributedConfig",
    "MetricConfig",
    "READ_RESULTS",
    "ReadResults",
    "RunConfig",
    "check_names",
    "config_problems",
    "load_config",
    "override_sinks",
    "parse_metric_spec",
]

CheckPlan = Literal["first", "always", "never"]
"""When ranks compare their collective plans: on the first pass only, on every pass, or never."""

_CHECK_PLANS: tuple[str, ...] = ("first", "always", "never")

VerifyReplicas = Literal["startup", "first", "always", "never"]
"""When Replica claims are checked against the values (``tmetrics_core.distributed.replicas``)."""

_VERIFY_REPLICAS: tuple[str, ...] = ("startup", "first", "always", "never")

ReadResults = Literal["now", "next-step"]
"""When a due step's results are read from the device: at its end, or at the next step's end."""

READ_RESULTS: tuple[str, ...] = ("now", "next-step")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_SPEC_SEPARATORS = re.compile(r"[\s,]+")
_SPEC_INTERVAL = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Where and under which name the run's files and tracker runs go, and when results are read."""

    name: str = "tmetrics"
    """Run name shown in every tracker; also the default directory name, so no path separators."""
    dir: str = ""
    """Directory for run files (TensorBoard events, spool, manifest); empty means ``runs/<name>``,
    relative to the working directory."""
    read_results: ReadResults = "now"
    """When a due step's results leave the device: ``now`` (at the step's end: the step waits
    once for its accelerator) or ``next-step`` (at the end of the next step scope, or at
    ``close()``: no step waits; records arrive one step later, with their own step)."""
    close_timeout_s: float = 30.0
    """Seconds ``close()`` may wait for the sinks: half drains their queues (what is left is
    spooled, for ``tmetrics replay``), the rest ends each tracker run; a sink still busy after it
    is left open and reported."""
    interrupt_timeout_s: float = 2.0
    """The same bound when Ctrl-C (``KeyboardInterrupt``) ends the run, so an interrupted job
    exits in seconds. SIGTERM, whose sender usually grants a grace period, gets
    ``close_timeout_s``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"got {_describe(self.name)}; need a non-empty string (the run name)", path="name")
        if any(sep in self.name for sep in "/\\") or self.name in (".", ".."):
            raise ConfigError(
                f"got {self.name!r}; a run name cannot contain '/' or '\\' or be '.' or '..'; "
                f"set the directory with run.dir instead",
                path="name",
            )
        if isinstance(self.dir, os.PathLike):
            object.__setattr__(self, "dir", os.fspath(self.dir))
        if not isinstance(self.dir, str):
            raise ConfigError(f"got {_describe(self.dir)}; need a directory path string", path="dir")
        if not self.dir:
            object.__setattr__(self, "dir", f"runs/{self.name}")
        if self.read_results not in READ_RESULTS:
            raise ConfigError(f"got {_describe(self.read_results)}{_suggest(self.read_results, READ_RESULTS)}; need one "
                              f"of {', '.join(READ_RESULTS)}", path="read_results")
        for key in ("close_timeout_s", "interrupt_timeout_s"):
            seconds = getattr(self, key)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
                raise ConfigError(f"got {_describe(seconds)}; need a number of seconds >= 0", path=key)
            object.__setattr__(self, key, float(seconds))


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricConfig:
    """One metric to compute: which one, how often, and on which tensors or modules."""

    name: str
    """Catalogue name (``layer-grad-l2``) or a Megatron-LM alias (``global-wgrad-l2``);
    :func:`check_names` replaces an alias by its canonical name."""
    interval: int = 1
    """Steps between two computations of the metric; 1 computes it every step."""
    select: tuple[str, ...] = ()
    """``fnmatch`` globs on canonical tensor names (``layers.*.mlp.*``); a tensor is used when any
    glob matches. Empty: every tensor the metric accepts. A single string is one glob. Braces
    list alternatives (``layers.*.{mlp,moe}.*``), expanded when the config is read."""
    modules: tuple[str, ...] = ()
    """``fnmatch`` globs on canonical module names whose outputs are observed (``layers.*.mlp``),
    for activation metrics. Empty: the metric's default modules. Braces list alternatives
    (``layers.*.{mlp,moe}``: one config for dense and MoE models)."""
    bins: int | None = None
    """Number of log-spaced bins, for histogram metrics; ``None``: the metric's default."""
    sample: int | None = None
    """Elements sampled per tensor when comparing data-parallel replicas (``dp-replica-drift``);
    ``None``: the metric's default."""
    recipe: tuple[str, ...] = ()
    """Low-precision recipes compared in one pass (``layer-*-quant``; docs/low-precision.md); a
    single string is one recipe. Empty: ``mxfp8``. Names are checked when the metric is built."""
    format: str | None = None
    """Element format of FP8 recipes (``e4m3`` or ``e5m2``) instead of the recipe's default."""
    scale_mode: str | None = None
    """MX scale rounding (``floor``, ``ceil``, ``even``, ``rceil``) for ``mxfp8``."""
    moments: tuple[str, ...] = ()
    """The optimizer moments ``layer-optimizer-state-rms`` reads: ``exp_avg`` (first moment:
    Adam's, or the momentum of SGD and Muon) and ``exp_avg_sq`` (second moment: Adam's, RMSprop's).
    Empty: both."""
    optional: bool = False
    """Skip the metric, with one INFO line, where the model has no source for it (router
    outputs on a dense model, modules or tensors its globs do not match, no blocks or head,
    an optimizer without the state it reads), instead of refusing the config."""

    def __post_init__(self) -> None:
        _check_name(self.name, path="name", what="a metric name such as 'layer-grad-l2'")
        _check_int(self.interval, path="interval", minimum=1, meaning="steps between two computations")
        object.__setattr__(self, "select", _globs(self.select, path="select", of="canonical tensor names"))
        object.__setattr__(self, "modules", _globs(self.modules, path="modules", of="canonical module names"))
        if self.bins is not None:
            _check_int(self.bins, path="bins", minimum=1, meaning="number of histogram bins")
        if self.sample is not None:
            _check_int(self.sample, path="sample", minimum=1, meaning="elements sampled per tensor")
        recipes = (self.recipe,) if isinstance(self.recipe, str) else self.recipe
        if not isinstance(recipes, (tuple, list)) or not all(isinstance(r, str) and r for r in recipes):
            raise ConfigError(f"got {_describe(self.recipe)}; need a recipe name or a list of them "
                              "(fp8-tensorwise, fp8-rowwise, fp8-block, mxfp8, nvfp4)", path="recipe")
        object.__setattr__(self, "recipe", tuple(recipes))
        moments = (self.moments,) if isinstance(self.moments, str) else self.moments
        if not isinstance(moments, (list, tuple)) or not set(moments) <= {"exp_avg", "exp_avg_sq"}:
            raise ConfigError(f"got {_describe(self.moments)}; need a list of exp_avg (first moment) and "
                              "exp_avg_sq (second moment)", path="moments")
        object.__setattr__(self, "moments", tuple(moments))
        if not isinstance(self.optional, bool):
            raise ConfigError(f"got {_describe(self.optional)}; need true or false", path="optional")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedConfig:
    """How tmetrics behaves across ranks."""

    collective_timeout_s: float = 60.0
    """Seconds any metric collective may take before it fails on every rank instead of hanging."""
    check_plan: CheckPlan = "first"
    """When ranks compare collective plans before running them: ``first`` (first pass of each
    distinct set of due metrics), ``always`` (every pass; slower) or ``never``."""
    verify_replicas: VerifyReplicas = "first"
    """When every tensor placed ``Replica`` on an axis (inferred, declared, by a framework or a
    DTensor ``Replicate``) is compared across that axis by a fingerprint (one small collective
    per axis): ``startup`` (the parameters, when TensorMetrics is built), ``first`` (start-up and
    the first due step of each gradient and optimizer-state source), ``always`` (start-up and
    every due step; catches replicas that drift later) or ``never``."""
    log_rank: int = 0
    """Global rank that writes to the sinks; the other ranks log nothing."""

    def __post_init__(self) -> None:
        timeout = self.collective_timeout_s
        is_number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if not is_number or not (math.isfinite(timeout) and timeout > 0):
            raise ConfigError(
                f"got {timeout if is_number else _describe(timeout)}; need a number of seconds > 0 "
                f"(how long one collective may take)",
                path="collective_timeout_s",
            )
        object.__setattr__(self, "collective_timeout_s", float(timeout))
        if self.check_plan not in _CHECK_PLANS:
            raise ConfigError(
                f"got {_describe(self.check_plan)}{_suggest(self.check_plan, _CHECK_PLANS)}; "
                f"need one of {', '.join(_CHECK_PLANS)}",
                path="check_plan",
            )
        if self.verify_replicas not in _VERIFY_REPLICAS:
            raise ConfigError(
                f"got {_describe(self.verify_replicas)}{_suggest(self.verify_replicas, _VERIFY_REPLICAS)}; "
                f"need one of {', '.join(_VERIFY_REPLICAS)}",
                path="verify_replicas",
            )
        _check_int(self.log_rank, path="log_rank", minimum=0, meaning="the global rank that writes to the sinks")


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole, validated tmetrics configuration. Build it with :func:`load_config`."""

    run: RunConfig = field(default_factory=RunConfig)
    """Run name and directory."""
    metrics: tuple[MetricConfig, ...] = ()
    """Metrics in the order given; see :class:`MetricConfig`."""
    sinks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Sink entry-point name -> keyword options for its constructor, in the order given (a copy
    of the input; treat as read-only). The sink checks its own options when it is built."""
    placements: dict[str, dict[str, str]] = field(default_factory=dict)
    """Placement overrides: glob on canonical tensor names -> {axis name: placement string such as
    ``"Shard(0)"``}; the first matching glob wins. Each string is checked with
    :func:`tmetrics_core.placements.parse_placement` and kept as written."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Behaviour across ranks."""
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    """Alert rules over the records (``tmetrics_core.config.alerts``); by default only non-finite
    gradient metrics alert."""

    def __post_init__(self) -> None:
        for name, kind in (("run", RunConfig), ("distributed", DistributedConfig), ("alerts", AlertsConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"got {_describe(getattr(self, name))}; need a {kind.__name__}", path=name)
        if not isinstance(self.metrics, (list, tuple)) or not all(isinstance(m, MetricConfig) for m in self.metrics):
            raise ConfigError(
                "need a sequence of MetricConfig; build entries with parse_metric_spec or use load_config",
                path="metrics",
            )
        object.__setattr__(self, "metrics", tuple(self.metrics))
        object.__setattr__(self, "sinks", _sink_table(self.sinks))
        object.__setattr__(self, "placements", _placement_table(self.placements))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, None) that :func:`load_config` reads back into
        an equal config. It may hold secrets from sink options: pass it through
        :func:`tmetrics_core.config.redact.redact` before logging it."""
        plain: dict[str, Any] = _plain(self)
        return plain


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a file or from a mapping already in memory.

    Args:
        source: a path to a ``.yaml``/``.yml``/``.toml``/``.json`` file, or a mapping of the shape
            in this module's docstring (for example a section of the user's own config).

    Raises:
        ConfigError: the file cannot be read or parsed (see
            :func:`tmetrics_core.config.files.read_config_file`); an unknown key at any level (with
            the valid keys and a close match); a value of the wrong type or out of range. An error
            in a file's entries ends with ``(in <file>)``; one about the whole document has the
            file as its ``path``.
    """
    if isinstance(source, Mapping):
        return _config_from(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"got {_describe(source)}; need a path to a {'/'.join(SUFFIXES)} file or a mapping")
    data = read_config_file(source)
    try:
        return _config_from(data)
    except ConfigError as err:
        if not err.path:  # the document as a whole: the file is the place to point at
            raise ConfigError(_message(err), path=os.fspath(source)) from None
        raise ConfigError(f"{_message(err)} (in {os.fspath(source)})", path=err.path) from None


def parse_metric_spec(spec: str | Mapping[str, Any], *, path: str) -> MetricConfig:
    """Parse one metric entry: ``"NAME"``, ``"NAME:INTERVAL"`` or a mapping of
    :class:`MetricConfig` fields (``name`` required).

    Args:
        spec: the entry.
        path: where the entry sits in the config (``"metrics[2]"``), prefixed to error paths.

    Raises:
        ConfigError: wrong type, several metrics in one string, an interval that is not a whole
            number >= 1, a missing ``name``, or an unknown key.
    """
    if isinstance(spec, str):
        values = _split_spec(spec.strip(), path=path)
    elif isinstance(spec, Mapping):
        values = _keys(spec, path=path, valid=_field_names(MetricConfig))
        if "name" not in values:
            raise ConfigError(
                "missing key 'name'; give the metric name, e.g. {name: layer-grad-l2, interval: 10}", path=path
            )
    else:
        raise ConfigError(
            f"got {_describe(spec)}; need 'NAME:INTERVAL' (e.g. 'layer-grad-l2:10') or a mapping with "
            f"keys {', '.join(_field_names(MetricConfig))}",
            path=path,
        )
    with _under(path):
        return MetricConfig(**values)


def override_sinks(config: Config, names: str | Sequence[str]) -> Config:
    """Replace the configured sinks by a comma-separated list, as ``--sink tensorboard,mlflow``
    (from Python, a list of names works too: ``sinks=["tensorboard", "mlflow"]``).

    A sink already in the config keeps its options; a new one starts with ``{}``. The order is
    the order given. Names are checked against the installed sinks by :func:`check_names`.

    Raises:
        ConfigError (path ``--sink``): an empty list, an empty or malformed name, a name twice.
    """
    if isinstance(names, str):
        listed = [part.strip() for part in names.split(",")]
    elif isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        listed = [n.strip() for n in names]
    else:
        listed = None
    if not listed or listed == [""]:
        raise ConfigError(
            f"got {_describe(names)}; need sink names, e.g. 'tensorboard,mlflow' or ['tensorboard', 'mlflow']",
            path="--sink"
        )
    chosen: dict[str, dict[str, Any]] = {}
    for name in listed:
        _check_name(name, path="--sink", what="a sink name such as 'tensorboard' (no empty entries)")
        if name in chosen:
            raise ConfigError(f"sink {name!r} is given twice in {names!r}; list each sink once", path="--sink")
        chosen[name] = config.sinks.get(name, {})
    return replace(config, sinks=chosen)


def check_names(
    config: Config,
    *,
    resolve_metric: Callable[[str], str],
    metric_names: Iterable[str],
    sink_names: Iterable[str],
) -> Config:
    """Check metric and sink names against what is installed; return the config with every
    metric alias replaced by its canonical name.

    Args:
        config: the config to check.
        resolve_metric: canonical name of a metric name or alias; raises ``KeyError`` when unknown.
        metric_names: known metric names, for close-match suggestions.
        sink_names: installed sink entry-point names.

    Raises:
        ConfigError: an unknown metric (``metrics[i].name``, with close matches); two entries with
            the same canonical metric, ``select`` and ``modules`` (``metrics[j]``, naming both); an
            unknown sink (``sinks.<name>``, with the valid names).
    """
    known_metrics = sorted(set(metric_names))
    first_entry: dict[str, int] = {}
    resolved: list[MetricConfig] = []
    for index, metric in enumerate(config.metrics):
        try:
            canonical = resolve_metric(metric.name)
        except KeyError:
            raise ConfigError(
                f"unknown metric {metric.name!r}{_suggest(metric.name, known_metrics, n=3)}; "
                f"`tmetrics metrics` lists all {len(known_metrics)} metrics with their formulas",
                path=f"metrics[{index}].name",
            ) from None
        earlier = first_entry.setdefault(canonical, index)
        if earlier != index:
            same = (frozenset(metric.select), frozenset(metric.modules)) == (
                frozenset(config.metrics[earlier].select), frozenset(config.metrics[earlier].modules))
            raise ConfigError(
                f"{_entry(metric, canonical)} repeats metrics[{earlier}] "
                f"{_entry(config.metrics[earlier], canonical)}: "
                + ("the same metric on the same tensors; remove one entry" if same else
                   "a metric is listed once; merge their select/modules patterns into one list, "
                   "e.g. select: ['layers.0.*', 'layers.1.*']"),
                path=f"metrics[{index}]",
            )
        resolved.append(replace(metric, name=canonical))
    known_sinks = sorted(set(sink_names))
    for name in config.sinks:
        if name not in known_sinks:
            raise ConfigError(
                f"unknown sink {name!r}{_suggest(name, known_sinks)}; installed sinks: "
                f"{', '.join(known_sinks) or '(none)'}; fix the name, or install the package that "
                f"provides it (entry point group 'tmetrics.sinks')",
                path=_child("sinks", name),
            )
    return replace(config, metrics=tuple(resolved))


def config_problems(source: str | os.PathLike[str] | Mapping[str, Any]) -> list[ConfigError]:
    """Every problem :func:`load_config` finds in ``source``, not only the first (it raises at
    the first): each top-level key, each key of ``run`` and ``distributed``, each key of each
    metric entry, each sink and each placement is checked on its own. ``alerts`` gives at most
    one. Empty when ``load_config(source)`` succeeds; names against the catalogue and the
    installed sinks are :func:`check_names`'s (``tmetrics validate`` checks those too).
    """
    if isinstance(source, Mapping):
        data: Any = source
    else:
        try:
            data = read_config_file(source)
        except ConfigError as err:
            return [err]
    problems: list[ConfigError] = []

    def attempt(check: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            check(*args, **kwargs)
        except ConfigError as err:
            problems.append(err)

    if not isinstance(data, Mapping):
        attempt(_config_from, data)
        return problems
    valid = _field_names(Config)
    for key in data:
        attempt(_keys, {key: None}, path="", valid=valid)
    for name, kind in (("run", RunConfig), ("distributed", DistributedConfig)):
        section = data.get(name)
        if not isinstance(section, Mapping):
            attempt(_keys, section, path=name, valid=_field_names(kind))
            continue
        for key, value in section.items():
            attempt(_section_field, name, kind, key, value)
    metrics = data.get("metrics")
    if isinstance(metrics, (list, tuple)):
        for index, spec in enumerate(metrics):
            path = f"metrics[{index}]"
            if not isinstance(spec, Mapping) or "name" not in spec:
                attempt(parse_metric_spec, spec, path=path)
                continue
            for key, value in spec.items():  # each key alone, beside a valid name
                attempt(parse_metric_spec, {"name": spec["name"] if key == "name" else "x", key: value}, path=path)
    else:
        attempt(_metric_list, metrics)
    if "alerts" in data:
        attempt(parse_alerts, data["alerts"])
    sinks = data.get("sinks")
    for one in ({n: o} for n, o in sinks.items()) if isinstance(sinks, Mapping) else [sinks]:
        attempt(_sink_table, one)
    placements = data.get("placements")
    for one in ({g: a} for g, a in placements.items()) if isinstance(placements, Mapping) else [placements]:
        attempt(_placement_table, one)
    return problems


def _section_field(name: str, kind: type, key: Any, value: Any) -> None:
    """One key of the ``run`` or ``distributed`` section checked alone (the others default)."""
    _keys({key: value}, path=name, valid=_field_names(kind))
    with _under(name):
        kind(**{key: value})


# ---- parsing: mappings into dataclasses -------------------------------------------------


def _config_from(data: Any) -> Config:
    if data is None:
        raise ConfigError(f"the config is empty; need a mapping with keys {', '.join(_field_names(Config))}")
    top = _keys(data, path="", valid=_field_names(Config))
    values: dict[str, Any] = dict(top)
    for name, kind in (("run", RunConfig), ("distributed", DistributedConfig)):
        if name in top:
            section = _keys(top[name], path=name, valid=_field_names(kind))
            with _under(name):
                values[name] = kind(**section)
    if "metrics" in top:
        values["metrics"] = _metric_list(top["metrics"])
    if "alerts" in top:
        values["alerts"] = parse_alerts(top["alerts"])
    return Config(**values)


def _metric_list(value: Any) -> tuple[MetricConfig, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part for part in _SPEC_SEPARATORS.split(value) if part]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"got {_describe(value)}; need a list of entries ('NAME:INTERVAL' or a mapping) or one "
            f"string of space- or comma-separated 'NAME:INTERVAL' items",
            path="metrics",
        )
    return tuple(parse_metric_spec(spec, path=f"metrics[{i}]") for i, spec in enumerate(value))


def _split_spec(spec: str, *, path: str) -> dict[str, Any]:
    if _SPEC_SEPARATORS.search(spec):
        raise ConfigError(
            f"got {spec!r}; one entry holds one metric: put each in its own list entry, or write "
            f"`metrics` as one string of space-separated 'NAME:INTERVAL' items",
            path=path,
        )
    name, colon, interval = spec.partition(":")
    if not colon:
        return {"name": name}
    if not _SPEC_INTERVAL.fullmatch(interval):
        raise ConfigError(
            f"got {spec!r}; write NAME or NAME:INTERVAL with INTERVAL a whole number of steps >= 1, "
            f"e.g. '{name or 'layer-grad-l2'}:100'",
            path=path,
        )
    return {"name": name, "interval": int(interval)}


def _keys(value: Any, *, path: str, valid: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a dict whose keys are all in ``valid``; ``None`` counts as empty."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        where = f"the {path} section" if path else "the config"
        raise ConfigError(f"{where} must be a mapping with keys {', '.join(valid)}; got {_describe(value)}", path=path)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} is not a string; valid keys: {', '.join(valid)}", path=path)
        if key not in valid:
            raise ConfigError(
                f"unknown key {key!r}{_suggest(key, valid)}; valid keys: {', '.join(valid)}",
                path=_child(path, key),
            )
    return dict(value)


def _sink_table(value: Any) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        value = _listed_sinks(value, path="sinks")
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"got {_describe(value)}; need a mapping from sink name to its options, e.g. "
            f"{{tensorboard: {{}}, mlflow: {{experiment: demo}}}}",
            path="sinks",
        )
    table: dict[str, dict[str, Any]] = {}
    for name, options in value.items():
        where = _child("sinks", name) if isinstance(name, str) else "sinks"
        _check_name(name, path=where, what="a sink name such as 'tensorboard'")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"got {_describe(options)}; need a mapping of option names to values, or nothing for the defaults",
                path=where,
            )
        for key in options:
            if not isinstance(key, str):
                raise ConfigError(f"option name {_describe(key)} is not a string; write it in quotes", path=where)
        table[name] = copy.deepcopy(dict(options))
    return table


def _listed_sinks(names: list[Any] | tuple[Any, ...], *, path: str) -> dict[str, None]:
    table: dict[str, None] = {}
    for index, name in enumerate(names):
        _check_name(name, path=f"{path}[{index}]", what="a sink name such as 'tensorboard'")
        if name in table:
            raise ConfigError(f"sink {name!r} is listed twice; list each sink once", path=f"{path}[{index}]")
        table[name] = None
    return table


def _placement_table(value: Any) -> dict[str, dict[str, str]]:
    if value is None:
        return {}
    shape = (
        "a mapping from a glob on canonical tensor names to {axis: placement}, "
        "e.g. {'layers.*.attn.q.weight': {tp: 'Shard(0)'}}"
    )
    if not isinstance(value, Mapping):
        raise ConfigError(f"got {_describe(value)}; need {shape}", path="placements")
    table: dict[str, dict[str, str]] = {}
    for pattern, axes in value.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(f"glob {_describe(pattern)} is not a non-empty string; need {shape}", path="placements")
        where = _child("placements", pattern)
        if not isinstance(axes, Mapping) or not axes:
            raise ConfigError(
                f"got {_describe(axes)}; need a non-empty mapping {{axis: placement}}, e.g. {{tp: 'Shard(0)'}}",
                path=where,
            )
        for axis, placement in axes.items():
            if not isinstance(axis, str) or not _AXIS.fullmatch(axis):
                raise ConfigError(
                    f"axis {_describe(axis)} is not an axis name (letters, digits, '_'), e.g. tp, dp, ep", path=where
                )
            _check_placement(placement, path=_child(where, axis))
        table[pattern] = dict(axes)
    return table


# ---- small checks shared by the dataclasses ---------------------------------------------


def _check_placement(value: Any, *, path: str) -> None:
    forms = "overrides take 'R', 'S0', 'S*', 'O1', 'P(sum)' or their long forms ('Shard(0)', ...)"
    if not isinstance(value, str):
        raise ConfigError(f"got {_describe(value)}; need a placement string; {forms}", path=path)
    try:
        parse_placement(value)
    except PlacementError as err:
        raise ConfigError(f"{err}; {forms}, not FlatShard (it depends on each tensor's shape)", path=path) from None


def _check_name(value: Any, *, path: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"got {_describe(value)}; need {what} (letters, digits, '-', '_', '.')", path=path)


def _check_int(value: Any, *, path: str, minimum: int, meaning: str) -> None:
    need = f"need an integer >= {minimum} ({meaning})"
    if isinstance(value, bool) or not isinstance(value, int):
        hint = "; write it without quotes" if isinstance(value, str) and _SPEC_INTERVAL.fullmatch(value.strip()) else ""
        raise ConfigError(f"got {_describe(value)}; {need}{hint}", path=path)
    if value < minimum:
        raise ConfigError(f"got {value}; {need}", path=path)


def _globs(value: Any, *, path: str, of: str) -> tuple[str, ...]:
    items = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"got {_describe(value)}; need a glob on {of} or a list of globs", path=path)
    for index, item in enumerate(items):
        if not isinstance(item, str) or not item.strip():
            where = path if isinstance(value, str) else f"{path}[{index}]"
            raise ConfigError(
                f"got {_describe(item)}; need a non-empty glob on {of}, e.g. 'layers.*.mlp.*'", path=where
            )
    expanded: list[str] = []
    for index, item in enumerate(items):
        try:
            expanded += expand_braces(item)
        except ValueError as exc:
            raise ConfigError(f"{exc}", path=path if isinstance(value, str) else f"{path}[{index}]") from None
    return tuple(dict.fromkeys(expanded))


def _describe(value: Any) -> str:
    """A value as an error message shows it: strings quoted, containers by kind, type named."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    kind = {bool: "a boolean", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )
    return f"{value!r} ({kind})"


def _suggest(word: Any, choices: Iterable[str], *, n: int = 1) -> str:
    """`` (did you mean 'x'?)`` for the closest choices to ``word``, or nothing."""
    matches = difflib.get_close_matches(word, list(choices), n=n) if isinstance(word, str) else []
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


def _entry(metric: MetricConfig, canonical: str) -> str:
    alias = f" (= {canonical})" if metric.name != canonical else ""
    select = ", ".join(metric.select) or "all tensors"
    return f"{metric.name!r}{alias} [interval {metric.interval}, select {select}]"


def _child(path: str, key: str) -> str:
    part = f".{key}" if _PLAIN_KEY.fullmatch(key) else f"[{key!r}]"
    return f"{path}{part}" if path else part.lstrip(".")


def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def _message(err: ConfigError) -> str:
    """The message of ``err`` without the ``path: `` prefix ConfigError adds."""
    return str(err).removeprefix(f"{err.path}: ") if err.path else str(err)


@contextmanager
def _under(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from a nested dataclass with ``prefix`` in front of its path."""
    try:
        yield
    except ConfigError as err:
        inner = err.path
        path = (
            prefix if not inner else inner if not prefix else f"{prefix}{'' if inner.startswith('[') else '.'}{inner}"
        )
        raise ConfigError(_message(err), path=path) from None


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return copy.deepcopy(value)
