"""The start-up checks of a :class:`~tmetrics_core.tensor_metrics.TensorMetrics` against its
model, optimizer and topology, handed what they read (:class:`StartupInputs`), before the
first step: each metric listed once, its source kinds produced, its ``select`` and ``modules``
matching something, its placements handled, and no two labels rendering to one key of a sink.
"""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase
from typing import Any, Collection, Mapping, Sequence

import torch

from tmetrics_core.distributed.executor import Executor
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.catalogue import catalogue_entries
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.naming.nearest import nearest
from tmetrics_core.naming.stacks import describe_lists
from tmetrics_core.records import Labels
from tmetrics_core.reporter import Reporter
from tmetrics_core.site import Site
from tmetrics_core.sinks.keys import KeyRules, check_collisions, index_widths
from tmetrics_core.sources.modules import ModuleIndex
from tmetrics_core.sources.optimizer_state import state_keys
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS
from tmetrics_core.kinds import ROUTER_OUTPUT_KINDS
from tmetrics_core.topology import Topology

__all__ = ["StartupInputs", "check_against_model"]


@dataclasses.dataclass(frozen=True)
class StartupInputs:
    """What the start-up checks read of a ``TensorMetrics`` being built.

    Attributes:
        model: the (possibly wrapped, sharded) model.
        manifest: its placed tensors (:class:`~tmetrics_core.manifest.table.Manifest`).
        index: its modules, blocks and head (:class:`~tmetrics_core.sources.modules.ModuleIndex`).
        routers: the MoE routers found in it (each with ``num_experts``).
        num_experts: the global number of experts (0 for a dense model).
        topology: named axes.
        executor: runs the one agreement (``any_ranks``) of what any rank's model has.
        optimizer: the unwrapped optimizer, or None.
        flat_kinds: the source kinds read from ZeRO-style flat buffers instead of the optimizer.
        modules: metric name -> configured module globs (``activation`` metrics).
        token_modules: ``modules`` with the default globs of cotangent metrics given none.
        optional: names of metrics marked ``optional: true``.
        reporter: says what the checks report (an optional metric skipped) on the logging rank.
    """

    model: torch.nn.Module
    manifest: Manifest
    index: ModuleIndex
    routers: Sequence[Any]
    num_experts: int
    topology: Topology
    executor: Executor
    optimizer: Any
    flat_kinds: Collection[str]
    modules: Mapping[str, Sequence[str]]
    token_modules: Mapping[str, Sequence[str]]
    optional: Collection[str]
    reporter: Reporter


def check_against_model(metrics: Sequence[tuple[TensorMetric, int]], inputs: StartupInputs,
                        key_rules: Mapping[str, KeyRules]) -> list[tuple[TensorMetric, int]]:
    """The start-up checks of ``metrics`` (``(metric, interval)`` pairs in config order) against the
    model, optimizer and topology: each metric listed once, its source kinds produced, its
    ``select`` and ``modules`` matching something, its placements handled, and no two labels
    rendering to one key of a sink. Whether the model has blocks, a head and each metric's
    modules is agreed across ranks (one small gather), so every rank decides alike.

    A metric in ``inputs.optional`` for which the model has no source (router outputs on a dense
    model, no matching module or tensor, no blocks or head, no such optimizer state) is taken
    left out with one INFO line instead, said by the logging rank (``inputs.reporter``).

    Args:
        key_rules: sink name -> that sink's key rules, for every configured sink.

    Returns:
        ``metrics`` less the optional ones skipped.

    Raises:
        ConfigError: the first check that fails, with the config path (``metrics[i]`` or
            ``sinks.<backend>``) and how to fix it.
    """
    components = {e.component for e in inputs.manifest.entries}
    seen: dict[str, int] = {}
    for index, (metric, _) in enumerate(metrics):
        if metric.name in seen:
            raise ConfigError(f"metric {metric.name!r} is listed twice (metrics[{seen[metric.name]}] and "
                              f"metrics[{index}]); list it once with every pattern in one select or modules "
                              "list, e.g. select: ['layers.0.*', 'layers.1.*']", path=f"metrics[{index}]")
        seen[metric.name] = index
    # A pipeline stage may lack the head, the blocks or the modules another stage has: what
    # the model has is agreed across ranks (one small gather), so every rank decides alike.
    present = _present_anywhere(inputs, metrics)
    skipped = []
    for index, (metric, _) in enumerate(metrics):
        try:
            _check_metric(inputs, index, metric, present, components=components)
        except _Absent as exc:
            if metric.name not in inputs.optional:
                raise ConfigError(f"{exc.message}; or mark it optional: true to skip it where the model has "
                                  "no such source", path=exc.path) from None
            inputs.reporter.info("tmetrics: optional metric %r skipped: %s", metric.name, exc.message)
            skipped.append(metric.name)
    kept = [(m, i) for m, i in metrics if m.name not in skipped]
    _check_keys(inputs, kept, key_rules)
    return kept


class _Absent(ConfigError):
    """The model has no source for a metric (no router, blocks, head, matching module or
    tensor, or the optimizer state it reads): an optional metric is then skipped."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, path=path)
        self.message = message


def _check_metric(inputs: StartupInputs, index: int, metric: TensorMetric, present: dict[str, Any], *,
                  components: set[Any]) -> None:
    """The start-up checks of one metric (see :func:`check_against_model`).

    Raises:
        _Absent: the model has no source for it.
        ConfigError: any other check that fails.
    """
    path = f"metrics[{index}]"
    kinds = set(metric.source_kinds)
    param_sites = [s for kind in kinds & (PARAM_KINDS | OPTIMIZER_KINDS) for s in inputs.manifest.sites(kind)]
    state = kinds & {"exp_avg", "exp_avg_sq"} - set(inputs.flat_kinds)
    if state and inputs.optimizer is None:
        raise _Absent(f"metric {metric.name!r} reads optimizer state; pass optimizer=", path=path)
    if state:
        try:
            state_keys(inputs.optimizer, state, metric.name, path)  # refuses an optimizer without that state
        except ConfigError as exc:
            raise _Absent(str(exc).removeprefix(f"{exc.path}: "), path=path) from None
    if kinds & {"update"} and inputs.optimizer is None:
        raise _Absent(f"metric {metric.name!r} measures optimizer updates; pass optimizer=",
                      path=path)
    if kinds & {"router_logits", "router_topk", "router_scores"} and "moe.router" not in components:
        raise _Absent(f"metric {metric.name!r} needs MoE router outputs, but the model has no router "
                      "parameter (canonical component moe.router); drop it for a dense model",
                      path=path)
    counts = {r.num_experts for r in inputs.routers}
    if kinds & ROUTER_OUTPUT_KINDS and counts and counts != {inputs.num_experts}:
        raise ConfigError(f"metric {metric.name!r}: the model's routers score {sorted(counts)} experts "
                          f"each but its expert parameters number {inputs.manifest.num_experts} (global "
                          "ids); pass expert_offset= on each expert-parallel rank, or shard the stacked "
                          "expert tensors as DTensors", path=path)
    if kinds & {"residual_accumulator", "residual_contribution", "residual_grad", "residual_input_grad"} \
            and not present["blocks"]:
        raise _Absent(f"metric {metric.name!r} needs the model's blocks (a ModuleList, Sequential or "
                      "integer-keyed ModuleDict of two or more like blocks, under any prefix); in this "
                      f"model, {describe_lists([e.original for e in inputs.manifest.entries])}", path=path)
    if kinds & {"logits", "logits_grad"} and not present["head"]:
        raise _Absent(f"metric {metric.name!r} needs the output head (head, lm_head, output or "
                      "output_layer as an nn.Linear); none found", path=path)
    patterns = inputs.modules.get(metric.name, ())
    if "activation" in kinds and patterns and not present["modules"].get(metric.name):
        near = nearest(patterns, [*inputs.index.canonical.values(), *(p for p, _ in inputs.index.named if p)])
        raise _Absent(f"metric {metric.name!r}: modules {list(patterns)} match no module. modules: globs "
                      "take canonical module names, the naming of select: less the leaf (layers.3.attn, "
                      "layers.3.mlp, layers.3.moe; see `tmetrics names`), or the model's module paths; "
                      f"nearest: {near!r}", path=path)
    if "activation_grad" in kinds:
        _check_cotangent_modules(inputs, metric, present, path)
    chosen = [s for s in param_sites if metric.accepts(s)]
    if param_sites and not chosen:
        select = tuple(getattr(metric, "select", ()))
        matched = any(not select or any(fnmatchcase(s.name, p) for p in select) for s in param_sites)
        raise (ConfigError if matched else _Absent)(_nothing_chosen(metric, param_sites, inputs.manifest), path=path)
    for site in chosen:
        try:
            metric.check(site, inputs.topology)
        except PlacementError as exc:
            raise ConfigError(f"metric {metric.name!r} cannot handle {site.describe()}: {exc}",
                              path=path) from exc


def _present_anywhere(inputs: StartupInputs, metrics: Sequence[tuple[TensorMetric, int]]) -> dict[str, Any]:
    """Whether any rank has blocks, a head, modules matching each metric's globs, and (for
    cotangent metrics) matching modules whose outputs may have a cotangent."""
    chosen = inputs.token_modules
    graded = [m.name for m, _ in metrics if "activation_grad" in m.source_kinds and m.name in chosen]
    ahead = _trainable_ahead(inputs.model) if graded else {}  # one walk of the model for every graded metric
    without = {name: _without_cotangent(ahead, inputs.index.matching(chosen[name])) for name in graded}
    blocks, head, *flags = inputs.executor.any_ranks(
        [bool(inputs.index.blocks), inputs.index.head is not None, *(bool(inputs.index.matching(p)) for p in chosen.values()),
         *(bool(without[name]) for name in graded)])
    return {"blocks": blocks, "head": head, "modules": dict(zip(chosen, flags)),
            "no_cotangent": {name: without[name] for name, some in zip(graded, flags[len(chosen):]) if some}}


def _trainable_ahead(model: torch.nn.Module) -> dict[int, bool]:
    """Module id -> whether a trainable parameter sits in it or in a module registered before
    it (registration order stands for the order of the forward), in one walk of ``model``."""
    trainable_before = False
    ahead: dict[int, bool] = {}
    for module in model.modules():
        trainable_before = trainable_before or any(p.requires_grad for p in module.parameters(recurse=False))
        ahead.setdefault(id(module), trainable_before)
    return ahead


def _without_cotangent(ahead: Mapping[int, bool], modules: Sequence[tuple[str, torch.nn.Module]]) -> list[str]:
    """The paths of ``modules`` whose output has no cotangent: no trainable parameter in the
    module nor before it (``ahead``: :func:`_trainable_ahead`; a tensor that nothing trainable
    precedes does not require grad)."""
    return [path for path, module in modules
            if not (ahead.get(id(module)) or any(p.requires_grad for p in module.parameters()))]


def _check_cotangent_modules(inputs: StartupInputs, metric: TensorMetric, present: dict[str, Any], path: str) -> None:
    """A cotangent metric's ``modules:`` globs pick modules on some rank, and none without a
    cotangent on any rank (:func:`_without_cotangent`), or a ``ConfigError`` that says how to
    fix it."""
    patterns = inputs.token_modules.get(metric.name, ())
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


def _check_keys(inputs: StartupInputs, metrics: Sequence[tuple[TensorMetric, int]],
                key_rules: Mapping[str, KeyRules]) -> None:
    """Tensor and family labels come from the model's own names, which a backend may
    rewrite (``w+1`` and ``w_1`` are one TensorBoard tag): refuse such a pair now rather
    than fail every write of the run. Other labels are catalogue words and indices."""
    labels = set()
    for metric, _ in metrics:
        scope = getattr(metric, "scope", None)
        if scope not in ("tensor", "family"):
            continue
        for kind in set(metric.source_kinds) & (PARAM_KINDS | OPTIMIZER_KINDS):
            for site in inputs.manifest.sites(kind):
                if metric.accepts(site):
                    labels.add((metric.name, Labels(site.layer, site.expert, site.name) if scope == "tensor"
                                else Labels(tensor=site.family or site.name)))
    layer_width, expert_width = index_widths(inputs.manifest.num_layers, inputs.manifest.num_experts)
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

