"""What the attention metrics cost on a due step, next to the attention forward they re-read.

    python -m bench.attention_cost [--threads 2] [--repeats 7]

For attention shapes (the demo model's layer: batch 8, 4 heads, 128 tokens, head dim 32, and
larger ones), per layer: the causal SDPA forward (``F.scaled_dot_product_attention``, the
kernel the model runs) against the exact chunked recompute of the four statistics
(:func:`~tmetrics_core.metrics.attention.query_parts` and
:func:`~tmetrics_core.metrics.attention.head_summary`, float64), and the LSE-identity path
(one extra attention call with ``V = k`` that returns the log-sum-exp) with its entropy error
against the exact values at unit and x100 logits: the measurement that chose the exact path.
Medians of ``--repeats`` runs, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.metrics.attention import head_summary, query_parts

SHAPES = ((8, 4, 128, 32), (1, 8, 1024, 64), (1, 16, 2048, 64))
"""(batch, heads, tokens, head dim): the demo model's attention, then longer sequences."""


def _identity(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per-query entropy from an LSE-returning kernel: ``LSE - scale q . Attn(q, k, V=k)``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, is_causal=True)[:2]
    return lse - (q * q.shape[-1] ** -0.5 * out).sum(-1)


def _row(shape: tuple[int, int, int, int], repeats: int) -> str:
    b, h, t, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16().float() for _ in range(3))
    spec = AttentionSpec(causal=True)
    runs: dict[str, list[float]] = {"sdpa": [], "exact": [], "identity": []}
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "exact": lambda: head_summary(*_fields(query_parts(q, k, spec))),
             "identity": lambda: _identity(q, k)}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            runs[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(times) * 1e3 for name, times in runs.items()}
    errors = []
    for factor in (1.0, 10.0):
        qs, ks = (q * factor).bfloat16().float(), (k * factor).bfloat16().float()
        parts = query_parts(qs, ks, spec)
        exact = torch.log(parts.s) - parts.t / parts.s
        errors.append(float((_identity(qs, ks).double() - exact).abs().max() / exact.abs().mean()))
    return (f"| {b} x {h} x {t} x {d} | {ms['sdpa']:.1f} | {ms['exact']:.1f} ({ms['exact'] / ms['sdpa']:.0f}x) | "
            f"{ms['identity']:.1f} | {errors[0]:.1e} / {errors[1]:.1e} |")


def _fields(parts):
    return parts.m, parts.s, parts.t, parts.u, parts.counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| B x H x T x D | SDPA forward ms | exact recompute ms | LSE identity ms | identity entropy error (x1 / x100 logits) |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        print(_row(shape, args.repeats), flush=True)


if __name__ == "__main__":
    main()
