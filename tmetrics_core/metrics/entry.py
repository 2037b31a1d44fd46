"""One catalogue entry: what a metric is called, measures and reads, and how it is built.

This is the whole interface of a metric family: a module whose function returns
:class:`CatalogueEntry` values, registered under the entry-point group ``tmetrics.metrics``
(``tmetrics_core.metrics.catalogue``), adds metrics a config can name. The built-in families
(``tmetrics_core.metrics.builtin_entries``) are registered through the same call.

The options the built-in metrics take are declared here once (:data:`SELECT`, :data:`MODULES`,
...) so that a third-party entry taking ``select`` declares the same option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tmetrics_core.config.metric_options import MetricOption
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.cost import cost_class

__all__ = [
    "BINS",
    "FORMAT",
    "MODULES",
    "MOMENTS",
    "RECIPE",
    "SAMPLE",
    "SCALE_MODE",
    "SELECT",
    "CatalogueEntry",
    "made",
]

SELECT = MetricOption("select", "strings", None,
                      "fnmatch globs on canonical tensor names narrowing the sites (omitted: every site it reads)")
MODULES = MetricOption("modules", "strings", None,
                       "fnmatch globs on canonical module names whose outputs are read (omitted: the metric's "
                       "default modules)")
BINS = MetricOption("bins", "int", None, "log-spaced bins per sign, >= 1 (omitted: the metric's default)")
SAMPLE = MetricOption("sample", "int", None, "element positions compared per tensor, >= 1 (omitted: 1024)")
RECIPE = MetricOption("recipe", "strings", None, "low-precision recipes compared in one pass: fp8-tensorwise, "
                      "fp8-rowwise, fp8-block, mxfp8, nvfp4 (omitted: mxfp8)")
FORMAT = MetricOption("format", "str", None, "element format of the FP8 recipes, e4m3 or e5m2 (omitted: the recipe's)")
SCALE_MODE = MetricOption("scale_mode", "str", None,
                          "MX scale rounding: floor, ceil, even or rceil (omitted: the recipe's)")
MOMENTS = MetricOption("moments", "strings", None,
                       "optimizer moments read: exp_avg, exp_avg_sq (omitted: both)")


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    """One catalogue metric.

    Attributes:
        name: canonical name, kebab-case, scope first (``layer-grad-l2``).
        build: makes the metric; called with ``name=`` and the options the config gives (each
            one declared in ``options``), plus the declared defaults that are not ``None``.
        source_kinds: site kinds the metric reads.
        scopes: the labels its records carry (``layer``: one per layer; ``global``: one value,
            or a cross-layer roll-up; ``tensor``/``family``: per tensor name or family).
        formula, unit, baseline: what it computes, in which unit, and what a healthy run shows.
        placements: placements it supports (others raise ``PlacementError`` at configuration).
        options: the config options it takes beyond ``interval`` and ``optional``, declared
            (:class:`~tmetrics_core.config.metric_options.MetricOption`); the config refuses others.
        aliases: other accepted names (Megatron-LM).

    Raises:
        ConfigError: an entry whose name is empty, or whose options are not ``MetricOption``
            values with distinct names.
    """

    name: str
    build: Callable[..., TensorMetric]
    source_kinds: tuple[str, ...]
    scopes: tuple[str, ...]
    formula: str
    unit: str
    baseline: str
    placements: str
    options: tuple[MetricOption, ...] = (SELECT,)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a catalogue entry needs a non-empty name; got {self.name!r}", path="name")
        names = [o.name for o in self.options if isinstance(o, MetricOption)]
        if len(names) != len(self.options) or len(set(names)) != len(names):
            raise ConfigError(f"entry {self.name!r}: options must be MetricOption values with distinct names; got "
                              f"{self.options!r}", path="options")

    def defaults(self) -> dict[str, Any]:
        """The declared defaults ``build`` receives for options a config omits (those not ``None``)."""
        return {o.name: o.default for o in self.options if o.default is not None}

    def describe(self) -> dict[str, Any]:
        """The entry as plain data (for JSON)."""
        return {
            "name": self.name, "aliases": list(self.aliases), "source_kinds": list(self.source_kinds),
            "scopes": list(self.scopes), "formula": self.formula, "unit": self.unit,
            "baseline": self.baseline, "placements": self.placements,
            "options": [o.describe() for o in self.options], "cost": self.cost,
        }

    @property
    def cost(self) -> str:
        """The relative cost class (:data:`~tmetrics_core.metrics.cost.COST_CLASSES`)."""
        return cost_class(self.build(name=self.name, **self.defaults()))


def made(cls: type, kinds: Sequence[str], scope: str, **fixed: Any) -> Callable[..., TensorMetric]:
    """A ``build`` for :class:`CatalogueEntry`: ``cls`` reading ``kinds`` at ``scope``, with the
    ``fixed`` keyword arguments and the config's options."""
    def build(**options: Any) -> TensorMetric:
        return cls(source_kinds=tuple(kinds), scope=scope, **fixed, **options)
    return build
