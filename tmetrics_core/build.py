"""Building a :class:`~tmetrics_core.tensor_metrics.TensorMetrics` from a config.

Everything a config can get wrong is checked here, before the first step: names against the
catalogue and the installed sinks, sink options by each sink's constructor (on every rank, so
no rank proceeds into a collective that a failing rank never joins), the topology, and then
(in ``TensorMetrics``) selections and placements against the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
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

_log = logging.getLogger("tmetrics")

__all__ = ["build_from_config", "topology_for"]


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


def build_from_config(cls: Any, source: Any, *, model: torch.nn.Module, optimizer: Any = None, mesh: Any = None,
                      axes: Mapping[str, Any] | None = None, sinks: str | Sequence[str] | None = None,
                      run_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """See :meth:`TensorMetrics.from_config`."""
    config = source if isinstance(source, Config) else load_config(source)
    if sinks:
        config = override_sinks(config, sinks)
    if run_dir is not None:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=os.fspath(run_dir)))
    config = check_names(config, resolve_metric=resolve_metric, metric_names=metric_names(),
                         sink_names=[name for name, _ in available_sinks()])
    topology = topology_for(mesh, axes, model)
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
                                  sample=mc.sample)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"metrics[{i}]") from exc
        metrics.append((metric, mc.interval))
    built = build_sinks(config.sinks)
    logging_rank = topology.logs(config.distributed.log_rank)
    run_path = Path(config.run.dir)
    if logging_rank and (run_path / "manifest.json").exists():
        _log.warning("run directory %s already holds a run (its manifest.json): file sinks add to it (jsonl lines "
                     "after the earlier ones, a second TensorBoard event file: overlapping curves) and trackers "
                     "open another run named %r; pass run_dir= (--run-dir) for a fresh directory",
                     run_path, config.run.name)
    hub = (SinkHub(built, spool_dir=run_path / "spool", alerts=AlertEngine(config.alerts)) if logging_rank
           else NullHub())
    run = RunInfo(name=config.run.name, dir=str(run_path), config=redact(config.to_dict()),
                  tags={"model": type(model).__name__, **topology.tags()},
                  metrics=tuple(m.name for m, _ in metrics))
    modules = {mc.name: mc.modules for mc in config.metrics if mc.modules}
    try:
        tracker = cls(model, metrics=metrics, optimizer=optimizer, topology=topology, hub=hub, run=run,
                      check_plan=config.distributed.check_plan,
                      verify_replicas=config.distributed.verify_replicas, placements=config.placements,
                      timeout_s=config.distributed.collective_timeout_s, modules=modules,
                      key_rules={sink.name: sink.key_rules for sink in built},
                      log_rank=config.distributed.log_rank, **kwargs)
    except BaseException:
        for handle in found.handles if megatron is not None else ():
            handle.remove()
        raise
    if megatron is not None:
        tracker._hooks.extend(found.handles)  # removed by close() with the optimizer hooks
    return tracker


def _megatron() -> Any:
    """The Megatron-Core integration module when Megatron is imported and its parallel state
    initialized, else None (imported lazily: integrations sit above this module)."""
    from tmetrics_core.integrations import megatron

    return megatron if megatron.active() else None
