"""``tmetrics validate``: every problem of a config file at once, as a run would find them at
start-up (without a model): the schema (:func:`~tmetrics_core.config.problems.config_problems`),
each metric entry that parses against the catalogue (name and options), each sink's options,
and, when all of that passes, metrics listed twice. A config that names no sink is valid but
said to log nowhere (:data:`~tmetrics_core.build.NO_SINKS`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tmetrics_core.build import NO_SINKS
from tmetrics_core.config.files import read_config_file
from tmetrics_core.config.names import check_names
from tmetrics_core.config.problems import config_problems
from tmetrics_core.config.schema import Config, load_config
from tmetrics_core.config.sections import parse_metric_spec
from tmetrics_core.errors import ConfigError

__all__ = ["NO_SINKS", "validate_file"]


def validate_file(path: Path) -> Config:
    """The checked config of ``path``, its metric aliases replaced by canonical names.

    Raises:
        ConfigError: every problem found, one per line, each with its config path; or the one
            error of a file that cannot be read or parsed.
    """
    from tmetrics_core.metrics.catalogue import metric_names, metric_options, resolve_metric

    data = read_config_file(path)  # a file that cannot be read or parsed: that one error
    problems = config_problems(data) if isinstance(data, Mapping) else config_problems(path)
    if isinstance(data, Mapping):
        problems += _metric_problems(data.get("metrics")) + _sink_problems(data.get("sinks"))
    if problems:
        raise _all(path, problems)
    try:
        return check_names(load_config(path), resolve_metric=resolve_metric, metric_names=metric_names(),
                           sink_names=_installed_sinks(), metric_options=metric_options)
    except ConfigError as exc:
        raise _all(path, [exc]) from None


def _metric_problems(metrics: Any) -> list[ConfigError]:
    """Name and options of each metric entry that parses (the schema reports the others)."""
    from tmetrics_core.metrics.catalogue import build_metric, metric_names, metric_options, resolve_metric

    entries = [e for e in re.split(r"[\s,]+", metrics) if e] if isinstance(metrics, str) else metrics
    problems = []
    for index, spec in enumerate(entries if isinstance(entries, (list, tuple)) else ()):
        path = f"metrics[{index}]"
        try:
            mc = parse_metric_spec(spec, path=path)
        except ConfigError:
            continue
        try:  # the name, in the words a run would use
            check_names(Config(metrics=(mc,)), resolve_metric=resolve_metric, metric_names=metric_names(),
                        sink_names=(), metric_options=metric_options)
        except ConfigError as exc:
            problems.append(ConfigError(_message(exc), path=exc.path.replace("metrics[0]", path, 1)))
            continue
        try:
            build_metric(mc.name, **mc.option_values())
        except ConfigError as exc:
            problems.append(ConfigError(_message(exc), path=f"{path}.{exc.path}" if exc.path else path))
    return problems


def _sink_problems(sinks: Any) -> list[ConfigError]:
    """Each named sink built with its options (one problem per sink)."""
    from tmetrics_core.sinks.registry import build_sinks

    table = dict.fromkeys(sinks) if isinstance(sinks, (list, tuple)) else sinks if isinstance(sinks, Mapping) else {}
    problems = []
    for name, options in table.items():
        if not isinstance(name, str) or not (options is None or isinstance(options, Mapping)):
            continue
        try:
            build_sinks({name: options or {}})
        except ConfigError as exc:
            problems.append(exc)
    return problems


def _message(exc: ConfigError) -> str:
    return str(exc).removeprefix(f"{exc.path}: ") if exc.path else str(exc)


def _installed_sinks() -> list[str]:
    from tmetrics_core.sinks.registry import available_sinks

    return [name for name, _ in available_sinks()]


def _all(path: Path, problems: list[ConfigError]) -> ConfigError:
    if len(problems) == 1:
        return ConfigError(f"{problems[0]} (in {path})")
    return ConfigError(f"{len(problems)} problems in {path}:\n" + "\n".join(f"  {p}" for p in problems))
