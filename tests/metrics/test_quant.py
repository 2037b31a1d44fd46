"""``layer-*-quant`` on sharded sites (FSDP-style row shards, tensor-parallel feature shards,
data-split tokens in micro-batches, owned tensors, NaN and inf gradients) against a float64
reference that quantises each whole observation, on 1, 2 and 4 simulated ranks; the scale std
where per-rank means differ (TransformerEngine's pooled combiner reads 0); refusals."""

from __future__ import annotations

import math

import pytest
import torch

from tests.metrics.cases import Case, MetricSpec, SiteCase, _cut, assert_results, run_case
from tests.simulation import run_threaded, sim_topology
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.quant.metric import QUANT_STATS
from tmetrics_core.metrics.quant.recipes import recipe_named
from tmetrics_core.placements import Shard, chunk_range
from tmetrics_core.site import Site
from tmetrics_core.tensor_metrics import TensorMetrics

PARAM_RECIPES = ("mxfp8", "fp8-tensorwise", "nvfp4", "fp8-rowwise")
ACT_RECIPES = ("fp8-tensorwise", "mxfp8", "nvfp4")
SPECS = [MetricSpec("layer-param-quant", (("recipe", PARAM_RECIPES),)),
         MetricSpec("layer-grad-quant", (("recipe", ("fp8-tensorwise", "mxfp8")),)),
         MetricSpec("layer-activation-quant", (("recipe", ACT_RECIPES),)),
         MetricSpec("layer-activation-channel-kurtosis"), MetricSpec("layer-activation-outlier-ratio")]


def _pad(names, **by_axis):
    return tuple(by_axis.get(n, ("R",)) for n in names)


def quant_case(shape, names) -> Case:
    """Weights row-sharded on the first axis (FSDP2's Shard(0)), an owned one, a replicated
    norm weight with a padded MX tail; gradients with NaN and inf."""
    g = torch.Generator().manual_seed(7)
    first, n = names[0], shape[0]
    w = torch.randn(64, 96, generator=g) * 1e-2
    w[3, 5] = 0.9  # one outlier
    w[40:] *= 64.0  # the rows of the later shards scale differently
    grad = torch.randn(64, 96, generator=g) * 1e-6
    grad[0, 0], grad[10, 1] = math.nan, math.inf
    sites = [
        SiteCase("layers.0.mlp.up.weight", "param", w, _pad(names, **{first: ("S", 0)}), layer=0),
        SiteCase("layers.0.mlp.up.weight", "grad", grad, _pad(names, **{first: ("S", 0)}), layer=0),
        SiteCase("layers.0.mlp_norm.weight", "param", 1.0 + torch.randn(40, generator=g) * 1e-3, _pad(names), layer=0),
        SiteCase("layers.1.attn.q.weight", "param", torch.randn(32, 48, generator=g),
                 _pad(names, **{first: ("O", n - 1)}), layer=1),
        SiteCase("layers.1.attn.q.weight", "grad", torch.randn(32, 48, generator=g) * 1e-3,
                 _pad(names, **{first: ("O", n - 1)}), layer=1),
    ]
    return Case(shape, names, sites)


def activation_case(shape, names) -> Case:
    """Activations split by tokens on ``dp`` (uneven cuts, two micro-batches) and by features on
    ``tp``, one outlier feature each."""
    g = torch.Generator().manual_seed(8)
    n = shape[names.index("dp")] if "dp" in names else 1
    sites = []
    cuts = tuple([0.0] + [min(1.0, (i + 0.4) / n) for i in range(1, n)] + [1.0])
    for layer in (0, 1):
        a = torch.randn(48, 64, generator=g) * (10.0 ** layer)
        a[:, 7] *= 30.0  # an outlier feature
        specs = tuple(("S*", cuts) if ax == "dp" else ("S", 1) if ax == "tp" else ("R",) for ax in names)
        sites.append(SiteCase(f"layers.{layer}.mlp", "activation", a, specs, layer=layer, block=4))
    return Case(shape, names, sites, micro=2)


def _unblock(recipe, b, rows, cols):
    """Blocks-as-rows back to ``[rows, cols]`` (inverse of the recipe's block layout)."""
    br, bc = recipe.shape(rows, cols)
    pr, pc = rows + (-rows % br), cols + (-cols % bc)
    full = b.reshape(pr // br, pc // bc, br, bc).permute(0, 2, 1, 3).reshape(pr, pc)
    return full[:rows, :cols]


def reference_values(recipe_name: str, kind: str, observations: list[torch.Tensor]) -> dict[str, float]:
    """The recipe's quantities over whole observations, each cast on its own, in float64."""
    recipe = recipe_named(recipe_name, kind)
    xs, dqs, decodes, limits, overflows = [], [], [], [], 0
    for t in observations:
        rows, cols = (t.numel() // t.shape[-1], t.shape[-1]) if t.dim() else (1, 1)
        b = recipe.quantise(t)
        xs.append(t.double().reshape(-1))
        dqs.append(_unblock(recipe, b.dq, rows, cols).reshape(-1))
        amax = b.amax if recipe.name != "fp8-tensorwise" else t.float().abs().amax().expand(b.amax.shape)
        scaled = (amax > 0) & torch.isfinite(amax) & torch.isfinite(b.decode) & (b.decode > 0)
        overflows += int((b.overflow if b.valid is None else b.overflow & b.valid).sum())
        decodes.append(b.decode[scaled])
        limits.append(b.clamped[scaled])
    x, dq, d, lim = torch.cat(xs), torch.cat(dqs), torch.cat(decodes), torch.cat(limits)
    ok = torch.isfinite(x) & torch.isfinite(dq)
    nz = (x != 0) & ~torch.isnan(x)
    err = (x - dq)[ok]
    low = x[torch.isfinite(x) & nz].abs().min().item()
    amax = x[~torch.isnan(x)].abs().max().item()
    energy, noise = x[ok].pow(2).sum().item(), err.pow(2).sum().item()
    return {
        "underflow": (nz & torch.isfinite(x) & (dq == 0)).sum().item() / x.numel(),
        "overflow": overflows / x.numel(),  # MX floor scales clip block maxima in [1.8125, 2) x 2**k
        "sqnr-db": math.nan if not energy else 10 * math.log10(energy / noise) if noise else math.inf,
        "rel-error": ((x - dq).abs() / x.abs())[ok & nz].mean().item() if (ok & nz).any() else math.nan,
        "mse": err.pow(2).sum().item() / x.numel(),
        "amax": amax,
        "scale-min": d.min().item() if d.numel() else math.nan,
        "scale-max": d.max().item() if d.numel() else math.nan,
        "scale-std": d.log2().std(unbiased=False).item() if d.numel() else math.nan,
        "dynamic-range": math.log2(amax / low),
        "scale-at-limit": lim.double().mean().item() if d.numel() else math.nan,
        "nonfinite": float((~torch.isfinite(dq)).sum().item()),
    }


def _observations(case: Case, sc: SiteCase) -> list[torch.Tensor]:
    """What is cast in one piece: a whole weight or gradient; each data rank's tokens of each
    micro-batch, over all features."""
    if sc.kind != "activation":
        return [sc.full]
    dp = case.names.index("dp") if "dp" in case.names else None
    parts = case.shape[dp] if dp is not None else 1
    out = []
    for c in range(parts):
        start, length = _cut(sc.full.shape[0], sc.block, sc.specs[dp][1], c) if dp is not None else (0, sc.full.shape[0])
        chunk = sc.full[start:start + length]
        for part in range(case.micro):
            s, l = chunk_range(length // sc.block, case.micro, part)
            out.append(chunk[s * sc.block:(s + l) * sc.block])
    return [o for o in out if o.numel()]


def outlier_reference(case: Case) -> dict[str, list]:
    """Kurtosis and max/median over features of the per-channel RMS of each module's whole output."""
    kurtosis, ratio = [], []
    for sc in case.sites:
        r = sc.full.double().square().mean(0).sqrt()
        d = r - r.mean()
        labels = (sc.layer, None, sc.name, None)
        kurtosis.append((labels, (d.pow(4).mean() / d.square().mean().square()).item()))
        ratio.append((labels, (r.max() / r.median()).item()))
    return {"layer-activation-channel-kurtosis": kurtosis, "layer-activation-outlier-ratio": ratio}


def reference(case: Case, specs=SPECS) -> dict[str, list]:
    want: dict[str, list] = {}
    for spec in specs:
        if "quant" not in spec.name:
            continue
        kind = spec.name.split("-")[1]
        recipes = dict(spec.options)["recipe"]
        rows = []
        for layer in sorted({sc.layer for sc in case.sites if sc.kind == kind}):
            obs = [o for sc in case.sites if sc.kind == kind and sc.layer == layer for o in _observations(case, sc)]
            for r in recipes:
                for stat, v in reference_values(r, kind, obs).items():
                    rows.append(((layer, None, None, f"{r}.{stat}"), v))
        want[spec.name] = rows
    return want


def both_cases(rank, shape, names, topology, comm):
    """The parameter-side and activation results of one rank."""
    return (run_case(rank, quant_case(shape, names), topology, comm, SPECS[:2])
            | run_case(rank, activation_case(shape, names), topology, comm, SPECS[2:]))


def both_references(shape, names):
    acts = activation_case(shape, names)
    return reference(quant_case(shape, names), SPECS[:2]) | reference(acts, SPECS[2:]) | outlier_reference(acts)


def _run(rank, world, comm, shape, names):
    return both_cases(rank, shape, names, sim_topology(rank, shape, names), comm)


@pytest.mark.parametrize("shape, names", [((1,), ("dp",)), ((2,), ("dp",)), ((4,), ("dp",)), ((2,), ("tp",)),
                                          ((2, 2), ("dp", "tp"))])
def test_quant_equals_unsharded_reference(shape, names):
    want = both_references(shape, names)
    world = math.prod(shape)
    for got in run_threaded(_run, world, shape, names):
        assert_results(got, want)


def test_counts_are_exact_across_ranks():
    """Counts (underflows, non-finite values) are the same integers on 1 and 4 ranks."""
    one = dict(run_threaded(_run, 1, (1,), ("dp",))[0]["layer-grad-quant"])
    four = dict(run_threaded(_run, 4, (4,), ("dp",))[0]["layer-grad-quant"])
    for labels, v in one.items():
        if labels[3].split(".")[1] in ("underflow", "overflow", "nonfinite", "scale-at-limit"):
            assert four[labels] == v or (math.isnan(v) and math.isnan(four[labels])), labels


def test_scale_std_where_rank_means_differ():
    """Rows 0-31 scale by 2**-8 (amax 1), rows 32-63 by 2**-2 (amax 64): on 2 row shards each
    rank's own scale std is 0, so pooling per-rank variances (TransformerEngine's combiner) gives
    0; the std over all blocks is 3 binades, which tmetrics reports on 1 and 2 ranks."""
    w = torch.ones(64, 64)
    w[32:] = 64.0
    case = Case((2,), ("dp",), [SiteCase("layers.0.w", "param", w, (("S", 0),), layer=0)])
    spec = [MetricSpec("layer-param-quant")]
    per_rank = [reference_values("mxfp8", "param", [w[:32]])["scale-std"],
                reference_values("mxfp8", "param", [w[32:]])["scale-std"]]
    pooled = math.sqrt(sum(s * s for s in per_rank) / 2)
    assert pooled == 0.0
    for world in (1, 2):
        sub = Case((world,), ("dp",), case.sites)
        for got in run_threaded(lambda r, n, c: run_case(r, sub, sim_topology(r, (n,), ("dp",)), c, spec), world):
            assert dict(got["layer-param-quant"])[(0, None, None, "mxfp8.scale-std")] == 3.0


def test_every_stat_named_per_recipe():
    got = run_threaded(_run, 1, (1,), ("dp",))[0]["layer-param-quant"]
    assert {labels[3] for labels, _ in got if labels[0] == 0} == {f"{r}.{s}" for r in PARAM_RECIPES for s in QUANT_STATS}


def test_refusals_name_the_fix():
    topo = sim_topology(0, (4,), ("tp",))
    site = Site("layers.0.mlp", "activation", (-1, 96), placements=(("tp", Shard(1)),), layer=0)
    with pytest.raises(PlacementError, match="24 of 96 columns.*whole blocks"):
        build_metric("layer-activation-quant", recipe="mxfp8").check(site, topo)
    build_metric("layer-activation-quant", recipe="fp8-tensorwise").check(site, topo)  # any shards
    with pytest.raises(ConfigError, match="did you mean 'nvfp4'"):
        build_metric("layer-grad-quant", recipe=["mxfp8", "nvfp3"])
    with pytest.raises(ConfigError, match="twice"):
        build_metric("layer-grad-quant", recipe=["mxfp8", "mxfp8"])
    with pytest.raises(ConfigError, match="takes no 'recipe'"):
        build_metric("layer-grad-l2", recipe="mxfp8")
    with pytest.raises(ConfigError, match=r"metrics\[0\]: recipe: unknown .* did you mean 'mxfp8'"):
        TensorMetrics.from_config({"metrics": [{"name": "layer-param-quant", "recipe": "mxfp9"}], "sinks": {}},
                                  model=torch.nn.Linear(4, 4))
