"""The metric catalogue: a registry of the metrics a config can name, built in or installed.

A metric family is a function returning :class:`~tmetrics_core.metrics.entry.CatalogueEntry`
values. The built-in families (:mod:`tmetrics_core.metrics.builtin_entries`) and every family an
installed package registers under the entry-point group ``tmetrics.metrics`` go through one
call, :func:`_register`. A package adds a metric with one module and one line of its
``pyproject.toml``::

    [project.entry-points."tmetrics.metrics"]
    my-family = "my_package.my_metrics:entries"

Families load once per ``sys.path``. One that fails to import, returns something else than
entries, or reuses a registered name is left out, with a warning, so an installed but broken
plugin cannot stop a run that does not name its metrics; naming one of them gives an unknown
metric error that says which family failed and why.

``tmetrics metrics`` prints :func:`describe_catalogue`; the config checks names with
:func:`resolve_metric` and :func:`metric_names` and options with :func:`metric_options`; the
runtime builds metrics with :func:`build_metric`.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from tmetrics_core.config.metric_options import MetricOption, check_metric_options
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.builtin_entries import FAMILIES
from tmetrics_core.metrics.cost import COST_CLASSES
from tmetrics_core.metrics.entry import CatalogueEntry

__all__ = [
    "ALIASES",
    "ENTRY_POINT_GROUP",
    "build_metric",
    "catalogue_entries",
    "describe_catalogue",
    "metric_names",
    "metric_options",
    "resolve_metric",
]

_log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tmetrics.metrics"
"""The entry-point group a package uses to add metric families: ``[project.entry-points."tmetrics.metrics"]``;
each entry point names a function returning catalogue entries."""

_BUILT_IN = "tmetrics (built in)"

ALIASES: dict[str, str] = {alias: entry.name for _, family in FAMILIES for entry in family() for alias in entry.aliases}
"""Alias -> canonical name of the built-in entries (the Megatron-LM names that differ from ours)."""


@dataclass(slots=True)
class _Registry:
    """The entries in registration order, their aliases, where each came from, and the families
    left out (one line each)."""

    entries: dict[str, CatalogueEntry] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def _register(registry: _Registry, family: Callable[[], Iterable[CatalogueEntry]], origin: str, *,
              built_in: bool = False) -> None:
    """Add every entry ``family()`` returns, or none of them. An installed family's entries are
    each built once from their declared defaults (as ``tmetrics metrics`` builds them).

    Raises:
        ValueError: the family returns something else than entries, or a name or alias that is
            already registered (within the family or before it).
        Exception: whatever building an installed entry from its defaults raises.
    """
    entries = list(family())
    taken = set(registry.entries) | set(registry.aliases)
    for entry in entries:
        if not isinstance(entry, CatalogueEntry):
            raise ValueError(f"it returned {type(entry).__name__}, not CatalogueEntry")
        if not built_in:
            entry.build(name=entry.name, **entry.defaults())
        for name in (entry.name, *entry.aliases):
            if name in taken:
                owner = registry.origins.get(registry.aliases.get(name, name), origin)
                raise ValueError(f"metric name {name!r} is already registered by {owner}")
            taken.add(name)
    for entry in entries:
        registry.entries[entry.name] = entry
        registry.origins[entry.name] = origin
        registry.aliases.update(dict.fromkeys(entry.aliases, entry.name))


@functools.lru_cache(maxsize=4)
def _load(path: tuple[str, ...]) -> _Registry:
    """The catalogue of the packages installed on ``path`` (``sys.path``: the cache key)."""
    registry = _Registry()
    for name, family in FAMILIES:
        _register(registry, family, f"{_BUILT_IN}: {name}", built_in=True)
    # In name order, not the path's: a name clash or a failure is said alike on every machine.
    points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda p: (p.name, p.value))
    for point in points:
        dist = point.dist.name if point.dist is not None else "an unknown distribution"
        origin = f"{point.name} ({dist})"
        try:
            _register(registry, point.load(), origin)
        except Exception as exc:  # a broken plugin must not stop runs that do not name it
            line = f"{origin}, {point.value}: {type(exc).__name__}: {exc}"
            registry.failed.append(line)
            _log.warning("tmetrics: metric family %s is left out of the catalogue; fix or uninstall it "
                         "(entry-point group %r)", line, ENTRY_POINT_GROUP)
    return registry


def _catalogue() -> _Registry:
    return _load(tuple(sys.path))


def catalogue_entries() -> list[CatalogueEntry]:
    """Every entry, in catalogue order: the built-in families, then installed ones."""
    return list(_catalogue().entries.values())


def metric_names() -> list[str]:
    """Canonical names and aliases, sorted (for close-match suggestions)."""
    registry = _catalogue()
    return sorted(set(registry.entries) | set(registry.aliases))


def resolve_metric(name: str) -> str:
    """The canonical name of ``name`` (a canonical name or an alias).

    Raises:
        KeyError: unknown name; the message lists close matches, and the installed families
            that failed to load.
    """
    registry = _catalogue()
    if name in registry.entries:
        return name
    if name in registry.aliases:
        return registry.aliases[name]
    close = difflib.get_close_matches(name, metric_names(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    failed = f"; installed metric families that failed to load: {'; '.join(registry.failed)}" if registry.failed else ""
    raise KeyError(f"unknown metric {name!r}{hint} (`tmetrics metrics` lists them all){failed}")


def metric_options(name: str) -> tuple[MetricOption, ...]:
    """The options the metric ``name`` (canonical or alias) declares.

    Raises:
        KeyError: unknown name (as :func:`resolve_metric`).
    """
    return _catalogue().entries[resolve_metric(name)].options


def build_metric(name: str, **options: Any) -> TensorMetric:
    """Build the metric called ``name`` (canonical or alias); its ``name`` is canonical.

    Args:
        options: the metric's options, each one its entry declares (``tmetrics metrics --json``
            lists them): for the built-in metrics ``select`` (globs on canonical tensor names),
            ``modules`` (globs on module names), ``bins``, ``sample``, ``recipe``, ``format``,
            ``scale_mode``, ``moments``. ``None`` or an empty value is the same as omitting the
            option; an omitted option with a declared default gets that default.

    Raises:
        ConfigError: unknown name (``path="name"``, with close matches), an option the metric
            does not declare or a value of the wrong type (``path`` names the option; the message
            lists the options it takes).
    """
    try:
        canonical = resolve_metric(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0]), path="name") from None
    entry = _catalogue().entries[canonical]
    given = {k: v for k, v in options.items() if v is not None and not (isinstance(v, (str, tuple, list)) and not v)}
    chosen = entry.defaults() | check_metric_options(canonical, entry.options, given)
    return entry.build(name=canonical, **chosen)


def describe_catalogue(fmt: Literal["table", "json"] = "table") -> str:
    """The catalogue for ``tmetrics metrics``: name, source kinds, scopes, cost class, formula,
    baseline, then what each cost class costs, the aliases, and the metrics installed packages add.

    ``"table"``: aligned plain text, formulas wrapped, aliases and installed families listed
    after the table.
    ``"json"``: ``{"metrics": [...entries...], "aliases": {...}}``, each entry with its declared
    options (name, type, default, meaning).

    Raises:
        ConfigError: ``fmt`` is neither ``"table"`` nor ``"json"``.
    """
    registry = _catalogue()
    entries = list(registry.entries.values())
    if fmt == "json":
        return json.dumps({"metrics": [e.describe() for e in entries], "aliases": registry.aliases}, indent=2)
    if fmt != "table":
        raise ConfigError(f"got {fmt!r}; need 'table' or 'json'", path="format")
    headers = ("name", "source kinds", "scope", "cost", "formula", "baseline")
    rows = [(e.name, ", ".join(e.source_kinds), ", ".join(e.scopes), e.cost, e.formula, e.baseline) for e in entries]
    widths = [max(len(r[0]) for r in rows), 21, 13, 11, 46, 36]
    lines = [_line(headers, widths), _line(tuple("-" * w for w in widths), widths)]
    for row in rows:
        cells = [textwrap.wrap(cell, w) or [""] if i else [cell] for i, (cell, w) in enumerate(zip(row, widths))]
        for j in range(max(len(c) for c in cells)):
            lines.append(_line(tuple(c[j] if j < len(c) else "" for c in cells), widths))
    lines.append("")
    lines.append("cost classes, cheapest first:")
    lines += [f"  {name}: {meaning}" for name, meaning in COST_CLASSES.items()]
    lines.append("")
    lines.append("aliases (Megatron-LM names): " + ", ".join(f"{a} -> {c}" for a, c in sorted(registry.aliases.items())))
    installed = [f"{name} [{origin}]" for name, origin in registry.origins.items() if not origin.startswith(_BUILT_IN)]
    if installed or registry.failed:
        lines.append("")
        lines.append(f"from installed packages (entry-point group {ENTRY_POINT_GROUP!r}): {', '.join(installed) or 'none'}")
        lines += [f"  left out: {line}" for line in registry.failed]
    return "\n".join(lines)


def _line(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
