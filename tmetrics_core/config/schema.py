"""The tmetrics configuration: frozen dataclasses built from YAML, TOML, JSON or a dict.

Shape (the README's Config section); every section and key is optional::

    run: {name: demo, dir: runs/demo}                 # dir defaults to runs/<name>
    metrics:
      - layer-param-l2:100                            # NAME[:INTERVAL], interval 1 when omitted
      - {name: layer-grad-l2, interval: 10, select: "layers.*.mlp.*"}
      - {name: layer-grad-histogram, bins: 64}        # a metric's options, as its catalogue entry declares
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
that need the metric catalogue or the installed sinks are checked by
:func:`tmetrics_core.config.names.check_names`; every problem of a config at once is
:func:`tmetrics_core.config.problems.config_problems`. The sections are
:mod:`tmetrics_core.config.sections`, the value checks :mod:`tmetrics_core.config.checks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tmetrics_core.config.alerts import AlertsConfig, parse_alerts
from tmetrics_core.config.checks import (
    check_name,
    describe,
    field_names,
    keys_of,
    message_of,
    placement_table,
    plain,
    sink_table,
    under,
)
from tmetrics_core.config.files import SUFFIXES, read_config_file
from tmetrics_core.config.sections import (
    SPEC_SEPARATORS,
    DistributedConfig,
    MetricConfig,
    RunConfig,
    parse_metric_spec,
)
from tmetrics_core.errors import ConfigError

__all__ = [
    "Config",
    "config_from",
    "load_config",
    "metric_list",
    "override_sinks",
]


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
                raise ConfigError(f"got {describe(getattr(self, name))}; need a {kind.__name__}", path=name)
        if not isinstance(self.metrics, (list, tuple)) or not all(isinstance(m, MetricConfig) for m in self.metrics):
            raise ConfigError(
                "need a sequence of MetricConfig; build entries with parse_metric_spec or use load_config",
                path="metrics",
            )
        object.__setattr__(self, "metrics", tuple(self.metrics))
        object.__setattr__(self, "sinks", sink_table(self.sinks))
        object.__setattr__(self, "placements", placement_table(self.placements))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, None) that :func:`load_config` reads back into
        an equal config. It may hold secrets from sink options: pass it through
        :func:`tmetrics_core.config.redact.redact` before logging it."""
        data: dict[str, Any] = plain(self)
        for entry in data["metrics"]:  # a metric's own options sit flat in its entry, as written
            entry.update(entry.pop("options"))
        return data


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
        return config_from(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"got {describe(source)}; need a path to a {'/'.join(SUFFIXES)} file or a mapping")
    data = read_config_file(source)
    try:
        return config_from(data)
    except ConfigError as err:
        if not err.path:  # the document as a whole: the file is the place to point at
            raise ConfigError(message_of(err), path=os.fspath(source)) from None
        raise ConfigError(f"{message_of(err)} (in {os.fspath(source)})", path=err.path) from None



def override_sinks(config: Config, names: str | Sequence[str]) -> Config:
    """Replace the configured sinks by a comma-separated list, as ``--sink tensorboard,mlflow``
    (from Python, a list of names works too: ``sinks=["tensorboard", "mlflow"]``).

    A sink already in the config keeps its options; a new one starts with ``{}``. The order is
    the order given. Names are checked against the installed sinks by
    :func:`~tmetrics_core.config.names.check_names`.

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
            f"got {describe(names)}; need sink names, e.g. 'tensorboard,mlflow' or ['tensorboard', 'mlflow']",
            path="--sink"
        )
    chosen: dict[str, dict[str, Any]] = {}
    for name in listed:
        check_name(name, path="--sink", what="a sink name such as 'tensorboard' (no empty entries)")
        if name in chosen:
            raise ConfigError(f"sink {name!r} is given twice in {names!r}; list each sink once", path="--sink")
        chosen[name] = config.sinks.get(name, {})
    return replace(config, sinks=chosen)



def config_from(data: Any) -> Config:
    if data is None:
        raise ConfigError(f"the config is empty; need a mapping with keys {', '.join(field_names(Config))}")
    top = keys_of(data, path="", valid=field_names(Config))
    values: dict[str, Any] = dict(top)
    for name, kind in (("run", RunConfig), ("distributed", DistributedConfig)):
        if name in top:
            section = keys_of(top[name], path=name, valid=field_names(kind))
            with under(name):
                values[name] = kind(**section)
    if "metrics" in top:
        values["metrics"] = metric_list(top["metrics"])
    if "alerts" in top:
        values["alerts"] = parse_alerts(top["alerts"])
    return Config(**values)


def metric_list(value: Any) -> tuple[MetricConfig, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part for part in SPEC_SEPARATORS.split(value) if part]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"got {describe(value)}; need a list of entries ('NAME:INTERVAL' or a mapping) or one "
            f"string of space- or comma-separated 'NAME:INTERVAL' items",
            path="metrics",
        )
    return tuple(parse_metric_spec(spec, path=f"metrics[{i}]") for i, spec in enumerate(value))

