"""The sections of a config below the whole: ``run``, one ``metrics`` entry, ``distributed``.

Each is a frozen dataclass that checks itself when built (:mod:`tmetrics_core.config.schema`
describes the whole shape); :func:`parse_metric_spec` reads one ``metrics`` entry, from the
``NAME[:INTERVAL]`` string form or a mapping.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tmetrics_core.config.checks import (
    WHOLE_NUMBER,
    check_int,
    child_path,
    check_name,
    describe,
    field_names,
    glob_list,
    keys_of,
    suggest,
    under,
)
from tmetrics_core.errors import ConfigError

__all__ = [
    "CheckPlan",
    "DistributedConfig",
    "MetricConfig",
    "READ_RESULTS",
    "ReadResults",
    "RunConfig",
    "SPEC_SEPARATORS",
    "VerifyReplicas",
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
SPEC_SEPARATORS = re.compile(r"[\s,]+")


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
            raise ConfigError(f"got {describe(self.name)}; need a non-empty string (the run name)", path="name")
        if any(sep in self.name for sep in "/\\") or self.name in (".", ".."):
            raise ConfigError(
                f"got {self.name!r}; a run name cannot contain '/' or '\\' or be '.' or '..'; "
                f"set the directory with run.dir instead",
                path="name",
            )
        if isinstance(self.dir, os.PathLike):
            object.__setattr__(self, "dir", os.fspath(self.dir))
        if not isinstance(self.dir, str):
            raise ConfigError(f"got {describe(self.dir)}; need a directory path string", path="dir")
        if not self.dir:
            object.__setattr__(self, "dir", f"runs/{self.name}")
        if self.read_results not in READ_RESULTS:
            raise ConfigError(f"got {describe(self.read_results)}{suggest(self.read_results, READ_RESULTS)}; need one "
                              f"of {', '.join(READ_RESULTS)}", path="read_results")
        for key in ("close_timeout_s", "interrupt_timeout_s"):
            seconds = getattr(self, key)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
                raise ConfigError(f"got {describe(seconds)}; need a number of seconds >= 0", path=key)
            object.__setattr__(self, key, float(seconds))


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricConfig:
    """One metric to compute: which one, how often, and on which tensors or modules."""

    name: str
    """Catalogue name (``layer-grad-l2``) or a Megatron-LM alias (``global-wgrad-l2``);
    :func:`~tmetrics_core.config.names.check_names` replaces an alias by its canonical name."""
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
    options: dict[str, Any] = field(default_factory=dict)
    """The metric's own options beyond the fields above (a metric from an installed package:
    ``{name: layer-grad-rms-db, reference: 0.01}``), written flat in the entry like ``bins``.
    :func:`~tmetrics_core.config.names.check_names` checks them, with the fields, against the
    options the metric's catalogue entry declares. A key close to ``name``, ``interval``,
    ``select``, ``modules`` or ``optional`` is read as a misspelling of it and refused when the
    entry is read."""

    def option_values(self) -> dict[str, Any]:
        """The options this entry sets, by name (fields left at their default are not set),
        as ``build_metric`` takes them."""
        fields_set = {"select": self.select, "modules": self.modules, "bins": self.bins, "sample": self.sample,
                      "recipe": self.recipe, "format": self.format, "scale_mode": self.scale_mode,
                      "moments": self.moments}
        return {k: v for k, v in fields_set.items() if v not in (None, ())} | self.options

    def __post_init__(self) -> None:
        check_name(self.name, path="name", what="a metric name such as 'layer-grad-l2'")
        check_int(self.interval, path="interval", minimum=1, meaning="steps between two computations")
        object.__setattr__(self, "select", glob_list(self.select, path="select", of="canonical tensor names"))
        object.__setattr__(self, "modules", glob_list(self.modules, path="modules", of="canonical module names"))
        if self.bins is not None:
            check_int(self.bins, path="bins", minimum=1, meaning="number of histogram bins")
        if self.sample is not None:
            check_int(self.sample, path="sample", minimum=1, meaning="elements sampled per tensor")
        recipes = (self.recipe,) if isinstance(self.recipe, str) else self.recipe
        if not isinstance(recipes, (tuple, list)) or not all(isinstance(r, str) and r for r in recipes):
            raise ConfigError(f"got {describe(self.recipe)}; need a recipe name or a list of them "
                              "(fp8-tensorwise, fp8-rowwise, fp8-block, mxfp8, nvfp4)", path="recipe")
        object.__setattr__(self, "recipe", tuple(recipes))
        moments = (self.moments,) if isinstance(self.moments, str) else self.moments
        if not isinstance(moments, (list, tuple)) or not set(moments) <= {"exp_avg", "exp_avg_sq"}:
            raise ConfigError(f"got {describe(self.moments)}; need a list of exp_avg (first moment) and "
                              "exp_avg_sq (second moment)", path="moments")
        object.__setattr__(self, "moments", tuple(moments))
        if not isinstance(self.optional, bool):
            raise ConfigError(f"got {describe(self.optional)}; need true or false", path="optional")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"got {describe(self.options)}; need a mapping of option names to values", path="options")
        for key in self.options:
            if not isinstance(key, str) or not key.isidentifier() or key in _ENTRY_KEYS:
                raise ConfigError(f"option name {describe(key)} is not a plain key (letters, digits, '_') other "
                                  f"than {', '.join(_ENTRY_KEYS)}",
                                  path=child_path("", key) if isinstance(key, str) else "options")
        object.__setattr__(self, "options", copy.deepcopy(dict(self.options)))


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
                f"got {timeout if is_number else describe(timeout)}; need a number of seconds > 0 "
                f"(how long one collective may take)",
                path="collective_timeout_s",
            )
        object.__setattr__(self, "collective_timeout_s", float(timeout))
        if self.check_plan not in _CHECK_PLANS:
            raise ConfigError(
                f"got {describe(self.check_plan)}{suggest(self.check_plan, _CHECK_PLANS)}; "
                f"need one of {', '.join(_CHECK_PLANS)}",
                path="check_plan",
            )
        if self.verify_replicas not in _VERIFY_REPLICAS:
            raise ConfigError(
                f"got {describe(self.verify_replicas)}{suggest(self.verify_replicas, _VERIFY_REPLICAS)}; "
                f"need one of {', '.join(_VERIFY_REPLICAS)}",
                path="verify_replicas",
            )
        check_int(self.log_rank, path="log_rank", minimum=0, meaning="the global rank that writes to the sinks")



def parse_metric_spec(spec: str | Mapping[str, Any], *, path: str) -> MetricConfig:
    """Parse one metric entry: ``"NAME"``, ``"NAME:INTERVAL"`` or a mapping of
    :class:`MetricConfig` fields (``name`` required).

    Args:
        spec: the entry.
        path: where the entry sits in the config (``"metrics[2]"``), prefixed to error paths.

    Raises:
        ConfigError: wrong type, several metrics in one string, an interval that is not a whole
            number >= 1, a missing ``name``, or an unknown key close to a key every entry may have
            (``intervall``); other unknown keys are the metric's own options (``options``).
    """
    if isinstance(spec, str):
        values = _split_spec(spec.strip(), path=path)
    elif isinstance(spec, Mapping):
        own = {k: v for k, v in spec.items() if isinstance(k, str) and k not in _ENTRY_KEYS
               and not difflib.get_close_matches(k, _GENERAL_KEYS)}
        values = keys_of({k: v for k, v in spec.items() if k not in own}, path=path, valid=_ENTRY_KEYS)
        if own:
            values["options"] = own
        if "name" not in values:
            raise ConfigError(
                "missing key 'name'; give the metric name, e.g. {name: layer-grad-l2, interval: 10}", path=path
            )
    else:
        raise ConfigError(
            f"got {describe(spec)}; need 'NAME:INTERVAL' (e.g. 'layer-grad-l2:10') or a mapping with "
            f"keys {', '.join(_ENTRY_KEYS)} or the metric's own options",
            path=path,
        )
    with under(path):
        return MetricConfig(**values)


_ENTRY_KEYS = tuple(name for name in field_names(MetricConfig) if name != "options")
"""The keys of a metric entry that are :class:`MetricConfig` fields; others are its own options."""
_GENERAL_KEYS = ("name", "interval", "select", "modules", "optional")
"""Keys every entry may have: an unknown key close to one of them is a misspelling, not an option."""


def _split_spec(spec: str, *, path: str) -> dict[str, Any]:
    if SPEC_SEPARATORS.search(spec):
        raise ConfigError(
            f"got {spec!r}; one entry holds one metric: put each in its own list entry, or write "
            f"`metrics` as one string of space-separated 'NAME:INTERVAL' items",
            path=path,
        )
    name, colon, interval = spec.partition(":")
    if not colon:
        return {"name": name}
    if not WHOLE_NUMBER.fullmatch(interval):
        raise ConfigError(
            f"got {spec!r}; write NAME or NAME:INTERVAL with INTERVAL a whole number of steps >= 1, "
            f"e.g. '{name or 'layer-grad-l2'}:100'",
            path=path,
        )
    return {"name": name, "interval": int(interval)}

