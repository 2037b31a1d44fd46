"""Sharded test cases: full tensors, a mesh, placements per axis, and the unsharded reference.

A :class:`Case` is plain data (picklable) so the same case runs on the in-process simulation
and on real gloo processes. ``local_view`` cuts what one rank holds out of the full tensor
exactly as the placement says; ``reference`` computes each metric on the full tensors in
float64 in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.distributed.partials import materialize_partials, plan_partials
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.norms import AbsMax, L2Norm, Max, Mean, MeanLineL2, Min, NonFinite, Rms
from tmetrics_core.placements import FlatShard, Owned, Partial, Placement, Replica, Shard, chunk_range
from tmetrics_core.site import Site


def resolve_partials(metrics: Sequence[Any], sites: Sequence[Site], tensors: Sequence[torch.Tensor | None],
                     topology: Topology, executor: Executor) -> tuple[list[Site], list[torch.Tensor | None]]:
    """The sites and tensors as the parameter side's program reads them: ``Partial`` sites some
    metric cannot reduce directly materialized through ``executor`` (``plan_partials``, then
    ``materialize_partials``)."""
    plan = plan_partials(metrics, sites, topology)
    if plan is None:
        return list(sites), list(tensors)
    return list(plan.sites), materialize_partials(plan, sites, tensors, topology, executor)


Spec = tuple  # ("R",) ("S", dim|None) ("F", fractions) ("O", rank) ("P", op)


@dataclass
class TensorCase:
    name: str
    layer: int
    full: torch.Tensor
    specs: tuple[Spec, ...]  # one per mesh axis
    seed: int = 0


@dataclass
class Case:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    tensors: list[TensorCase] = field(default_factory=list)


def metric_set() -> list:
    """The metrics the core issue asks to be exact under every placement."""
    kinds = ["param"]
    return [
        L2Norm(name="global-l2", source_kinds=kinds),
        L2Norm(name="layer-l2", source_kinds=kinds, scope="layer"),
        Max(name="global-max", source_kinds=kinds),
        Min(name="global-min", source_kinds=kinds),
        Mean(name="global-mean", source_kinds=kinds),
        AbsMax(name="layer-absmax", source_kinds=kinds, scope="layer"),
        Rms(name="tensor-rms", source_kinds=kinds, scope="tensor"),
        MeanLineL2(name="global-mean-row-l2", source_kinds=kinds, dim=0),
        MeanLineL2(name="global-mean-column-l2", source_kinds=kinds, dim=1),
        NonFinite(name="global-nonfinite", source_kinds=kinds),
    ]


def local_view(tc: TensorCase, coords: Sequence[int], case: Case) -> tuple[Site, torch.Tensor | None]:
    """What the rank at ``coords`` holds of ``tc`` and the site it describes it with."""
    current: torch.Tensor | None = tc.full
    shape = tuple(tc.full.shape)
    placements: list[tuple[str, Placement]] = []
    for i, (axis, spec) in enumerate(zip(case.names, tc.specs)):
        n, c = case.shape[i], coords[i]
        kind = spec[0]
        if kind == "R":
            placements.append((axis, Replica()))
        elif kind == "S":
            dim = spec[1]
            d = 0 if dim is None else dim
            start, length = chunk_range(shape[d], n, c)
            if current is not None:
                current = current.narrow(d, start, length)
            shape = shape[:d] + (length,) + shape[d + 1:]
            placements.append((axis, Shard(dim)))
        elif kind == "F":
            fractions = spec[1]
            numel = math.prod(shape)
            start, end = int(fractions[c] * numel), int(fractions[c + 1] * numel)
            placements.append((axis, FlatShard(shape, start=start, end=end)))
            if current is not None:
                current = current.reshape(-1)[start:end]
            shape = (end - start,)
        elif kind == "O":
            placements.append((axis, Owned(spec[1])))
            if c != spec[1]:
                current = None
        elif kind == "P":
            op = spec[1]
            placements.append((axis, Partial(op)))
            if current is not None:
                current = _partial_part(current, op, n, c, tc.seed * 31 + i)
    site = Site(name=tc.name, kind="param", logical_shape=tuple(tc.full.shape), dtype=str(tc.full.dtype),
                placements=tuple(placements), layer=tc.layer, family=tc.name)
    return site, (None if current is None else current.contiguous())


def _partial_part(x: torch.Tensor, op: str, n: int, c: int, seed: int) -> torch.Tensor:
    """Rank ``c``'s piece of ``x`` under ``Partial(op)``: every element is held whole by one
    random rank; the others hold the op's neutral-ish filler (0 for sum, a smaller or larger
    value for max or min). The pieces reduce to ``x`` exactly in any precision, so the metrics
    are compared at full precision (random real-valued splits would round in fp32)."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, n, x.shape, generator=g)
    if op == "sum":
        return torch.where(owner == c, x, torch.zeros_like(x))
    noise = torch.rand(x.shape, generator=g) + 0.1
    lowered = x - noise.to(x.dtype) if op == "max" else x + noise.to(x.dtype)
    return torch.where(owner == c, x, lowered)


def run_case(rank: int, case: Case, topology: Topology, collectives: Collectives,
             check: bool = True) -> dict[str, list[tuple[Any, Any]]]:
    """Run :func:`metric_set` on ``case`` as rank ``rank``; results as (labels, value) lists."""
    coords = [topology.axes[n].rank for n in case.names]
    views = [local_view(tc, coords, case) for tc in case.tensors]
    sites = [s for s, _ in views]
    tensors = [t for _, t in views]
    executor = Executor(topology, collectives=collectives)
    metrics = metric_set()
    for m in metrics:
        for s in sites:
            if m.accepts(s):
                m.check(s, topology)
    sites, tensors = resolve_partials(metrics, sites, tensors, topology, executor)
    prepared = prepare_states(metrics, sites, tensors, topology)
    results, failures = executor.run(prepared, {s.key: s for s in sites}, check=check)
    assert not failures, failures
    return {name: [((r.layer, r.tensor, r.stat), r.value) for r in rs] for name, rs in results.items()}


def mean_scale(case: Case) -> dict[str, float]:
    """Absolute tolerances by metric: the mean is compared at 1e-6 of the mean magnitude."""
    flat = torch.cat([tc.full.double().reshape(-1) for tc in case.tensors])
    return {"global-mean": 1e-6 * flat.abs().mean().item() if flat.numel() else 0.0}


def reference(case: Case) -> dict[str, list[tuple[Any, Any]]]:
    """Every metric of :func:`metric_set` on the full tensors, float64, one process."""
    fulls = [(tc.name, tc.layer, tc.full.double()) for tc in case.tensors]
    flat = torch.cat([t.reshape(-1) for _, _, t in fulls]) if fulls else torch.zeros(0, dtype=torch.float64)
    out: dict[str, list] = {}
    out["global-l2"] = [((None, None, None), flat.pow(2).sum().sqrt().item())]
    layers = sorted({layer for _, layer, _ in fulls})
    out["layer-l2"] = [((layer, None, None), math.sqrt(sum(t.pow(2).sum().item() for _, l, t in fulls if l == layer)))
                       for layer in layers]
    out["global-max"] = [((None, None, None), flat.max().item() if flat.numel() else -math.inf)]
    out["global-min"] = [((None, None, None), flat.min().item() if flat.numel() else math.inf)]
    # a mean or RMS over no element is no record (never a NaN the non-finite alert would flag)
    out["global-mean"] = [((None, None, None), flat.mean().item())] if flat.numel() else []
    out["layer-absmax"] = [((layer, None, None), max([t.abs().max().item() if t.numel() else 0.0
                                                       for _, l, t in fulls if l == layer]))
                           for layer in layers]
    out["tensor-rms"] = [((layer, name, None), t.pow(2).mean().sqrt().item())
                         for name, layer, t in sorted(fulls) if t.numel()]
    for metric, dim in (("global-mean-row-l2", 0), ("global-mean-column-l2", 1)):
        norms = []
        if not any(t.dim() >= 2 for _, _, t in fulls):
            out[metric] = []
            continue
        for _, _, t in fulls:
            if t.dim() < 2:
                continue
            m = t.reshape(t.shape[0], math.prod(t.shape[1:]))
            norms.append((m if dim == 0 else m.t()).pow(2).sum(1).sqrt())
        allnorms = torch.cat(norms) if norms else torch.zeros(0, dtype=torch.float64)
        out[metric] = [((None, None, None), allnorms.mean().item() if allnorms.numel() else math.nan)]
    nan = int(torch.isnan(flat).sum())
    pos = int(torch.isposinf(flat).sum())
    neg = int(torch.isneginf(flat).sum())
    out["global-nonfinite"] = [((None, None, s), float(v)) for s, v in
                               (("nan", nan), ("posinf", pos), ("neginf", neg), ("total", nan + pos + neg))]
    return out


def assert_matches(got: dict, want: dict, *, rtol: float = 1e-6, atol: float = 1e-9,
                   atol_by_metric: dict[str, float] | None = None) -> None:
    """Every metric's values equal the reference (NaN equals NaN; infinities compared exactly).

    ``atol_by_metric`` loosens the absolute tolerance of one metric, e.g. a mean whose value
    cancels to near zero is compared at ``1e-6 * mean(|x|)``, the precision of its inputs.
    """
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        atol_m = max(atol, (atol_by_metric or {}).get(name, 0.0))
        g = sorted(got[name], key=lambda kv: repr(kv[0]))
        w = sorted(want[name], key=lambda kv: repr(kv[0]))
        assert [k for k, _ in g] == [k for k, _ in w], (name, g, w)
        for (k, gv), (_, wv) in zip(g, w):
            if math.isnan(wv):
                assert math.isnan(gv), (name, k, gv, wv)
            elif math.isinf(wv):
                assert gv == wv, (name, k, gv, wv)
            else:
                assert abs(gv - wv) <= atol_m + rtol * abs(wv), (name, k, gv, wv, abs(gv - wv) / max(abs(wv), 1e-30))
