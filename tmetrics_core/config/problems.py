"""Every problem of a config at once, for ``tmetrics validate`` (loading stops at the first)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.config.checks import field_names, keys_of, placement_table, sink_table, under
from tmetrics_core.config.files import read_config_file
from tmetrics_core.config.schema import Config, config_from, metric_list
from tmetrics_core.config.sections import DistributedConfig, RunConfig, parse_metric_spec
from tmetrics_core.errors import ConfigError

__all__ = ["config_problems"]


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
        attempt(config_from, data)
        return problems
    valid = field_names(Config)
    for key in data:
        attempt(keys_of, {key: None}, path="", valid=valid)
    for name, kind in (("run", RunConfig), ("distributed", DistributedConfig)):
        section = data.get(name)
        if not isinstance(section, Mapping):
            attempt(keys_of, section, path=name, valid=field_names(kind))
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
        attempt(metric_list, metrics)
    if "alerts" in data:
        attempt(parse_alerts, data["alerts"])
    sinks = data.get("sinks")
    for one in ({n: o} for n, o in sinks.items()) if isinstance(sinks, Mapping) else [sinks]:
        attempt(sink_table, one)
    placements = data.get("placements")
    for one in ({g: a} for g, a in placements.items()) if isinstance(placements, Mapping) else [placements]:
        attempt(placement_table, one)
    return problems


def _section_field(name: str, kind: type, key: Any, value: Any) -> None:
    """One key of the ``run`` or ``distributed`` section checked alone (the others default)."""
    keys_of({key: value}, path=name, valid=field_names(kind))
    with under(name):
        kind(**{key: value})

