"""Building a :class:`~tmetrics_core.tensor_metrics.TensorMetrics` from a config.

Everything a config can get wrong is checked here, before the first step: names against the
catalogue and the installed sinks, sink options by each sink's constructor (on every rank, so
no rank proceeds into a collective that a failing rank never joins), the topology, and then
(:func:`check_against_model`, called by ``TensorMetrics``) selections and placements against
the model.

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
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from fnmatch import fnmatchcase

from tmetrics_core.alerts.engine import AlertEngine
from tmetrics_core.topology import Topology
from tmetrics_core.config.names import check_names
from tmetrics_core.config.schema import Config, load_config, override_sinks
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.hub.sink_hub import NullHub, SinkHub
from tmetrics_core.integrations.adapter import FrameworkAdapter, Prepared
from tmetrics_core.integrations.frameworks import FRAMEWORKS
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.catalogue import build_metric, catalogue_entries, metric_names, metric_options, resolve_metric
from tmetrics_core.naming.manifest import Manifest
from tmetrics_core.naming.nearest import nearest
from tmetrics_core.naming.stacks import describe_lists
from tmetrics_core.site import Site
from tmetrics_core.sinks.keys import KeyRules, check_collisions, index_widths
from tmetrics_core.sources.optimizer_state import state_keys
from tmetrics_core.sources.params import OPTIMIZER_KINDS, PARAM_KINDS
from tmetrics_core.kinds import ROUTER_OUTPUT_KINDS
from tmetrics_core.records import Labels, RunInfo
from tmetrics_core.config.redact import redact
from tmetrics_core.sinks.registry import available_sinks, build_sinks
from tmetrics_core.sinks.trackers import tracker_sinks

if TYPE_CHECKING:
    from tmetrics_core.tensor_metrics import TensorMetrics

_log = logging.getLogger("tmetrics")

__all__ = ["NO_SINKS", "build_from_config", "check_against_model", "join_trackers", "topology_for"]

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


def check_against_model(tm: TensorMetrics, key_rules: Mapping[str, KeyRules]) -> None:
    """The start-up checks of :class:`~tmetrics_core.tensor_metrics.TensorMetrics` against its
    model, optimizer and topology: each metric listed once, its source kinds produced, its
    ``select`` and ``modules`` matching something, its placements handled, and no two labels
    rendering to one key of a sink. Whether the model has blocks, a head and each metric's
    modules is agreed across ranks (one small gather), so every rank decides alike.

    A metric in ``tm.optional`` for which the model has no source (router outputs on a dense
    model, no matching module or tensor, no blocks or head, no such optimizer state) is taken
    out of ``tm.metrics`` with one INFO line instead.

    Raises:
        ConfigError: the first check that fails, with the config path (``metrics[i]`` or
            ``sinks.<backend>``) and how to fix it.
    """
    components = {e.component for e in tm.manifest.entries}
    seen: dict[str, int] = {}
    for index, (metric, _) in enumerate(tm.metrics):
        if metric.name in seen:
            raise ConfigError(f"metric {metric.name!r} is listed twice (metrics[{seen[metric.name]}] and "
                              f"metrics[{index}]); list it once with every pattern in one select or modules "
                              "list, e.g. select: ['layers.0.*', 'layers.1.*']", path=f"metrics[{index}]")
        seen[metric.name] = index
    # A pipeline stage may lack the head, the blocks or the modules another stage has: what
    # the model has is agreed across ranks (one small gather), so every rank decides alike.
    present = _present_anywhere(tm)
    skipped = []
    for index, (metric, _) in enumerate(tm.metrics):
        try:
            _check_metric(tm, index, metric, present, components=components)
        except _Absent as exc:
            if metric.name not in tm.optional:
                raise ConfigError(f"{exc.message}; or mark it optional: true to skip it where the model has "
                                  "no such source", path=exc.path) from None
            _log.info("tmetrics: optional metric %r skipped: %s", metric.name, exc.message)
            skipped.append(metric.name)
    if skipped:
        tm.metrics = [(m, i) for m, i in tm.metrics if m.name not in skipped]
        tm.modules = {name: p for name, p in tm.modules.items() if name not in skipped}
    _check_keys(tm, key_rules)


class _Absent(ConfigError):
    """The model has no source for a metric (no router, blocks, head, matching module or
    tensor, or the optimizer state it reads): an optional metric is then skipped."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, path=path)
        self.message = message


def _check_metric(tm: TensorMetrics, index: int, metric: TensorMetric, present: dict[str, Any], *,
                  components: set[Any]) -> None:
    """The start-up checks of one metric (see :func:`check_against_model`).

    Raises:
        _Absent: the model has no source for it.
        ConfigError: any other check that fails.
    """
    path = f"metrics[{index}]"
    kinds = set(metric.source_kinds)
    param_sites = [s for kind in kinds & (PARAM_KINDS | OPTIMIZER_KINDS) for s in tm.manifest.sites(kind)]
    state = kinds & {"exp_avg", "exp_avg_sq"} - set(tm.flat)
    if state and tm.optimizer is None:
        raise _Absent(f"metric {metric.name!r} reads optimizer state; pass optimizer=", path=path)
    if state:
        try:
            state_keys(tm.optimizer, state, metric.name, path)  # refuses an optimizer without that state
        except ConfigError as exc:
            raise _Absent(str(exc).removeprefix(f"{exc.path}: "), path=path) from None
    if kinds & {"update"} and tm.optimizer is None:
        raise _Absent(f"metric {metric.name!r} measures optimizer updates; pass optimizer=",
                      path=path)
    if kinds & {"router_logits", "router_topk", "router_scores"} and "moe.router" not in components:
        raise _Absent(f"metric {metric.name!r} needs MoE router outputs, but the model has no router "
                      "parameter (canonical component moe.router); drop it for a dense model",
                      path=path)
    counts = {r.num_experts for r in tm.routers}
    if kinds & ROUTER_OUTPUT_KINDS and counts and counts != {tm._num_experts}:
        raise ConfigError(f"metric {metric.name!r}: the model's routers score {sorted(counts)} experts "
                          f"each but its expert parameters number {tm.manifest.num_experts} (global "
                          "ids); pass expert_offset= on each expert-parallel rank, or shard the stacked "
                          "expert tensors as DTensors", path=path)
    if kinds & {"residual_accumulator", "residual_contribution", "residual_grad", "residual_input_grad"} \
            and not present["blocks"]:
        raise _Absent(f"metric {metric.name!r} needs the model's blocks (a ModuleList, Sequential or "
                      "integer-keyed ModuleDict of two or more like blocks, under any prefix); in this "
                      f"model, {describe_lists([e.original for e in tm.manifest.entries])}", path=path)
    if kinds & {"logits", "logits_grad"} and not present["head"]:
        raise _Absent(f"metric {metric.name!r} needs the output head (head, lm_head, output or "
                      "output_layer as an nn.Linear); none found", path=path)
    patterns = tm.modules.get(metric.name, ())
    if "activation" in kinds and patterns and not present["modules"].get(metric.name):
        near = nearest(patterns, [*tm.index.canonical.values(), *(p for p, _ in tm.index.named if p)])
        raise _Absent(f"metric {metric.name!r}: modules {list(patterns)} match no module. modules: globs "
                      "take canonical module names, the naming of select: less the leaf (layers.3.attn, "
                      "layers.3.mlp, layers.3.moe; see `tmetrics names`), or the model's module paths; "
                      f"nearest: {near!r}", path=path)
    if "activation_grad" in kinds:
        _check_cotangent_modules(tm, metric, present, path)
    chosen = [s for s in param_sites if metric.accepts(s)]
    if param_sites and not chosen:
        select = tuple(getattr(metric, "select", ()))
        matched = any(not select or any(fnmatchcase(s.name, p) for p in select) for s in param_sites)
        raise (ConfigError if matched else _Absent)(_nothing_chosen(metric, param_sites, tm.manifest), path=path)
    for site in chosen:
        try:
            metric.check(site, tm.topology)
        except PlacementError as exc:
            raise ConfigError(f"metric {metric.name!r} cannot handle {site.describe()}: {exc}",
                              path=path) from exc


def _present_anywhere(tm: TensorMetrics) -> dict[str, Any]:
    """Whether any rank has blocks, a head, modules matching each metric's globs, and (for
    cotangent metrics) matching modules whose outputs may have a cotangent."""
    chosen = tm._token_modules
    graded = [m.name for m, _ in tm.metrics if "activation_grad" in m.source_kinds and m.name in chosen]
    blocks, head, *flags = tm.executor.any_ranks(
        [bool(tm.index.blocks), tm.index.head is not None, *(bool(tm.index.matching(p)) for p in chosen.values()),
         *(bool(_without_cotangent(tm.model, tm.index.matching(chosen[name]))) for name in graded)])
    return {"blocks": blocks, "head": head, "modules": dict(zip(chosen, flags)),
            "no_cotangent": {name: _without_cotangent(tm.model, tm.index.matching(chosen[name]))
                             for name, some in zip(graded, flags[len(chosen):]) if some}}


def _without_cotangent(model: torch.nn.Module, modules: Sequence[tuple[str, torch.nn.Module]]) -> list[str]:
    """The paths of ``modules`` whose output has no cotangent: no trainable parameter in the
    module nor in a module registered before it (registration order stands for the order of
    the forward; a tensor that nothing trainable precedes does not require grad)."""
    trainable_before = False
    ahead: dict[int, bool] = {}
    for module in model.modules():
        trainable_before = trainable_before or any(p.requires_grad for p in module.parameters(recurse=False))
        ahead.setdefault(id(module), trainable_before)
    return [path for path, module in modules
            if not (ahead.get(id(module)) or any(p.requires_grad for p in module.parameters()))]


def _check_cotangent_modules(tm: TensorMetrics, metric: TensorMetric, present: dict[str, Any], path: str) -> None:
    """A cotangent metric's ``modules:`` globs pick modules on some rank, and none without a
    cotangent on any rank (:func:`_without_cotangent`), or a ``ConfigError`` that says how to
    fix it."""
    patterns = tm._token_modules.get(metric.name, ())
    if not patterns:
        return  # no module hooked: it reads tm.observe(..., grad=True) sites only
    if not present["modules"].get(metric.name):
        raise ConfigError(f"metric {metric.name!r}: modules {list(patterns)} match no module; give modules: globs "
                          "of canonical module names (layers.3.attn, layers.3.mlp; see `tmetrics names`) or the "
                          "model's module paths", path=path)
    if metric.name in present["no_cotangent"]:
        here = present["no_cotangent"][metric.name]
        raise ConfigError(f"metric {metric.name!r}: modules {list(patterns)} pick modules whose outputs have no "
                          f"cotangent{': ' + ', '.join(here[:4]) if here else ' (on another rank)'}: no trainable "
                          "parameter in them or in a module registered before them (frozen, or no grad path), so "
                          "backward never reaches their outputs. Narrow modules: to modules after a trainable one, "
                          "or unfreeze parameters before them", path=path)


def _check_keys(tm: TensorMetrics, key_rules: Mapping[str, KeyRules]) -> None:
    """Tensor and family labels come from the model's own names, which a backend may
    rewrite (``w+1`` and ``w_1`` are one TensorBoard tag): refuse such a pair now rather
    than fail every write of the run. Other labels are catalogue words and indices."""
    labels = set()
    for metric, _ in tm.metrics:
        scope = getattr(metric, "scope", None)
        if scope not in ("tensor", "family"):
            continue
        for kind in set(metric.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS):
            for site in tm.manifest.sites(kind):
                if metric.accepts(site):
                    labels.add((metric.name, Labels(site.layer, site.expert, site.name) if scope == "tensor"
                                else Labels(tensor=site.family or site.name)))
    layer_width, expert_width = index_widths(tm.manifest.num_layers, tm.manifest.num_experts)
    for sink, rules in key_rules.items():
        try:
            check_collisions(sorted(labels, key=repr), rules, layer_width=layer_width, expert_width=expert_width)
        except ConfigError as exc:
            raise ConfigError(str(exc).removeprefix(f"{exc.path}: "), path=f"sinks.{sink}") from None


def _nothing_chosen(metric: TensorMetric, sites: Sequence[Site], manifest: Manifest) -> str:
    """Why ``metric`` has no tensor: its select matches none, or it can use none of those it
    matches (their placements or shapes), with what the catalogue says it supports."""
    select = tuple(getattr(metric, "select", ()))
    matched = [s for s in sites if not select or any(fnmatchcase(s.name, p) for p in select)]
    if not matched:
        framework = next(((p, e) for p in select for e in manifest.entries if fnmatchcase(e.original, p)), None)
        hint = (f"; {framework[0]!r} matches the framework's name {framework[1].original!r}, whose canonical name "
                f"is {framework[1].name!r}" if framework is not None else "")
        return (f"metric {metric.name!r}: select {list(select)} matches no tensor. select: globs take canonical "
                f"tensor names (see `tmetrics names`), e.g. {[e.name for e in manifest.entries[:3]]}; nearest: "
                f"{nearest(select, (s.name for s in sites), prefixes=True)!r}" + hint)
    scope = getattr(metric, "scope", None)
    if scope in ("layer", "expert") and not any(s.layer is not None for s in matched):
        return (f"metric {metric.name!r} is per {scope}, but no tensor got a layer index: tmetrics finds "
                "layers in a ModuleList, Sequential or integer-keyed ModuleDict of two or more like blocks "
                f"under any prefix; in this model, {describe_lists([e.original for e in manifest.entries])} "
                f"(`tmetrics names --factory module:function` shows how yours are named, e.g. "
                f"{[e.name for e in manifest.entries[:3]]}); use a global- or tensor- metric")
    supported = {e.name: e.placements for e in catalogue_entries()}.get(metric.name)
    where = f"its select {list(select)} matches" if select else "the model has"
    return (f"metric {metric.name!r} can use none of the {len(matched)} tensors {where}, e.g. "
            f"{matched[0].describe()}" + (f"; it supports: {supported}" if supported else "") +
            "; change the placements or select, or drop the metric")

