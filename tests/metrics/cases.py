"""Sharded cases for catalogue metrics: sites of any kind, token populations and micro-batches.

Extends ``tests/placement_cases.py``: a :class:`Site` carries its kind, layer, expert count and
meta; a token population is split across ranks at arbitrary block boundaries (``("S*", cuts)``,
blocks of ``block`` rows, e.g. whole sequences), and each rank may observe its tokens as several
micro-batches whose states are merged. Cases are plain picklable data, so the same case runs on
the in-process simulation and on real gloo ranks. ``assert_results`` compares scalars at
relative 1e-6, vectors elementwise, histograms exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from hypothesis import strategies as st

from tests.placement_cases import _partial_part, resolve_partials
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import Collectives
from tmetrics_core.distributed.executor import Executor
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.placements import FlatShard, Owned, Partial, Placement, Replica, Shard, chunk_range
from tmetrics_core.records import Histogram
from tmetrics_core.site import Site

Spec = tuple  # ("R",) ("S", dim) ("S*", cuts) ("F", cuts) ("O", rank) ("P", op)
Labels = tuple  # (layer, expert, tensor, stat)


@dataclass
class SiteCase:
    """One observed tensor: the full (unsharded) value and one spec per mesh axis."""

    name: str
    kind: str
    full: torch.Tensor
    specs: tuple[Spec, ...]
    layer: int | None = None
    expert: int | None = None
    num_experts: int | None = None
    meta: tuple[tuple[str, Any], ...] = ()
    block: int = 1
    """Rows per indivisible unit of a population split (a sequence)."""
    seed: int = 0
    family: str = ""
    drift: str = ""
    """How the copies on ``dp`` differ (:func:`drift_replicas`): "", "everywhere" or "first"."""


@dataclass
class Case:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    sites: list[SiteCase] = field(default_factory=list)
    micro: int = 1
    """Micro-batches per rank: token sites are observed in this many parts, states merged."""


@dataclass(frozen=True)
class MetricSpec:
    """A catalogue metric to run, with its options."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()


def _cut(rows: int, block: int, cuts: Sequence[float], index: int) -> tuple[int, int]:
    """(start, length) in rows of part ``index`` when ``rows // block`` blocks are cut at fractions."""
    blocks = rows // block
    start = int(round(cuts[index] * blocks))
    end = int(round(cuts[index + 1] * blocks))
    return start * block, (end - start) * block


def local_view(sc: SiteCase, coords: Sequence[int], case: Case) -> tuple[Site, torch.Tensor | None]:
    """What the rank at ``coords`` holds of ``sc`` and the site describing it."""
    current: torch.Tensor | None = sc.full
    shape = tuple(sc.full.shape)
    placements: list[tuple[str, Placement]] = []
    for i, (axis, spec) in enumerate(zip(case.names, sc.specs)):
        n, c = case.shape[i], coords[i]
        kind = spec[0]
        if kind == "R":
            placements.append((axis, Replica()))
        elif kind == "S":
            d = spec[1]
            start, length = chunk_range(shape[d], n, c)
            if current is not None:
                current = current.narrow(d, start, length)
            shape = shape[:d] + (length,) + shape[d + 1:]
            placements.append((axis, Shard(d)))
        elif kind == "S*":
            start, length = _cut(shape[0], sc.block, spec[1], c)
            if current is not None:
                current = current.narrow(0, start, length)
            shape = (length,) + shape[1:]
            placements.append((axis, Shard(None)))
        elif kind == "F":
            numel = math.prod(shape)
            start, end = int(spec[1][c] * numel), int(spec[1][c + 1] * numel)
            placements.append((axis, FlatShard(shape, start=start, end=end)))
            if current is not None:
                current = current.reshape(-1)[start:end]
            shape = (end - start,)
        elif kind == "O":
            placements.append((axis, Owned(spec[1])))
            if c != spec[1]:
                current = None
        elif kind == "P":
            placements.append((axis, Partial(spec[1])))
            if current is not None:
                current = _partial_part(current, spec[1], n, c, sc.seed * 31 + i)
    logical = tuple(sc.full.shape)
    if _is_tokens(sc):
        logical = (-1,) + logical[1:]
    site = Site(name=sc.name, kind=sc.kind, logical_shape=logical, dtype=str(sc.full.dtype).replace("torch.", ""),
                placements=tuple(placements), layer=sc.layer, expert=sc.expert, family=sc.family or sc.name,
                num_experts=sc.num_experts, meta=sc.meta)
    return site, (None if current is None else current.contiguous())


TOKEN_KINDS = frozenset({"residual_accumulator", "residual_contribution", "logits", "activation",
                         "router_logits", "router_scores", "router_topk"})


def _is_tokens(sc: SiteCase) -> bool:
    return sc.kind in TOKEN_KINDS


def run_case(rank: int, case: Case, topology: Topology, collectives: Collectives,
             specs: Sequence[MetricSpec], perturb: Callable[..., torch.Tensor] | None = None
             ) -> dict[str, list[tuple[Labels, Any]]]:
    """Run catalogue metrics ``specs`` on ``case`` as rank ``rank``: configuration checks,
    Partial materialization, one prepare per micro-batch (states merged), the executor.
    ``perturb(site_case, coords, local)`` may change what this rank holds (replicas that drift)."""
    coords = [topology.axes[n].rank for n in case.names]
    views = [local_view(sc, coords, case) for sc in case.sites]
    if perturb is not None:
        axis_coords = dict(zip(case.names, coords))
        views = [(s, t if t is None else perturb(sc, axis_coords, t)) for (s, t), sc in zip(views, case.sites)]
    sites = [s for s, _ in views]
    tensors = [t for _, t in views]
    executor = Executor(topology, collectives=collectives, timeout_s=30.0)
    metrics = [build_metric(s.name, **dict(s.options)) for s in specs]
    for m in metrics:
        for s in sites:
            if m.accepts(s):
                m.check(s, topology)
    sites, tensors = resolve_partials(metrics, sites, tensors, topology, executor)
    memos = [{} for _ in range(case.micro)]
    prepared = []
    for metric in metrics:
        chosen = [(s, t, sc) for s, t, sc in zip(sites, tensors, case.sites) if metric.accepts(s)]
        state = None
        for part in range(case.micro):
            local = [_micro(t, sc, part, case.micro) if _is_tokens(sc) else t for _, t, sc in chosen]
            step = metric.prepare([s for s, _, _ in chosen], local, topology, memos[part])
            state = step if state is None else metric.merge(state, step)
        prepared.append((metric, state or {}, None))
    results, failures = executor.run(prepared, {s.key: s for s in sites}, check=True)
    assert not failures, failures
    return {name: [((r.layer, r.expert, r.tensor, r.stat), r.value) for r in rs] for name, rs in results.items()}


def drift_replicas(sc: SiteCase, coords: dict[str, int], local: torch.Tensor) -> torch.Tensor:
    """Replica ``r`` on ``dp`` adds ``0.5 r`` to every element ("everywhere"), or, for ``r >= 1``,
    0.5 to the first element of its local shard ("first"); exact for integer-valued data."""
    replica = coords.get("dp", 0)
    if sc.drift == "everywhere":
        return local + 0.5 * replica
    if sc.drift == "first" and replica and local.numel():
        local = local.clone()
        local.view(-1)[0] += 0.5
    return local


def _micro(t: torch.Tensor | None, sc: SiteCase, part: int, parts: int) -> torch.Tensor | None:
    if t is None:
        return None
    blocks = t.shape[0] // sc.block
    start, length = chunk_range(blocks, parts, part)
    return t[start * sc.block:(start + length) * sc.block]


def assert_results(got: dict, want: dict, *, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    """Every metric's labelled values equal the reference: scalars and vector entries within
    ``atol + rtol * |want|`` (NaN equals NaN, infinities exact), histograms exactly."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        g = sorted(got[name], key=lambda kv: repr(kv[0]))
        w = sorted(want[name], key=lambda kv: repr(kv[0]))
        assert [k for k, _ in g] == [k for k, _ in w], (name, [k for k, _ in g], [k for k, _ in w])
        for (k, gv), (_, wv) in zip(g, w):
            if isinstance(wv, Histogram):
                assert gv == wv, (name, k, gv, wv)
            elif isinstance(wv, tuple):
                assert isinstance(gv, tuple) and len(gv) == len(wv), (name, k, gv, wv)
                for a, b in zip(gv, wv):
                    _close(name, k, a, b, rtol, atol)
            else:
                _close(name, k, gv, wv, rtol, atol)


def _close(name: str, key: Any, got: float, want: float, rtol: float, atol: float) -> None:
    if math.isnan(want):
        assert math.isnan(got), (name, key, got, want)
    elif math.isinf(want):
        assert got == want, (name, key, got, want)
    else:
        assert abs(got - want) <= atol + rtol * abs(want), (name, key, got, want)


MESHES = [((1,), ("dp",)), ((2,), ("dp",)), ((4,), ("dp",)), ((2,), ("tp",)), ((2, 2), ("dp", "tp")),
          ((2, 2), ("pp", "dp"))]
"""Meshes of 1, 2 and 4 simulated ranks the property tests draw from."""


@st.composite
def tensor_specs(draw, ndim: int, mesh: tuple[int, ...], *, partial_ops: Sequence[str] = ("sum", "max"),
                 flat: bool = True) -> tuple[Spec, ...]:
    """Placements of a parameter-like tensor on each mesh axis: Replica, Shard(d) (uneven and
    empty shards), FlatShard (one per tensor, ranges cutting rows), Owned, Partial (one reduce
    op per tensor: Partial(sum) on one axis and Partial(max) on another has no agreed order)."""
    specs: list[Spec] = []
    flat_used = False
    partial_ops = [draw(st.sampled_from(list(partial_ops)))] if partial_ops else []
    for n in mesh:
        choices = ["R", "O"] + (["P"] if partial_ops else [])
        if not flat_used:
            choices += ["S"] * bool(ndim) + ["F"] * flat
        kind = draw(st.sampled_from(choices))
        if kind == "S":
            specs.append(("S", draw(st.integers(0, ndim - 1))))
        elif kind == "F":
            specs.append(("F", _fractions(draw, n)))
            flat_used = True
        elif kind == "O":
            specs.append(("O", draw(st.integers(0, n - 1))))
        elif kind == "P":
            specs.append(("P", draw(st.sampled_from(list(partial_ops)))))
        else:
            specs.append(("R",))
    return tuple(specs)


def _fractions(draw, n: int) -> tuple[float, ...]:
    cuts = sorted(draw(st.lists(st.floats(0, 1), min_size=n - 1, max_size=n - 1)))
    return tuple([0.0] + cuts + [1.0])


@st.composite
def token_specs(draw, mesh: tuple[int, ...], names: tuple[str, ...], *, class_split: bool = False,
                cuts: tuple[tuple[float, ...], ...] | None = None) -> tuple[Spec, ...]:
    """Placements of a token site: a population split at arbitrary block boundaries on ``dp``
    (``cuts`` reuses another site's, so sites of one layer see the same tokens), Replica or
    (``class_split``) Shard(1) on ``tp``, Owned on ``pp``."""
    specs: list[Spec] = []
    for i, (n, name) in enumerate(zip(mesh, names)):
        if name == "dp":
            specs.append(("S*", cuts[i] if cuts else _fractions(draw, n)))
        elif name == "tp":
            specs.append(("S", 1) if class_split and draw(st.booleans()) else ("R",))
        else:
            specs.append(("O", draw(st.integers(0, n - 1))))
    return tuple(specs)
