"""Building a :class:`~tmetrics_core.tensor_metrics.TensorMetrics` from a config.

Everything a config can get wrong is checked here, before the first step: names against the
catalogue and the installed sinks, sink options by each sink's constructor (on every rank, so
no rank proceeds into a collective that a failing rank never joins), the topology, and then
(:mod:`~tmetrics_core.startup_checks`, run by ``TensorMetrics``) selections and placements
against the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from tmetrics_core.alerts.engine import AlertEngine
from tmetrics_core.topology import Topology
from tmetrics_core.config.schema import Config, check_names, load_config, override_sinks
from tmetrics_core.errors import ConfigError
from tmetrics_core.hub.sink_hub import NullHub, SinkHub
from tmetrics_core.metrics.catalogue import build_metric, metric_names, resolve_metric
from tmetrics_core.records import RunInfo
from tmetrics_core.config.redact import redact
from tmetrics_core.sinks.registry import available_sinks, build_sinks
from tmetrics_core.sinks.trackers import tracker_sinks

_log = logging.getLogger("tmetrics")

__all__ = ["NO_SINKS", "build_from_config", "join_trackers", "topology_for"]

NO_SINKS = ("names no sinks: the records go nowhere but TensorMetrics.last_records; add one, e.g. "
            "sinks: {jsonl: {}} (a file in the run directory) or sinks: [tensorboard]")
"""What ``from_config`` (a warning on the logging rank) and ``tmetrics validate`` say of a config
without sinks: accepted, since a program may read ``last_records`` itself, but never silently."""


def topology_for(mesh: Any = None, axes: Mapping[str, Any] | None = None, model: Any = None) -> Topology:
    """The topology, from the first of: a DeviceMesh or torchtitan's ``ParallelDims`` (``mesh``),
    an ``{axis: process group}`` mapping (``axes``), Megatron-Core's initialized parallel state
    (``model`` tells its sequence parallelism), the meshes of ``model``'s parameters when every
    one is a DTensor; else one process. Raises ``ConfigError`` when torch.distributed runs
    several ranks but none of these says how (tmetrics cannot guess which ranks hold replicas
    and which hold shards)."""
    from tmetrics_core.integrations import torchtitan

    if mesh is not None and axes is not None:
        raise ConfigError("pass either mesh= or axes=, not both")
    if torchtitan.is_parallel_dims(mesh):
        return torchtitan.parallel_dims_topology(mesh)
    if mesh is not None:
        return Topology.from_mesh(mesh)
    if axes is not None:
        return Topology.from_groups(axes)
    megatron = _megatron()
    if megatron is not None:
        return megatron.topology(model)
    found = torchtitan.parameter_topology(model) if isinstance(model, torch.nn.Module) else None
    if found is not None and found.world_size > 1:
        return found
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            f"torch.distributed runs {dist.get_world_size()} ranks but no topology was given; pass "
            "mesh=<DeviceMesh with dim names, or torchtitan's ParallelDims> or "
            "axes={'dp': process_group, ...} (plain DDP: "
            "axes={'dp': torch.distributed.group.WORLD})"
        )
    return Topology.single_process()


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
                         sink_names=[name for name, _ in available_sinks()])
    deepspeed = _deepspeed(model, optimizer)  # its engine gives model, optimizer and topology
    if deepspeed is not None and mesh is None and axes is None:
        topology = deepspeed.topology()
    else:
        topology = topology_for(mesh, axes, model)
    speed = None
    if deepspeed is not None:
        speed = deepspeed.setup(topology)
        model, optimizer = speed.model, speed.optimizer
        if speed.flat_buffers:
            kwargs.setdefault("flat_buffers", speed.flat_buffers)
    megatron = _megatron()
    if megatron is not None:
        found = megatron.setup(model, optimizer, topology)
        model, optimizer = found.model, found.optimizer
        kwargs.setdefault("framework_placements", found.placements)
        kwargs.setdefault("layer_offset", found.layer_offset)
        kwargs.setdefault("expert_offset", found.expert_offset)
        if found.flat_buffers:
            kwargs.setdefault("flat_buffers", found.flat_buffers)
    metrics = []
    for i, mc in enumerate(config.metrics):
        try:
            metric = build_metric(mc.name, select=mc.select or None, modules=mc.modules or None, bins=mc.bins,
                                  sample=mc.sample, recipe=mc.recipe or None, format=mc.format,
                                  scale_mode=mc.scale_mode, moments=mc.moments or None)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"metrics[{i}]") from exc
        metrics.append((metric, mc.interval))
    built = build_sinks(config.sinks)
    logging_rank = topology.logs(config.distributed.log_rank)
    if logging_rank and not config.sinks:
        _log.warning("tmetrics: the config %s", NO_SINKS)
    run_path = Path(config.run.dir)
    if logging_rank and (run_path / "manifest.json").exists():
        _log.warning("run directory %s already holds a run (its manifest.json): file sinks add to it (jsonl lines "
                     "after the earlier ones, a second TensorBoard event file: overlapping curves) and trackers "
                     "open another run named %r; pass run_dir= (--run-dir) for a fresh directory",
                     run_path, config.run.name)
    hub = (SinkHub(built, spool_dir=run_path / "spool", alerts=AlertEngine(config.alerts),
                   close_timeout=config.run.close_timeout_s,
                   interrupt_timeout=config.run.interrupt_timeout_s)
           if logging_rank else NullHub())
    run = RunInfo(name=config.run.name, dir=str(run_path), config=redact(config.to_dict()),
                  tags={"model": type(model).__name__, **topology.tags()},
                  metrics=tuple(m.name for m, _ in metrics))
    modules = {mc.name: mc.modules for mc in config.metrics if mc.modules}
    try:
        with speed.constructing() if speed is not None else contextlib.nullcontext():  # ZeRO 3: shapes
            tracker = cls(model, metrics=metrics, optimizer=optimizer, topology=topology, hub=hub, run=run,
                          check_plan=config.distributed.check_plan,
                          verify_replicas=config.distributed.verify_replicas, placements=config.placements,
                          timeout_s=config.distributed.collective_timeout_s, modules=modules,
                          key_rules={sink.name: sink.key_rules for sink in built},
                          log_rank=config.distributed.log_rank, read_results=config.run.read_results,
                          optional_metrics=frozenset(mc.name for mc in config.metrics if mc.optional), **kwargs)
    except BaseException:
        for handle in found.handles if megatron is not None else ():
            handle.remove()
        raise
    if megatron is not None:
        tracker._hooks.extend(found.handles)  # removed by close() with the optimizer hooks
    if speed is not None:
        tracker._hooks.extend(speed.attach(tracker))  # ZeRO 3: its partitions copied before due update steps
    return tracker


def _megatron() -> Any:
    """The Megatron-Core integration module when Megatron is imported and its parallel state
    initialized, else None (imported lazily: integrations sit above this module)."""
    from tmetrics_core.integrations import megatron

    return megatron if megatron.active() else None


def _deepspeed(model: Any, optimizer: Any) -> Any:
    """The DeepSpeed run behind ``model`` (its ``DeepSpeedEngine``) or ``optimizer`` (ZeRO's) when
    DeepSpeed is imported, else None (imported lazily: integrations sit above this module)."""
    if "deepspeed" not in sys.modules:
        return None
    from tmetrics_core.integrations import deepspeed

    return deepspeed.found(model, optimizer)
