"""Local preparation cost of the standard parameter and gradient metrics of one step.

Run ``python -m bench.prepare_cost`` (``--help`` for options). The bundle is what a user turns
on first: global and layer L2 of parameters and gradients, per-layer absmax, RMS, non-finite
counts and zero fraction of both. Its local preparation (``prepare_states``: every statistic of
every tensor, shared between metrics through the step memo, no collective) is timed against ONE
``torch._foreach_norm`` pass over the same tensors, the floor any norm metric pays.

One rows pass (:func:`tmetrics_core.kernels.rows.rows`, batched torch ops) serves every
statistic of a metric; the breakdown also times that pass alone.

``--formulations`` times instead, per 1 M elements of the same tensors, each column's batched
torch formulation next to the alternatives tried for it (:data:`FORMULATIONS`): the figures
behind ``docs/performance.md`` ("One rows pass per call") and the choices in ``kernels/rows.py``.

Variants run interleaved in short rounds (order rotated each round), because this machine's
speed drifts; the figure is the paired ratio (bundle time over the foreach pass in the same
round, median over rounds). A breakdown times each statistic alone the same way, so the cost
can be traced to a kernel. ``--threads`` defaults to 1: on a shared 2-core machine, torch's
intra-op thread pool turns other processes' load into 10-50x swings of single kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from tmetrics_core import torch_private
from tmetrics_core.topology import Topology
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.kernels.rows import COLUMNS, rows
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.metrics.norms import NonFinite, ZeroFraction
from tmetrics_core.metrics.statistics import ABSMAX, COUNT, NONFINITE, SUMSQ, ZEROS
from tmetrics_core.site import Site

__all__ = ["FORMULATIONS", "bundle", "formulation_ms", "main", "model_tensors"]

BUNDLE = ("global-param-l2", "layer-param-l2", "global-grad-l2", "layer-grad-l2", "layer-param-absmax",
          "layer-grad-absmax", "layer-param-rms", "layer-grad-rms", "layer-grad-nonfinite",
          "layer-grad-zero-fraction")


_F64 = torch.float64
_FOREACH: dict[str, Callable[..., Any]] = {
    "abs": torch_private.foreach_abs, "clamp_max": torch_private.foreach_clamp_max,
    "clamp_min": torch_private.foreach_clamp_min, "max": torch_private.foreach_max, "neg": torch_private.foreach_neg,
    "norm": torch_private.foreach_norm, "powsum": torch_private.foreach_powsum}

FORMULATIONS: dict[str, Callable[[list[torch.Tensor]], object]] = {
    "sumsq: powsum(p=2, float64) [rows]": lambda ts: _FOREACH["powsum"](ts, 2, dtype=_F64),
    "sumsq: norm(p=2, float64)": lambda ts: _FOREACH["norm"](ts, 2, dtype=_F64),
    "sumsq: powsum(p=2), float32 sums (inexact)": lambda ts: _FOREACH["powsum"](ts, 2),
    "absmax: max(abs) [rows]": lambda ts: _FOREACH["max"](_FOREACH["abs"](ts)),
    "absmax: max(abs) in parts of 2**16 elements": lambda ts: [
        m for part in _in_parts(ts, 1 << 16) for m in _FOREACH["max"](_FOREACH["abs"](part))],
    "absmax: norm(p=inf, float64) [until issue 33]": lambda ts: _FOREACH["norm"](ts, float("inf"), dtype=_F64),
    "absmax: norm(p=inf)": lambda ts: _FOREACH["norm"](ts, float("inf")),
    "absmax: max and max(neg)": lambda ts: (_FOREACH["max"](ts), _FOREACH["max"](_FOREACH["neg"](ts))),
    "max: max [rows]": lambda ts: _FOREACH["max"](ts),
    "sum: p=1 norms of both clamps, float64 [rows]": lambda ts: (
        _FOREACH["norm"](_FOREACH["clamp_min"](ts, 0.0), 1, dtype=_F64),
        _FOREACH["norm"](_FOREACH["clamp_max"](ts, 0.0), 1, dtype=_F64)),
    "sum: powsum(p=1, float64) (|x|: the cost alone)": lambda ts: _FOREACH["powsum"](ts, 1, dtype=_F64),
    "zeros: norm(p=0, float64) [rows]": lambda ts: _FOREACH["norm"](ts, 0, dtype=_F64),
    "zeros: norm(p=0), float32 counts (inexact > 2**24)": lambda ts: _FOREACH["norm"](ts, 0),
}
"""Each column's batched formulation in :func:`~tmetrics_core.kernels.rows.rows` (``[rows]``) and
the alternatives measured against it, as functions of a tensor list."""


def _in_parts(ts: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """Consecutive parts of ``ts`` of at most ``budget`` elements each (a longer tensor alone)."""
    parts: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in ts:
        if size and size + t.numel() > budget:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.numel()
    return parts


def formulation_ms(tensors: list[torch.Tensor], rounds: int, repeats: int) -> dict[str, float]:
    """Milliseconds per 1 M elements of each of :data:`FORMULATIONS` over ``tensors``: median
    over interleaved rounds (order rotated) of each variant's median of ``repeats`` runs."""
    names = list(FORMULATIONS)
    per: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                FORMULATIONS[name](tensors)
                samples.append(time.perf_counter() - start)
            per[name].append(statistics.median(samples))
    numel = sum(t.numel() for t in tensors)
    return {name: statistics.median(times) * 1e3 * 1e6 / numel for name, times in per.items()}


def model_tensors(layers: int, width: int, seed: int = 0) -> tuple[list[Site], list[torch.Tensor]]:
    """Parameters and gradients of a ``layers``-deep transformer of ``width`` (fp32): per layer
    q, k, v, o (``width x width``), up, gate (``4 width x width``), down (``width x 4 width``)
    and two norm vectors; one site per tensor and kind."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"attn.q": (width, width), "attn.k": (width, width), "attn.v": (width, width),
              "attn.o": (width, width), "mlp.up": (4 * width, width), "mlp.gate": (4 * width, width),
              "mlp.down": (width, 4 * width), "attn_norm": (width,), "mlp_norm": (width,)}
    sites, tensors = [], []
    for layer in range(layers):
        for part, shape in shapes.items():
            name = f"layers.{layer}.{part}.weight"
            for kind, scale in (("param", 0.02), ("grad", 1e-3)):
                sites.append(Site(name, kind, shape, layer=layer, family=f"layers.*.{part}.weight"))
                tensors.append(torch.randn(shape, generator=g) * scale)
    return sites, tensors


def bundle() -> list:
    """The standard metrics: the catalogue's, plus parameter non-finite counts and zero fraction."""
    metrics = [build_metric(name) for name in BUNDLE]
    metrics.append(NonFinite(name="layer-param-nonfinite", source_kinds=["param"], scope="layer"))
    metrics.append(ZeroFraction(name="layer-param-zero-fraction", source_kinds=["param"], scope="layer"))
    return metrics


def _paired(variants: dict[str, Callable[[], object]], baseline: str, rounds: int, repeats: int) -> dict[str, float]:
    """Median over rounds of (variant's median time / baseline's in the same round)."""
    ratios: dict[str, list[float]] = {name: [] for name in variants if name != baseline}
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times: dict[str, float] = {}
        for name in order:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                variants[name]()
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
        for name in ratios:
            ratios[name].append(times[name] / times[baseline])
    return {name: statistics.median(values) for name, values in ratios.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="transformer layers (default 6)")
    parser.add_argument("--width", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant and round (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--formulations", action="store_true",
                        help="time each column's batched formulations per 1 M elements instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sites, tensors = model_tensors(args.layers, args.width)
    if args.formulations:
        numel = sum(t.numel() for t in tensors)
        print(f"{len(tensors)} fp32 tensors, {numel / 1e6:.1f} M elements, {args.threads} thread(s): "
              f"ms per 1 M elements, median over {args.rounds} interleaved rounds")
        for name, ms in formulation_ms(tensors, args.rounds, args.repeats).items():
            print(f"{ms:7.2f}  {name}")
        return
    metrics = bundle()
    topology = Topology.single_process()
    for metric in metrics:
        for site in sites:
            if metric.accepts(site):
                metric.check(site, topology)
    numel = sum(t.numel() for t in tensors)
    print(f"{len(tensors)} tensors, {numel / 1e6:.1f} M fp32 elements ({numel * 4 / 2**20:.0f} MiB), "
          f"{len(metrics)} metrics, {args.threads} thread(s)")

    def floor() -> object:
        return torch._foreach_norm(tensors, 2)

    def prepare() -> object:
        return prepare_states(metrics, sites, tensors, topology, {})

    variants: dict[str, Callable[[], object]] = {
        "foreach_norm": floor, "bundle prepare": prepare,
        "  rows, every column": lambda: rows(tensors, COLUMNS), "  rows, sumsq": lambda: rows(tensors, ("sumsq",))}
    for stat in (SUMSQ, ABSMAX, NONFINITE, ZEROS, COUNT):
        variants[f"  {stat.name}"] = (lambda s=stat: s.compute(tensors, sites, topology, rows(tensors, s.reads)
                                                               if s.reads else None))
    prepare()  # warm up allocator and kernels
    ratios = _paired(variants, "foreach_norm", args.rounds, args.repeats)
    print(f"bundle prepare / one _foreach_norm pass: {ratios.pop('bundle prepare'):.2f}x (target 1.5x)")
    print("one rows pass (every column, and sums of squares alone), and each statistic alone with its rows "
          "(same pairing):")
    for name, ratio in ratios.items():
        print(f"{name:<14} {ratio:.2f}x")


if __name__ == "__main__":
    main()
