"""The names of a config checked against what is installed: metrics in the catalogue, sinks
under their entry-point group. The catalogue is handed in, so the config imports no metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from tmetrics_core.config.checks import child_path, suggest
from tmetrics_core.config.metric_options import MetricOption, check_metric_options
from tmetrics_core.config.schema import Config
from tmetrics_core.config.sections import MetricConfig
from tmetrics_core.errors import ConfigError

__all__ = ["check_names"]


def check_names(
    config: Config,
    *,
    resolve_metric: Callable[[str], str],
    metric_names: Iterable[str],
    sink_names: Iterable[str],
    metric_options: Callable[[str], Sequence[MetricOption]],
) -> Config:
    """Check metric and sink names against what is installed, and each metric's options against
    what its catalogue entry declares; return the config with every metric alias replaced by its
    canonical name and its own options checked (``strings`` values as tuples).

    Args:
        config: the config to check.
        resolve_metric: canonical name of a metric name or alias; raises ``KeyError`` when unknown.
        metric_names: known metric names, for close-match suggestions.
        sink_names: installed sink entry-point names.
        metric_options: the options a canonical metric name declares.

    Raises:
        ConfigError: an unknown metric (``metrics[i].name``, with close matches); two entries with
            the same canonical metric, ``select`` and ``modules`` (``metrics[j]``, naming both); an
            unknown sink (``sinks.<name>``, with the valid names); an option the metric does not
            declare, or a value of the wrong type (``metrics[i].<option>``, listing the options it
            takes).
    """
    known_metrics = sorted(set(metric_names))
    first_entry: dict[str, int] = {}
    resolved: list[MetricConfig] = []
    for index, metric in enumerate(config.metrics):
        try:
            canonical = resolve_metric(metric.name)
        except KeyError:
            raise ConfigError(
                f"unknown metric {metric.name!r}{suggest(metric.name, known_metrics, n=3)}; "
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
        given = check_metric_options(canonical, metric_options(canonical), metric.option_values(),
                                     path=f"metrics[{index}]")
        resolved.append(replace(metric, name=canonical, options={k: given[k] for k in metric.options}))
    known_sinks = sorted(set(sink_names))
    for name in config.sinks:
        if name not in known_sinks:
            raise ConfigError(
                f"unknown sink {name!r}{suggest(name, known_sinks)}; installed sinks: "
                f"{', '.join(known_sinks) or '(none)'}; fix the name, or install the package that "
                f"provides it (entry point group 'tmetrics.sinks')",
                path=child_path("sinks", name),
            )
    return replace(config, metrics=tuple(resolved))


def _entry(metric: MetricConfig, canonical: str) -> str:
    alias = f" (= {canonical})" if metric.name != canonical else ""
    select = ", ".join(metric.select) or "all tensors"
    return f"{metric.name!r}{alias} [interval {metric.interval}, select {select}]"

