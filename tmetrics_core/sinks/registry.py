"""The ``MetricSink`` protocol and entry-point discovery of sinks.

A sink is one small class with a ``name``, its key rules, the backend modules it needs and five
methods. Sinks are registered under the entry-point group ``tmetrics.sinks``; listing them
reads package metadata only, and only the sinks a config names are imported, so a broken,
merely installed plugin cannot stop training (pytest's lesson: one bad installed plugin there
stops every run). A named sink that fails to load raises with its name and distribution,
chained ``from`` the original error.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import inspect
from typing import Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from tmetrics_core.alerts.alert import Alert
from tmetrics_core.errors import ConfigError, SinkError
from tmetrics_core.sinks.keys import KeyRules
from tmetrics_core.records import MetricRecord, RunInfo, RunStatus

__all__ = [
    "ENTRY_POINT_GROUP",
    "AlertWriter",
    "MetricSink",
    "RemoteSink",
    "available_sinks",
    "build_sinks",
    "load_sink_class",
]

ENTRY_POINT_GROUP = "tmetrics.sinks"
"""The entry-point group a package uses to add a sink: ``[project.entry-points."tmetrics.sinks"]``."""

_MEMBERS = ("name", "key_rules", "requires", "open", "log_config", "write", "flush", "close")
_METHODS = ("open", "log_config", "write", "flush", "close")


@runtime_checkable
class MetricSink(Protocol):
    """Writes finished records to one backend. Runs on the logging rank only, on its own worker
    thread (see ``tmetrics_core.hub.sink_hub``), so a method may block without stalling training.

    ``name``, ``key_rules`` and ``requires`` are class attributes (checked when the class is
    loaded). Construction takes the sink's options from the config (``sinks: {tensorboard:
    {...}}``) as keyword arguments and raises :class:`~tmetrics_core.errors.ConfigError` for an
    invalid option value; it must not touch the backend yet (that happens in ``open``).
    """

    name: ClassVar[str]
    """The entry-point name, e.g. ``"tensorboard"``; also names the sink's spool file."""

    key_rules: ClassVar[KeyRules]
    """The backend's key rules (``tmetrics_core.sinks.keys``), for configuration-time collision checks."""

    requires: ClassVar[tuple[str, ...]]
    """Top-level modules ``open`` imports (``("mlflow",)``); checked at load time, so a missing
    backend package is a configuration error naming the extra to install, not a retry loop."""

    def open(self, run: RunInfo) -> None:
        """Start the backend run (import the backend library here). May raise; the hub retries."""
        ...

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run config once (params, hyper-parameters). Secrets are already redacted."""
        ...

    def write(self, records: Sequence[MetricRecord], step: int) -> None:
        """Write every record of one step. Raising means none of them was written."""
        ...

    def flush(self) -> None:
        """Push buffered data to durable storage."""
        ...

    def close(self, status: RunStatus) -> None:
        """Flush and end the backend run with ``status``."""
        ...


@runtime_checkable
class AlertWriter(Protocol):
    """What a sink adds to show alerts natively: one optional method, so a sink written before
    alerts existed still loads and works (it just does not show them). The hub's worker calls it
    right after a successful ``write`` of the same step, with the same retries; alerts it fails to
    take go to the spool, and training never waits for it."""

    def write_alerts(self, alerts: Sequence[Alert], step: int) -> None:
        """Show the alerts raised at ``step`` (``open`` and ``closed`` events, the step's first
        opening first). Raising means none of them was shown."""
        ...


@runtime_checkable
class RemoteSink(Protocol):
    """What a sink whose backend is a server adds: one optional method, so that an unreachable
    server is said within seconds. Its client library may retry a refused connection for
    minutes inside ``open`` (MLflow's HTTP client does: 4 min before the first error); the hub's
    worker calls ``probe`` before each ``open`` attempt and skips the attempt while it raises."""

    def probe(self, timeout: float) -> None:
        """One connection attempt to the backend, at most ``timeout`` seconds, no retries.

        Raises:
            SinkError: the backend cannot be reached; the message names it and the cause.
        """
        ...


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _distribution_name(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return dist.name if dist is not None else "<unknown distribution>"


def available_sinks() -> list[tuple[str, str]]:
    """Every installed sink as ``(name, distribution)``, sorted; reads metadata, imports nothing.

    A name registered by two distributions appears twice (loading it then raises).
    """
    return sorted((ep.name, _distribution_name(ep)) for ep in _entry_points())


def load_sink_class(name: str) -> type[MetricSink]:
    """Import the one sink registered as ``name`` and check it.

    Only that entry point is imported. The class must have every :class:`MetricSink` member
    and a ``name`` equal to its entry-point name.

    Raises:
        ConfigError: no sink has that name (the message lists the installed names and close
            matches); two distributions register it (both named); or a backend package the
            sink needs is missing (the message gives the ``pip install`` line with the extra).
        SinkError: the entry point failed to import for another reason, or the class lacks
            members; ``sink`` is the name, the message names the distribution, and the original
            error is chained as ``__cause__``.
    """
    path = f"sinks.{name}"
    entry_points = _entry_points()
    matches = [ep for ep in entry_points if ep.name == name]
    if not matches:
        names = sorted({ep.name for ep in entry_points})
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(
            f"unknown sink {name!r}; installed sinks: {', '.join(names) or 'none'}{hint} "
            f"A third-party sink must be installed and registered under the entry-point group "
            f"{ENTRY_POINT_GROUP!r}.",
            path=path,
        )
    if len(matches) > 1:
        owners = ", ".join(f"{_distribution_name(ep)} ({ep.value})" for ep in matches)
        raise ConfigError(
            f"sink name {name!r} is registered by more than one distribution: {owners}; uninstall one of them",
            path=path,
        )
    entry_point = matches[0]
    dist = _distribution_name(entry_point)
    try:
        cls = entry_point.load()
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and missing.split(".")[0] != entry_point.module.split(".")[0]:
            raise ConfigError(_missing_backend(name, entry_point, missing), path=path) from error
        raise SinkError(_load_failure(name, entry_point, error), sink=name) from error
    except Exception as error:
        raise SinkError(_load_failure(name, entry_point, error), sink=name) from error

    problems = _class_problems(name, cls)
    if problems:
        raise SinkError(
            f"sink {name!r} from distribution {dist!r} ({entry_point.value}) is not a valid "
            f"MetricSink: {'; '.join(problems)}",
            sink=name,
        )
    for module in cls.requires:
        if not _module_exists(module):
            raise ConfigError(_missing_backend(name, entry_point, module), path=path)
    return cls


def build_sinks(spec: Mapping[str, Mapping[str, Any] | None]) -> list[MetricSink]:
    """Construct the sinks a config names, each with its options, in mapping order.

    ``spec`` is the config's ``sinks:`` mapping, e.g. ``{"tensorboard": {}, "mlflow":
    {"experiment": "demo"}}``; ``None`` options mean none. Every problem is collected and
    reported at once.

    Raises:
        ConfigError: an unknown sink, a missing backend, options that are not a mapping, an
            option the sink's constructor does not take (the valid options are listed), or an
            option value the constructor rejects. Several problems are joined in one error.
        SinkError: a sink failed to import or construct for a reason other than its options.
    """
    sinks: list[MetricSink] = []
    problems: list[ConfigError] = []
    for name, options in spec.items():
        path = f"sinks.{name}"
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            problems.append(
                ConfigError(f"options must be a mapping of option names to values; got {options!r}", path=path)
            )
            continue
        try:
            cls = load_sink_class(name)
        except ConfigError as error:
            problems.append(error)
            continue
        try:
            signature = inspect.signature(cls)
            signature.bind(**options)
        except TypeError as error:
            valid = [
                p.name
                for p in signature.parameters.values()
                if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
            ]
            problems.append(ConfigError(f"{error}; valid options: {', '.join(valid) or 'none'}", path=path))
            continue
        try:
            sinks.append(cls(**options))
        except ConfigError as error:
            problems.append(error)
        except Exception as error:
            raise SinkError(
                f"sink {name!r} failed to construct with options {dict(options)!r}: {error}", sink=name
            ) from error
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n  " + "\n  ".join(str(p) for p in problems), path="sinks")
    return sinks


def _load_failure(name: str, entry_point: importlib.metadata.EntryPoint, error: BaseException) -> str:
    return (
        f"sink {name!r} from distribution {_distribution_name(entry_point)!r} failed to load "
        f"({entry_point.value}): {type(error).__name__}: {error}. Reinstall or upgrade that "
        f"distribution, or remove {name!r} from the config's sinks."
    )


def _class_problems(name: str, cls: Any) -> list[str]:
    if not isinstance(cls, type):
        return [f"the entry point gives {cls!r}, not a class"]
    problems = [f"missing {member!r}" for member in _MEMBERS if not hasattr(cls, member)]
    problems += [
        f"{method!r} is not callable"
        for method in _METHODS
        if hasattr(cls, method) and not callable(getattr(cls, method))
    ]
    if hasattr(cls, "name") and cls.name != name:
        problems.append(f"class attribute name={cls.name!r} differs from the entry-point name {name!r}")
    if hasattr(cls, "key_rules") and not isinstance(cls.key_rules, KeyRules):
        problems.append(f"key_rules must be a tmetrics_core.sinks.keys.KeyRules; got {cls.key_rules!r}")
    if hasattr(cls, "requires") and not (
        isinstance(cls.requires, tuple) and all(isinstance(m, str) for m in cls.requires)
    ):
        problems.append(f"requires must be a tuple of module names; got {cls.requires!r}")
    return problems


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing_backend(name: str, entry_point: importlib.metadata.EntryPoint, module: str) -> str:
    top = module.split(".")[0]
    extra = _extra_providing(name, entry_point.dist, top)
    dist = _distribution_name(entry_point)
    install = f'pip install "{dist}[{extra}]"' if extra else f"pip install {top}"
    return f"sink {name!r} needs the Python package {top!r}, which is not installed; install it with: {install}"


def _extra_providing(name: str, dist: importlib.metadata.Distribution | None, module: str) -> str | None:
    """The extra of ``dist`` that requires a distribution named like ``module``; the extra named
    like the sink wins when several do (``matplotlib`` is in both ``wandb`` and ``mlflow``)."""
    if dist is None:
        return None
    wanted = canonicalize_name(module)
    extras = dist.metadata.get_all("Provides-Extra") or []
    found: list[str] = []
    for line in dist.requires or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != wanted or requirement.marker is None:
            continue
        found += [e for e in extras if e not in found and requirement.marker.evaluate({"extra": e})]
    if not found:
        return None
    return name if name in found else found[0]
