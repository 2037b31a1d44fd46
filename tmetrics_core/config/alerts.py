"""The ``alerts:`` section of the config: rules that watch the records of a run.

Shapes accepted (every key optional)::

    alerts: default                          # the default rule set (DEFAULT_RULES)
    alerts:                                  # a list of rules
      - {kind: spike, metric: layer-update-ratio, scope: {layer: "*"}, factor: 10}
      - {kind: threshold, metric: layer-expert-load-imbalance, scope: {stat: max-over-mean}, above: 4}
      - {kind: nonfinite, metric: "layer-grad-*"}
      - {kind: stuck, metric: layer-expert-tokens, mode: zero, steps: 2}
    alerts: {rules: default, gradient_nonfinite: true, cluster_steps: 10}

A rule watches every record whose metric name matches ``metric`` (an ``fnmatch`` glob) and whose
labels match ``scope`` (label name -> glob on the label's text; a label named in ``scope`` must be
set). Vectors (tokens per expert) are watched element by element, as sinks show them (element ``i``
is expert ``i``). Values are *due values*: one per due step of the metric.

Every check runs at construction; errors are :class:`~tmetrics_core.errors.ConfigError` with the
path and the value (``alerts[1].factor: got 0; need a number > 1``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union

from tmetrics_core.errors import ConfigError
from tmetrics_core.records import Labels

__all__ = [
    "DEFAULT_RULES",
    "GRADIENT_NONFINITE",
    "AlertRule",
    "AlertsConfig",
    "NonfiniteRule",
    "SpikeRule",
    "StuckRule",
    "ThresholdRule",
    "parse_alerts",
]

LABELS: tuple[str, ...] = Labels.NAMES
"""Label names a scope may select on (those of :class:`~tmetrics_core.records.Labels`)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _number(value: Any, *, path: str, need: str, ok: Any) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or not ok(value):
        shown = repr(value) if is_number or isinstance(value, str) else type(value).__name__
        raise ConfigError(f"got {shown}; need {need}", path=path)
    return float(value)


def _count(value: Any, *, path: str, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"got {value!r}; need an integer >= {minimum} ({meaning})", path=path)
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class _Rule:
    metric: str
    """``fnmatch`` glob on metric names (``layer-grad-l2``, ``layer-*-l2``)."""
    scope: dict[str, str] = field(default_factory=dict)
    """Label name (layer, expert, tensor, stat) -> glob on the label's text (``{layer: "*"}``:
    any record with a layer; ``{stat: max_over_mean}``). Empty: every record of the metric."""
    name: str = ""
    """The rule's name in alerts; default ``<metric>-<kind>`` (``layer-grad-l2-spike``)."""

    def _check_common(self, kind: str) -> None:
        if not isinstance(self.metric, str) or not self.metric.strip():
            raise ConfigError(f"got {self.metric!r}; need a glob on metric names such as 'layer-grad-l2'",
                              path="metric")
        if not isinstance(self.scope, Mapping):
            raise ConfigError(f"got {type(self.scope).__name__}; need a mapping label -> glob, e.g. {{layer: '*'}}",
                              path="scope")
        for label, glob in self.scope.items():
            if label not in LABELS:
                raise ConfigError(f"unknown label {label!r}; valid: {', '.join(LABELS)}", path=f"scope.{label}")
            if isinstance(glob, bool) or not isinstance(glob, (str, int)) or not str(glob).strip():
                raise ConfigError(f"got {glob!r}; need a glob on the label's text, e.g. '*' or '3'",
                                  path=f"scope.{label}")
        object.__setattr__(self, "scope", {label: str(glob) for label, glob in self.scope.items()})
        if not self.name:
            object.__setattr__(self, "name", f"{self.metric}-{kind}".replace("*", "x"))
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"got {self.name!r}; need a rule name (letters, digits, '-', '_', '.')", path="name")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpikeRule(_Rule):
    """Trips when a due value jumps over a robust running baseline of the same series.

    The baseline is the median (or the exponential moving average) of the last ``window`` due
    values before this one. The rule trips when ``value > factor * baseline`` or, with
    ``zscore``, when ``(value - median) / (1.4826 * MAD) > zscore`` (MAD: median absolute
    deviation of the window; EMA baseline: the EMA standard deviation instead). It closes when
    the value falls back below halfway between the baseline and the tripping bound.
    """

    kind: Literal["spike"] = "spike"
    baseline: Literal["median", "ema"] = "median"
    """``median`` of the window, or ``ema`` with smoothing ``2 / (window + 1)``."""
    window: int = 20
    """Due values in the baseline (20 due values of a metric logged every 5 steps: 100 steps)."""
    warmup: int = 5
    """Due values seen before the rule may trip (the baseline is unreliable before)."""
    factor: float | None = 10.0
    """Trip when value > factor x baseline (a ratio > 1); ``None``: z-score only."""
    zscore: float | None = None
    """Trip when the robust z-score of the value exceeds this (> 0, in MAD-scaled deviations)."""
    floor: float = 0.0
    """Absolute floor in the metric's unit: values at or below it never trip (ignores jumps among
    tiny numbers)."""

    def __post_init__(self) -> None:
        self._check_common("spike")
        if self.baseline not in ("median", "ema"):
            raise ConfigError(f"got {self.baseline!r}; need 'median' or 'ema'", path="baseline")
        _count(self.window, path="window", minimum=2, meaning="due values in the baseline")
        _count(self.warmup, path="warmup", minimum=1, meaning="due values before the rule may trip")
        if self.factor is None and self.zscore is None:
            raise ConfigError("got neither; need factor (a ratio > 1) or zscore (> 0) or both", path="factor")
        if self.factor is not None:
            object.__setattr__(self, "factor", _number(self.factor, path="factor", need="a number > 1 (a ratio "
                                                       "over the baseline)", ok=lambda v: v > 1))
        if self.zscore is not None:
            object.__setattr__(self, "zscore", _number(self.zscore, path="zscore", need="a number > 0 (robust "
                                                       "standard deviations)", ok=lambda v: v > 0))
        object.__setattr__(self, "floor", _number(self.floor, path="floor", need="a finite number (the metric's "
                                                  "unit)", ok=lambda v: True))


@dataclass(frozen=True, kw_only=True, slots=True)
class ThresholdRule(_Rule):
    """Trips when a due value is above ``above`` or below ``below`` (in the metric's unit);
    closes when it is back within the bounds. NaN never trips it (see :class:`NonfiniteRule`)."""

    kind: Literal["threshold"] = "threshold"
    above: float | None = None
    """Upper bound; ``None``: none."""
    below: float | None = None
    """Lower bound; ``None``: none."""

    def __post_init__(self) -> None:
        self._check_common("threshold")
        if self.above is None and self.below is None:
            raise ConfigError("got neither; need above, below or both (bounds in the metric's unit)", path="above")
        for name in ("above", "below"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _number(getattr(self, name), path=name, need="a finite number",
                                                       ok=lambda v: True))
        if self.above is not None and self.below is not None and self.below >= self.above:
            raise ConfigError(f"got below {self.below} >= above {self.above}; need below < above", path="below")


@dataclass(frozen=True, kw_only=True, slots=True)
class NonfiniteRule(_Rule):
    """Trips on a NaN or infinite value; for a count metric named ``*-nonfinite``
    (``layer-grad-nonfinite``), on a count > 0. Closes when the value is finite (count 0) again."""

    kind: Literal["nonfinite"] = "nonfinite"

    def __post_init__(self) -> None:
        self._check_common("nonfinite")


@dataclass(frozen=True, kw_only=True, slots=True)
class StuckRule(_Rule):
    """Trips when the last ``steps`` due values are all zero (``mode: zero``, |value| <= atol:
    a dead expert) or all equal (``mode: unchanged``, within atol: a frozen layer). Closes at the
    first due value that breaks the run.

    With ``share`` (zero mode, vector elements such as tokens per expert): trips only when the
    element's last non-zero value was at least ``share`` x the mean of its vector at that step,
    i.e. an expert that had its share of tokens and lost all of them, not one that starved
    slowly (which the router's balancing often revives)."""

    kind: Literal["stuck"] = "stuck"
    mode: Literal["zero", "unchanged", "starved"] = "zero"
    """``zero``, ``unchanged``, or ``starved``: a vector element (tokens per expert) below
    ``share`` x its vector's mean (a fair load) for ``steps`` due values in a row, which names an
    expert the router starves slowly, as well as one that dies at once, before its count is 0. A
    starved alert closes when the element is back at 2 x ``share`` x the mean, so a load hovering
    around the share raises one alert, not one per dip."""
    steps: int = 2
    """Consecutive due values it takes (>= 1 for zero, >= 2 for unchanged)."""
    atol: float = 0.0
    """Absolute tolerance in the metric's unit."""
    warmup: int = 0
    """Due values seen before the rule may trip (early training moves routing wildly)."""
    share: float | None = None
    """Zero mode on vector elements: the least fraction of the vector's mean the value before the
    zeros must have had (0.25: a quarter of a fair share); ``None``: any value. Starved mode
    (required): the fraction of the mean below which a value counts as starved."""

    def __post_init__(self) -> None:
        self._check_common("stuck")
        _count(self.warmup, path="warmup", minimum=0, meaning="due values before the rule may trip")
        if self.share is None and self.mode == "starved":
            raise ConfigError("mode 'starved' needs share: the fraction of a fair load (the vector's mean) below "
                              "which an element counts as starved, e.g. 0.1", path="share")
        if self.share is not None:
            if self.mode == "unchanged":
                raise ConfigError(f"got {self.share!r} with mode 'unchanged'; share applies to modes 'zero' and "
                                  "'starved'", path="share")
            object.__setattr__(self, "share", _number(self.share, path="share", need="a fraction > 0 of the "
                                                      "vector's mean", ok=lambda v: v > 0))
        if self.mode not in ("zero", "unchanged", "starved"):
            raise ConfigError(f"got {self.mode!r}; need 'zero', 'unchanged' or 'starved'", path="mode")
        _count(self.steps, path="steps", minimum=2 if self.mode == "unchanged" else 1,
               meaning="consecutive due values")
        object.__setattr__(self, "atol", _number(self.atol, path="atol", need="a number >= 0", ok=lambda v: v >= 0))


AlertRule = Union[SpikeRule, ThresholdRule, NonfiniteRule, StuckRule]
"""One rule of any kind."""

_KINDS: dict[str, type] = {"spike": SpikeRule, "threshold": ThresholdRule, "nonfinite": NonfiniteRule,
                           "stuck": StuckRule}

GRADIENT_NONFINITE = NonfiniteRule(name="nonfinite-gradients", metric="*grad*")
"""Non-finite values (and non-zero ``*-nonfinite`` counts) of every gradient metric."""

DEFAULT_RULES: tuple[AlertRule, ...] = (
    SpikeRule(name="grad-norm-spike", metric="layer-grad-l2", scope={"layer": "*"}, factor=10.0, warmup=8),
    SpikeRule(name="update-ratio-spike", metric="layer-update-ratio", scope={"layer": "*"}, factor=10.0, warmup=8),
    GRADIENT_NONFINITE,
    StuckRule(name="dead-expert", metric="layer-expert-tokens", scope={"layer": "*", "expert": "*"},
              mode="zero", steps=1, warmup=6, share=0.5),
    StuckRule(name="starved-expert", metric="layer-expert-tokens", scope={"layer": "*", "expert": "*"},
              mode="starved", steps=2, warmup=6, share=0.1),
    ThresholdRule(name="load-imbalance", metric="layer-expert-load-imbalance", scope={"stat": "max-over-mean"},
                  above=4.0),
)
"""``alerts: default``, for the demo bundle (metrics logged every 5 steps):

- ``grad-norm-spike``, ``update-ratio-spike``: a layer's gradient L2 norm or update ratio over 10x
  the median of its last 20 due values, after 8 due values (early training moves them by more;
  with metrics every 5 steps from step 1, step 40 is the first that can trip, where a 120-step
  demo injects its faults);
- ``nonfinite-gradients``: :data:`GRADIENT_NONFINITE`;
- ``dead-expert``: an expert that got at least half of its fair share of tokens at one due
  step and none at the next, after 6 due values (the demo's router empties and refills experts
  in its first 25 steps); named at the due step of the death;
- ``starved-expert``: an expert below 0.1 of its fair share (its layer's mean tokens) for 2 due
  values in a row, after 6 due values: the slow kind of death, named at most 1 due step after its
  load reaches 0 (an expert at 0 tokens is below any share), and the experts the demo's router
  starves by itself (genuinely starved: true alarms, counted in docs/alerts.md);
- ``load-imbalance``: max over mean tokens per expert above 4. The ratio is at most
  experts / top-k, so this fires only for models where that exceeds 4 (64 experts, top-8: up to 8);
  the demo (4 experts, top-2) routes every token of some layers through one expert in clean runs
  (ratio 2.0, its maximum), so no bound there tells a fault from a clean run.
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlertsConfig:
    """Which alerts a run raises. See the module docstring for the YAML shapes."""

    rules: tuple[AlertRule, ...] = ()
    """Rules in the order given; names are unique."""
    gradient_nonfinite: bool = True
    """Also run :data:`GRADIENT_NONFINITE` (every metric whose name contains ``grad``: NaN,
    infinity, a non-zero ``*-nonfinite`` count), unless a rule is already named
    ``nonfinite-gradients``."""
    cluster_steps: int = 10
    """Alerts opening within this many steps after a cluster's first alert belong to its cluster
    and name that first alert (earliest step, then the biggest jump); a later one starts a new
    cluster."""

    def __post_init__(self) -> None:
        if not isinstance(self.rules, (list, tuple)) or not all(isinstance(r, tuple(_KINDS.values()))
                                                                 for r in self.rules):
            raise ConfigError("need a sequence of rules; build them with parse_alerts", path="rules")
        object.__setattr__(self, "rules", tuple(self.rules))
        seen: dict[str, int] = {}
        for index, rule in enumerate(self.rules):
            if rule.name in seen:
                raise ConfigError(f"rule name {rule.name!r} is used by rules[{seen[rule.name]}] too; give each rule "
                                  f"its own name", path=f"rules[{index}].name")
            seen[rule.name] = index
        if not isinstance(self.gradient_nonfinite, bool):
            raise ConfigError(f"got {self.gradient_nonfinite!r}; need true or false", path="gradient_nonfinite")
        _count(self.cluster_steps, path="cluster_steps", minimum=0, meaning="steps")

    @property
    def active_rules(self) -> tuple[AlertRule, ...]:
        """``rules`` plus :data:`GRADIENT_NONFINITE` when ``gradient_nonfinite`` asks for it."""
        if self.gradient_nonfinite and not any(r.name == GRADIENT_NONFINITE.name for r in self.rules):
            return self.rules + (GRADIENT_NONFINITE,)
        return self.rules


def parse_alerts(value: Any) -> AlertsConfig:
    """Build :class:`AlertsConfig` from the config's ``alerts:`` value (see the module docstring).

    Raises:
        ConfigError: with the path below ``alerts`` (``alerts[1].factor: got 0; need a number > 1``).
    """
    if value is None:
        return AlertsConfig()
    if isinstance(value, str) or isinstance(value, (list, tuple)):
        try:
            return AlertsConfig(rules=_rules(value, path="alerts"))
        except ConfigError as error:
            if not error.path.startswith("rules"):
                raise
            raise ConfigError(_bare(error), path="alerts" + error.path.removeprefix("rules")) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"got {type(value).__name__}; need 'default', a list of rules or a mapping with keys "
                          f"{', '.join(_fields(AlertsConfig))}", path="alerts")
    unknown = sorted(set(value) - set(_fields(AlertsConfig)))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(_fields(AlertsConfig))}",
                          path=f"alerts.{unknown[0]}")
    options = dict(value)
    options["rules"] = _rules(options.get("rules", ()), path="alerts.rules")
    try:
        return AlertsConfig(**options)
    except ConfigError as error:
        raise ConfigError(_bare(error), path=f"alerts.{error.path}") from None


def _rules(value: Any, *, path: str) -> tuple[AlertRule, ...]:
    if value == "default":
        return DEFAULT_RULES
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"got {value!r}; need 'default' or a list of rules", path=path)
    rules: list[AlertRule] = []
    for index, item in enumerate(value):
        where = f"{path}[{index}]"
        if item == "default":
            rules.extend(DEFAULT_RULES)
            continue
        if not isinstance(item, Mapping) or "kind" not in item:
            raise ConfigError(f"got {item!r}; need a mapping with kind (one of {', '.join(_KINDS)}) and metric, "
                              f"or 'default'", path=where)
        kind = _KINDS.get(item["kind"])
        if kind is None:
            raise ConfigError(f"got {item['kind']!r}; need one of {', '.join(_KINDS)}", path=f"{where}.kind")
        unknown = sorted(set(item) - set(_fields(kind)))
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r} for a {item['kind']} rule; valid keys: "
                              f"{', '.join(_fields(kind))}", path=f"{where}.{unknown[0]}")
        if "metric" not in item:
            raise ConfigError("missing key 'metric' (a glob on metric names)", path=where)
        try:
            rules.append(kind(**item))
        except ConfigError as error:
            raise ConfigError(_bare(error), path=f"{where}.{error.path}" if error.path else where) from None
    return tuple(rules)


def _fields(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def _bare(error: ConfigError) -> str:
    return str(error).removeprefix(f"{error.path}: ") if error.path else str(error)
