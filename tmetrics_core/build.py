"""Building a :class:`~tmetrics_core.tensor_metrics.TensorMetrics` from a config.

Everything a config can get wrong is checked here, before the first step: names against the
catalogue and the installed sinks, sink options by each sink's constructor (on every rank, so
no rank proceeds into a collective that a failing rank never joins), the topology, and then
(:mod:`~tmetrics_core.scope.startup_checks`, run by ``TensorMetrics``) selections and placements
against the model.

Frameworks are read through their adapters (:mod:`tmetrics_core.integrations.adapter`), taken
in the order of :data:`~tmetrics_core.integrations.frameworks.FRAMEWORKS`: each unwraps the
user's objects, the first that knows the topology gives it, and each detected one hands over
placements, offsets, its optimizer adapter, flat buffers and handles. The class built is the
``cls`` given (``TensorMetrics``), not imported for building.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from tmetrics_core.alerts.engine import AlertEngine
from tmetrics_core.topology import Topology
from tmetrics_core.config.names import check_names
from tmetrics_core.config.schema import Config, load_config, override_sinks
from tmetrics_core.errors import ConfigError
from tmetrics_core.hub.sink_hub import NullHub, SinkHub
from tmetrics_core.integrations.adapter import FrameworkAdapter, Prepared
from tmetrics_core.integrations.frameworks import FRAMEWORKS
from tmetrics_core.metrics.catalogue import build_metric, metric_names, metric_options, resolve_metric
from tmetrics_core.records import RunInfo
from tmetrics_core.reporter import Reporter
from tmetrics_core.config.redact import redact
from tmetrics_core.sinks.registry import available_sinks, build_sinks
from tmetrics_core.sinks.trackers import tracker_sinks

__all__ = ["NO_SINKS", "build_from_config", "join_trackers", "topology_for"]

NO_SINKS = ("names no sinks: the records go nowhere but TensorMetrics.last_records; add one, e.g. "
            "sinks: {jsonl: {}} (a file in the run directory) or sinks: [tensorboard]")
"""What ``from_config`` (a warning on the logging rank) and ``tmetrics validate`` say of a config
without sinks: accepted, since a program may read ``last_records`` itself, but never silently."""


def topology_for(mesh: Any = None, axes: Mapping[str, Any] | None = None, model: Any = None, optimizer: Any = None,
                 *, timeout_s: float = 60.0) -> Topology:
    """The topology of the run, from the first framework adapter that knows it
    (:data:`~tmetrics_core.integrations.frameworks.FRAMEWORKS`): a DeepSpeed engine's or
    Megatron-Core's parallel state (unless ``mesh=`` or ``axes=`` is given), torchtitan's
    ``ParallelDims`` (``mesh``) or the meshes of ``model``'s parameters when every one is a
    DTensor; else a DeviceMesh (``mesh``), an ``{axis: process group}`` mapping (``axes``), or one
    process.

    Raises:
        ConfigError: both ``mesh`` and ``axes`` given; torch.distributed runs several ranks but
            nothing says how (tmetrics cannot guess which ranks hold replicas and which hold
            shards); or what an adapter refuses.
    """
    model, optimizer = _unwrapped(model, optimizer)
    return _topology(_detected(model, optimizer, mesh), model, optimizer, mesh, axes, timeout_s)


def _unwrapped(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """``model`` and ``optimizer`` out of every framework's wrappers, adapter after adapter."""
    for adapter in FRAMEWORKS:
        model, optimizer = adapter.unwrap(model, optimizer)
    return model, optimizer


def _detected(model: Any, optimizer: Any, mesh: Any) -> list[FrameworkAdapter]:
    """The adapters whose framework ``model``, ``optimizer`` or ``mesh`` come from, in order (the
    generic one last, always)."""
    return [adapter for adapter in FRAMEWORKS if adapter.detect(model, optimizer, mesh)]


def _topology(adapters: Sequence[FrameworkAdapter], model: Any, optimizer: Any, mesh: Any,
              axes: Mapping[str, Any] | None, timeout_s: float) -> Topology:
    if mesh is not None and axes is not None:
        raise ConfigError("pass either mesh= or axes=, not both")
    for adapter in adapters:
        found = adapter.topology(model, optimizer, mesh, axes, timeout_s=timeout_s)
        if found is not None:
            return found
    raise AssertionError("the generic adapter always gives a topology")


def _prepare(adapters: Sequence[FrameworkAdapter], model: Any, optimizer: Any, topology: Topology) -> list[Prepared]:
    """What each adapter hands over, each given the model and optimizer the previous one
    prepared; the handles of those done are removed when one fails."""
    done: list[Prepared] = []
    try:
        for adapter in adapters:
            done.append(adapter.prepare(model, optimizer, topology))
            model, optimizer = done[-1].model, done[-1].optimizer
    except BaseException:
        _remove(done)
        raise
    return done


def _framework_arguments(prepared: Sequence[Prepared]) -> dict[str, Any]:
    """``TensorMetrics`` keyword arguments from the adapters: placements, offsets, flat buffers."""
    out: dict[str, Any] = {}
    placements = {name: spec for p in prepared for name, spec in p.placements.items()}
    if placements:
        out["framework_placements"] = placements
    offsets = next((p.offsets for p in prepared if p.offsets is not None), None)
    if offsets is not None:
        out["layer_offset"], out["expert_offset"] = offsets
    flat = [buffer for p in prepared for buffer in p.flat_buffers]
    if flat:
        out["flat_buffers"] = flat
    return out


def _remove(prepared: Sequence[Prepared]) -> None:
    for p in prepared:
        for handle in p.handles:
            handle.remove()


_OVERRIDES: dict[str, tuple[str, str]] = {
    "check_plan": ("distributed", "check_plan"),
    "verify_replicas": ("distributed", "verify_replicas"),
    "timeout_s": ("distributed", "collective_timeout_s"),
    "log_rank": ("distributed", "log_rank"),
    "read_results": ("run", "read_results"),
}
"""Keyword arguments of ``TensorMetrics`` that ``from_config`` also reads from the config: passed
to ``from_config``, each replaces its config key (``section.key``)."""

_BUILT = ("metrics", "topology", "hub", "run", "modules", "key_rules", "placements")
"""Arguments ``from_config`` builds from the config, the model and the mesh itself."""


def _with_overrides(config: Config, kwargs: dict[str, Any]) -> Config:
    """``config`` with the values of :data:`_OVERRIDES` taken out of ``kwargs`` put in their
    keys, checked as the config's own values are.

    Raises:
        ConfigError: an override the config refuses (named by its key), or an argument that
            ``from_config`` builds itself (:data:`_BUILT`).
    """
    built = [name for name in _BUILT if name in kwargs]
    if built:
        raise ConfigError(f"from_config(..., {'=, '.join(built)}=) given: from_config builds {', '.join(built)} "
                          "from the config, the model and the mesh. Set them in the config (metrics:, sinks:, "
                          "placements:, a metric's modules:) or build TensorMetrics(...) directly to pass them")
    given = {name: kwargs.pop(name) for name in list(kwargs) if name in _OVERRIDES}
    if not given:
        return config
    data = config.to_dict()
    for name, value in given.items():
        section, key = _OVERRIDES[name]
        data.setdefault(section, {})[key] = value
    try:
        return load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (given to from_config as {', '.join(f'{n}={v!r}' for n, v in given.items())})"
                          ) from exc


def join_trackers(config: Config, trackers: Sequence[Any]) -> Config:
    """``config`` with a sink writing into each tracker's run (:func:`~tmetrics_core.sinks.trackers.tracker_sinks`),
    added to the configured sinks or set on the one of that name (its other options kept).

    Raises:
        ConfigError: see :func:`~tmetrics_core.sinks.trackers.tracker_sinks`.
    """
    sinks = {name: dict(options or {}) for name, options in config.sinks.items()}
    for name, options in tracker_sinks(trackers).items():
        sinks[name] = {**sinks.get(name, {}), **options}
    return dataclasses.replace(config, sinks=sinks)


def _check_keywords(cls: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword neither ``from_config`` nor ``cls`` takes, with the nearest one, before
    anything starts (it raised ``cls``'s own ``TypeError`` after the sinks had started).

    Raises:
        ConfigError: the first unknown keyword.
    """
    known = set(inspect.signature(cls.__init__).parameters) - {"self", "model"}
    known |= {"optimizer", "mesh", "axes", "sinks", "run_dir", "trackers"}
    for name in kwargs:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known - set(_BUILT)), n=1)
            raise ConfigError(f"from_config() got an unknown keyword argument {name!r}"
                              f"{f' (did you mean {near[0]!r}?)' if near else ''}; it takes model=, optimizer=, "
                              f"mesh=, axes=, sinks=, run_dir= and {', '.join(f'{k}=' for k in _OVERRIDES)}, and "
                              "TensorMetrics' other keyword arguments")


def build_from_config(cls: Any, source: Any, *, model: torch.nn.Module, optimizer: Any = None, mesh: Any = None,
                      axes: Mapping[str, Any] | None = None, sinks: str | Sequence[str] | None = None,
                      run_dir: str | os.PathLike[str] | None = None, trackers: Sequence[Any] = (),
                      **kwargs: Any) -> Any:
    """See :meth:`TensorMetrics.from_config`."""
    config = source if isinstance(source, Config) else load_config(source)
    _check_keywords(cls, kwargs)
    config = _with_overrides(config, kwargs)
    if sinks:
        config = override_sinks(config, sinks)
    if trackers:
        config = join_trackers(config, trackers)
    if run_dir is not None:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=os.fspath(run_dir)))
    config = check_names(config, resolve_metric=resolve_metric, metric_names=metric_names(),
                         sink_names=[name for name, _ in available_sinks()], metric_options=metric_options)
    model, optimizer = _unwrapped(model, optimizer)
    adapters = _detected(model, optimizer, mesh)
    topology = _topology(adapters, model, optimizer, mesh, axes, config.distributed.collective_timeout_s)
    prepared = _prepare(adapters, model, optimizer, topology)
    model, optimizer = prepared[-1].model, prepared[-1].optimizer
    for key, value in _framework_arguments(prepared).items():
        kwargs.setdefault(key, value)
    try:
        tracker = _construct(cls, config, model, optimizer, topology, prepared, kwargs)
    except BaseException:
        _remove(prepared)
        raise
    for p in prepared:
        tracker._hooks.extend(p.handles)  # removed by close() with the optimizer hooks
        if p.attach is not None:
            tracker._hooks.extend(p.attach(tracker))
    return tracker


def _construct(cls: Any, config: Config, model: Any, optimizer: Any, topology: Topology,
               prepared: Sequence[Prepared], kwargs: dict[str, Any]) -> Any:
    """``cls(...)`` with the metrics, sinks and run of ``config``, inside every adapter's
    ``constructing`` context."""
    metrics = []
    for i, mc in enumerate(config.metrics):
        try:
            metric = build_metric(mc.name, **mc.option_values())
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"metrics[{i}]") from exc
        metrics.append((metric, mc.interval))
    built = build_sinks(config.sinks)
    reporter = Reporter(topology, config.distributed.log_rank)  # the logging rank warns and owns the sinks
    if not config.sinks:
        reporter.warning("tmetrics: the config %s", NO_SINKS)
    run_path = Path(config.run.dir)
    if reporter.speaks and (run_path / "manifest.json").exists():
        reporter.warning("run directory %s already holds a run (its manifest.json): file sinks add to it (jsonl "
                         "lines after the earlier ones, a second TensorBoard event file: overlapping curves) and "
                         "trackers open another run named %r; pass run_dir= (--run-dir) for a fresh directory",
                         run_path, config.run.name)
    hub = (SinkHub(built, spool_dir=run_path / "spool", alerts=AlertEngine(config.alerts),
                   close_timeout=config.run.close_timeout_s,
                   interrupt_timeout=config.run.interrupt_timeout_s)
           if reporter.speaks else NullHub())
    run = RunInfo(name=config.run.name, dir=str(run_path), config=redact(config.to_dict()),
                  tags={"model": type(model).__name__, **topology.tags()},
                  metrics=tuple(m.name for m, _ in metrics))
    modules = {mc.name: mc.modules for mc in config.metrics if mc.modules}
    with contextlib.ExitStack() as stack:
        for p in prepared:
            stack.enter_context(p.constructing())  # ZeRO 3: the parameters gathered, for their shapes
        return cls(model, metrics=metrics, optimizer=optimizer, topology=topology, hub=hub, run=run,
                   check_plan=config.distributed.check_plan,
                   verify_replicas=config.distributed.verify_replicas, placements=config.placements,
                   timeout_s=config.distributed.collective_timeout_s, modules=modules,
                   key_rules={sink.name: sink.key_rules for sink in built},
                   log_rank=config.distributed.log_rank, read_results=config.run.read_results,
                   optional_metrics=frozenset(mc.name for mc in config.metrics if mc.optional), **kwargs)
