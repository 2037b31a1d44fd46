"""Parameter and gradient metrics of the catalogue, sharded on 1, 2 and 4 simulated ranks over
every placement, against the unsharded float64 reference; global-grad-l2 against
clip_grad_norm_; non-finite gradients counted, never raised."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metrics.cases import MESHES, Case, MetricSpec, SiteCase, assert_results, run_case, tensor_specs
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.topology import Topology
from tmetrics_core.distributed.collectives import TorchCollectives
from tmetrics_core.site import Site

SPECS = [MetricSpec(n) for n in (
    "global-param-l2", "layer-param-l2", "tensor-param-l2", "family-param-l2", "global-grad-l2",
    "layer-grad-l2", "family-grad-l2", "layer-param-absmax", "layer-grad-absmax", "layer-param-rms",
    "layer-grad-rms", "global-param-mean-row-l2", "global-param-mean-column-l2", "layer-grad-nonfinite",
    "layer-grad-zero-fraction")]


def reference(case: Case) -> dict[str, list]:
    """Every metric of SPECS on the full tensors in float64."""
    by_kind = {k: [(sc.name, sc.layer, sc.family or sc.name, sc.full.double()) for sc in case.sites if sc.kind == k]
               for k in ("param", "grad")}
    out: dict[str, list] = {}

    def cat(items):
        return torch.cat([t.reshape(-1) for *_, t in items]) if items else torch.zeros(0, dtype=torch.float64)

    def grouped(kind, key):
        groups: dict = {}
        for item in by_kind[kind]:
            groups.setdefault(key(item), []).append(item)
        return sorted(groups.items(), key=lambda kv: repr(kv[0]))

    def l2(items):
        return cat(items).pow(2).sum().sqrt().item()

    for kind in ("param", "grad"):
        out[f"global-{kind}-l2"] = [((None, None, None, None), l2(by_kind[kind]))] if by_kind[kind] else []
        out[f"layer-{kind}-l2"] = [((layer, None, None, None), l2(items))
                                   for layer, items in grouped(kind, lambda it: it[1])]
        out[f"family-{kind}-l2"] = [((None, None, fam, None), l2(items))
                                    for fam, items in grouped(kind, lambda it: it[2])]
        out[f"layer-{kind}-absmax"] = [((layer, None, None, None), _absmax(cat(items)))
                                       for layer, items in grouped(kind, lambda it: it[1])]
        out[f"layer-{kind}-rms"] = [((layer, None, None, None), _rms(cat(items)))
                                    for layer, items in grouped(kind, lambda it: it[1])]
    out["tensor-param-l2"] = [((layer, None, name, None), t.pow(2).sum().sqrt().item())
                              for name, layer, _, t in by_kind["param"]]
    for dim, name in ((0, "global-param-mean-row-l2"), (1, "global-param-mean-column-l2")):
        mats = [t for *_, t in by_kind["param"] if t.dim() >= 2]
        lines = [m.reshape(m.shape[0], math.prod(m.shape[1:])) for m in mats]
        norms = [(x if dim == 0 else x.t()).pow(2).sum(1).sqrt() for x in lines]
        allnorms = torch.cat(norms) if norms else torch.zeros(0, dtype=torch.float64)
        out[name] = [((None, None, None, None), allnorms.mean().item() if allnorms.numel() else math.nan)] if mats else []
    out["layer-grad-nonfinite"] = []
    out["layer-grad-zero-fraction"] = []
    for layer, items in grouped("grad", lambda it: it[1]):
        flat = cat(items)
        nan, pos, neg = (int(f(flat).sum()) for f in (torch.isnan, torch.isposinf, torch.isneginf))
        out["layer-grad-nonfinite"] += [((layer, None, None, s), float(v)) for s, v in
                                        (("nan", nan), ("posinf", pos), ("neginf", neg), ("total", nan + pos + neg))]
        out["layer-grad-zero-fraction"].append(((layer, None, None, None),
                                                (flat == 0).sum().item() / flat.numel() if flat.numel() else None))
    return {name: [(k, v) for k, v in values if v is not None] for name, values in out.items()}


def _absmax(x: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return math.nan
    return x.abs().max().item() if x.numel() else 0.0


def _rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item() if x.numel() else None  # no element anywhere: no record


@st.composite
def cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    sites = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["param", "grad"]))
        ndim = draw(st.integers(1, 3))
        tshape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(tshape, generator=g)
        full = torch.where(torch.rand(tshape, generator=g) < 0.2, torch.zeros(()), full)
        if kind == "grad" and draw(st.booleans()):
            special = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, tshape, generator=g)]
            full = torch.where(torch.rand(tshape, generator=g) < 0.1, special, full)
        # Partial(sum) parts of test data do not add back to exact zeros; max parts do.
        partial = ("max",) if kind == "grad" else ("sum", "max")
        specs = draw(tensor_specs(ndim, shape, partial_ops=partial))
        layer = i % 3
        sites.append(SiteCase(f"layers.{layer}.w{i % 2}", kind, full, specs, layer=layer,
                              family=f"layers.*.w{i % 2}", seed=seed))
    # Canonical names are unique per kind: rename duplicates.
    seen: set = set()
    for sc in sites:
        while (sc.name, sc.kind) in seen:
            sc.name += "x"
        seen.add((sc.name, sc.kind))
    return Case(shape, names, sites)


def _rank(rank, world, comm, case, specs):
    return run_case(rank, case, sim_topology(rank, case.shape, case.names), comm, specs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_param_and_grad_metrics_equal_unsharded_reference(case):
    results = run_threaded(_rank, math.prod(case.shape), case, SPECS)
    want = reference(case)
    for got in results:
        assert_results(got, want)


def test_global_grad_l2_equals_clip_grad_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    model(torch.randn(5, 7)).pow(2).sum().backward()
    sites, grads = [], []
    for name, p in model.named_parameters():
        sites.append(Site(name=name, kind="grad", logical_shape=tuple(p.shape), layer=int(name.split(".")[0])))
        grads.append(p.grad.clone())
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
    case = Case((), (), [SiteCase(s.name, "grad", g, (), layer=s.layer) for s, g in zip(sites, grads)])
    got = run_case(0, case, Topology.single_process(), TorchCollectives(), [MetricSpec("global-grad-l2")])
    assert math.isclose(got["global-grad-l2"][0][1], want, rel_tol=1e-6)
    alias = run_case(0, case, Topology.single_process(), TorchCollectives(), [MetricSpec("global-wgrad-l2")])
    assert alias == got


def test_nonfinite_gradients_are_counted_not_raised():
    grad = torch.tensor([[1.0, math.nan, math.inf], [-math.inf, 0.0, math.nan]])
    case = Case((2,), ("tp",), [SiteCase("layers.0.w", "grad", grad, (("S", 1),), layer=0)])
    specs = [MetricSpec(n) for n in ("layer-grad-nonfinite", "layer-grad-l2", "layer-grad-absmax",
                                     "layer-grad-zero-fraction")]
    for got in run_threaded(_rank, 2, case, specs):
        counts = {labels[3]: v for labels, v in got["layer-grad-nonfinite"]}
        assert counts == {"nan": 2.0, "posinf": 1.0, "neginf": 1.0, "total": 4.0}
        assert math.isnan(got["layer-grad-l2"][0][1]) and math.isnan(got["layer-grad-absmax"][0][1])
        assert got["layer-grad-zero-fraction"][0][1] == 1 / 6


def test_mean_row_l2_leaves_out_a_parameter_without_a_gradient_but_counts_a_zero_one():
    """A parameter with no gradient is not part of gradient statistics: its rows are not rows
    of the mean (its placeholder is -inf per line, not zeros); a gradient that is all zeros
    counts its rows with norm 0."""
    from tmetrics_core.metrics.norms import MeanLineL2
    from tmetrics_core.tensor_metrics import TensorMetrics

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3, bias=False), "b": torch.nn.Linear(4, 5, bias=False),
                                 "c": torch.nn.Linear(4, 2, bias=False)})
    metrics = TensorMetrics(model, metrics=[(MeanLineL2(name="grad-mean-row-l2", source_kinds=["grad"]), 1)])
    with metrics.step(1):
        model["a"](torch.randn(6, 4)).pow(2).sum().backward()  # b is not used: no gradient
        model["c"].weight.grad = torch.zeros_like(model["c"].weight)  # used, every row zero
    rows = torch.cat([model["a"].weight.grad.double().norm(dim=1), torch.zeros(2, dtype=torch.float64)])
    assert model["b"].weight.grad is None
    assert metrics.last_records[0].value == pytest.approx(rows.mean().item(), rel=1e-6)
    metrics.close()


@pytest.mark.parametrize("dtype, scale", [(torch.float64, 1e-30), (torch.float32, 1e20), (torch.bfloat16, 1e20)])
def test_mean_row_and_column_l2_square_in_float64(dtype, scale):
    """Line sums of squares are accumulated in float64 whatever the tensor's dtype, like the
    other norms: squared in float32 they underflowed to 0 for float64 values of 1e-30 and
    overflowed to inf for float32 values of 1e20."""
    from tmetrics_core.metrics.norms import MeanLineL2
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4, bias=False).to(dtype)})
    with torch.no_grad():
        model["a"].weight.copy_(torch.arange(1.0, 13.0).reshape(4, 3) / 7 * scale)
    metrics = TensorMetrics(model, metrics=[(MeanLineL2(name="row", source_kinds=["param"]), 1),
                                            (MeanLineL2(name="column", source_kinds=["param"], dim=1), 1)])
    with metrics.step(1):
        pass
    full = model["a"].weight.detach().double() / scale
    values = {r.metric: r.value / scale for r in metrics.last_records}
    assert values == {"row": pytest.approx(full.norm(dim=1).mean().item(), rel=1e-12),
                      "column": pytest.approx(full.norm(dim=0).mean().item(), rel=1e-12)}
    metrics.close()


def test_absmax_of_a_layer_without_any_gradient_writes_no_record():
    """A layer whose parameters have no gradient on any rank (a branch the loss did not use)
    gets no gradient absmax record: it read -inf, the identity of max, which the default
    nonfinite-gradients alert took for an infinite gradient. Its L2 still reads 0 (documented)."""
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("layer-grad-absmax", "layer-grad-l2")])
    with metrics.step(1):
        model.layers[0](torch.randn(3, 4)).pow(2).sum().backward()  # layer 1 unused: no gradient
    got = {(r.metric, r.layer): r.value for r in metrics.last_records}
    grads = [p.grad.detach().double() for p in model.layers[0].parameters()]
    assert got == {("layer-grad-absmax", 0): pytest.approx(max(float(g.abs().max()) for g in grads), rel=1e-12),
                   ("layer-grad-l2", 0): pytest.approx(sum(float(g.pow(2).sum()) for g in grads) ** 0.5, rel=1e-12),
                   ("layer-grad-l2", 1): 0.0}
    metrics.close()
