"""How tmetrics' cost grows with the world size and with the number of tensors.

    python -m bench.scaling [--large] [--plot PATH] [--no-world] [--no-tensors] [--no-flat] [--quant]

Table 1, a simulated world (``bench.recording``): 8 to 16,384 ranks on a pp x dp x ep x tp mesh,
the demo transformer (4 layers, 8 experts per MoE block, 128 tensors, attention weights declared
Shard on tp) split over pp (layers) and ep (experts). One thread per (pp, ep) class runs TensorMetrics
through the recording collectives seam; the table gives, for the rank that moves the most,
the collective calls and bytes of start-up (manifest exchange, configuration checks, replica
verification of the parameters), of the first due step (with the plan check and the gradients'
replica verification) and of a later due step, and each one's growth against the smallest
world. ``world gather`` is what the design before this round received at start-up: every
rank's manifest rows, world x the rows one rank lists.

Table 2, tensors: 100 to 10,000 parameter tensors on one process (layers x experts of tiny
experts, so per-tensor costs show; ``--large`` adds the 10,000 row and a series with realistic
sizes), through the public API only (``TensorMetrics.from_config`` and ``step``), with global
and per-layer L2 of parameters and gradients, gradient absmax, non-finite count and update ratio
due every step: torch ops tmetrics issues per due step (counted with a ``TorchDispatchMode``),
its CPU time per due step (thread time, median of alternating rounds, so other processes on a
shared machine do not inflate it), that time per tensor, and one ``torch._foreach_norm`` pass
over the same gradients for scale. ``--plot`` saves both series as
a figure when matplotlib is installed.

Table 3, flat buffers: two rows of table 2 on a ``dp`` axis of one rank, the gradients read from
``.grad``, from one flat buffer holding their values (ZeRO's layout), and as per-parameter parts
of ``main_grad`` (Megatron's distributed optimizer: ``OwnedRanges``).

Table 4 (``--quant``), low-precision statistics: ``layer-param-quant`` due every step with one
recipe at a time (:data:`QUANT_RECIPES`), measured as table 2's rows on tensor counts and sizes
(:data:`QUANT_CASES`): torch ops and CPU ms per due step, per tensor and per million elements.
The backward metrics need a forward and a backward, which these rows (an optimizer step on set
gradients) do not run: ``bench.step_overhead --compare backward=1`` measures them.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.recording import RecordingCollectives, SymmetricWorld
from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.integrations.megatron_shards import OwnedRanges
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.placements import Shard
from tmetrics_core.sources.flat import FlatBuffer
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Axis, Topology

__all__ = ["main", "world_rank"]

MESHES = ((2, 1, 2, 2), (2, 4, 2, 4), (4, 8, 4, 4), (4, 32, 4, 8), (4, 128, 4, 8))
"""pp x dp x ep x tp, worlds 8 to 16,384."""

WORLD_METRICS = ("global-grad-l2", "layer-param-l2", "layer-grad-l2", "layer-grad-absmax", "expert-grad-l2")

TENSOR_METRICS = ("global-grad-l2", "layer-param-l2", "layer-grad-l2", "layer-grad-absmax",
                  "layer-grad-nonfinite", "layer-update-ratio")


# -- table 1: the simulated world -------------------------------------------------------------
def world_rank(rank: int, seam: RecordingCollectives, world: SymmetricWorld, *, layers: int = 4,
               experts: int = 8) -> dict[str, Any]:
    """One representative of a pp x dp x ep x tp world: (calls, bytes) of start-up, of the first
    due step and of a later one, and the start-up bytes of the world gather before this round."""
    torch.set_num_threads(1)
    pp, _, ep, _ = world.coords(rank)
    pp_size, _, ep_size, _ = world.shape
    config = ModelConfig(d_model=8, n_heads=2, d_ff=8, n_layers=layers, n_experts=experts, vocab_size=16)
    per_stage, per_ep = config.n_layers // pp_size, config.n_experts // ep_size
    model = Transformer(config, layers=range(pp * per_stage, (pp + 1) * per_stage),
                        experts=range(ep * per_ep, (ep + 1) * per_ep), embed=pp == 0, head=pp == pp_size - 1)
    attn = {name: {"tp": Shard(0)} for name, _ in model.named_parameters() if ".attn." in name}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in WORLD_METRICS], optimizer=optimizer,
                            topology=world.topology(rank), collectives=seam, framework_placements=attn)
    held = [(e.name, e.original, e.layer, e.expert, e.component, e.family, e.shape, e.dtype, (), ())
            for e in metrics.manifest.entries if e.name in metrics.manifest.local]
    before = (rank, world.coords(rank), held, 0)  # what each rank sent to all before this round
    out: dict[str, Any] = {"start-up": (sum(seam.calls.values()), sum(seam.bytes.values())),
                           "tensors": len(metrics.manifest.entries), "labels": dict(seam.bytes),
                           "world gather": world.world_size * len(pickle.dumps(before))}
    for step, label in ((1, "first due step"), (2, "due step")):
        seam.reset()
        for p in model.parameters():
            p.grad = p.detach() * 0.5
        with metrics.step(step):
            optimizer.step()
        out[label] = (sum(seam.calls.values()), sum(seam.bytes.values()))
    metrics.close()
    return out


def world_table() -> list[dict[str, Any]]:
    rows = []
    for shape in MESHES:
        world = SymmetricWorld(shape, ("pp", "dp", "ep", "tp"), class_axes=("pp", "ep"))
        by_rank = world.run(lambda rank, seam: world_rank(rank, seam, world))
        worst = {k: max(r[k] for r in by_rank.values()) for k in ("start-up", "first due step", "due step")}
        sample = next(iter(by_rank.values()))
        rows.append({"shape": shape, "world": world.world_size, "tensors": sample["tensors"],
                     "world gather": max(r["world gather"] for r in by_rank.values()), **worst})
    return rows


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def print_world(rows: list[dict[str, Any]]) -> None:
    print("Table 1: per-rank collective calls and bytes, simulated world (pp x dp x ep x tp), worst rank")
    head = f"{'world':>6} {'pp x dp x ep x tp':>18} {'tensors':>7} | {'start-up calls':>14} {'bytes':>10} {'x':>5} | " \
           f"{'1st due calls':>13} {'bytes':>10} {'x':>5} | {'due calls':>9} {'bytes':>9} {'x':>5} | " \
           f"{'world gather (before)':>21}"
    print(head)
    print("-" * len(head))
    base = rows[0]
    for r in rows:
        cells = [f"{r['world']:>6} {' x '.join(map(str, r['shape'])):>18} {r['tensors']:>7}"]
        for key, widths in (("start-up", (14, 10)), ("first due step", (13, 10)), ("due step", (9, 9))):
            calls, nbytes = r[key]
            cells.append(f"{calls:>{widths[0]}} {_size(nbytes):>{widths[1]}} {nbytes / base[key][1]:>5.2f}")
        cells.append(f"{_size(r['world gather']):>21}")
        print(" | ".join(cells))
    print("x: bytes against the 8-rank world. Bytes: all_reduce message size, all_gather received.")


# -- table 2: tensors -------------------------------------------------------------------------
class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _moe(layers: int, experts: int, width: int) -> Transformer:
    config = ModelConfig(d_model=width, n_heads=2, d_ff=width, n_layers=layers, n_experts=experts, vocab_size=16)
    return Transformer(config)


def _tensor_case(layers: int, experts: int, width: int, rounds: int, device: str, gradients: str | None = None,
                 entries: list[Any] | None = None) -> dict[str, Any]:
    """One row: table 2's (``gradients`` None, through ``from_config``; table 4's with the config
    metric entries ``entries`` in place of :data:`TENSOR_METRICS`), or table 3's (the same
    metrics on a ``dp`` axis of one rank, the gradients read from ``.grad``, from one flat
    buffer holding their values (``"flat buffer"``: ZeRO's layout) or as each parameter's part
    of ``main_grad`` (``"megatron parts"``: Megatron's distributed optimizer))."""
    torch.manual_seed(0)
    model = _moe(layers, experts, width).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    if gradients is not None:
        buffers: list[FlatBuffer] = []
        if gradients == "flat buffer":
            buffers = [FlatBuffer("grad", "dp", params, torch.cat([p.grad.reshape(-1) for p in params]), 0)]
        elif gradients == "megatron parts":
            for p in params:
                p.main_grad = p.grad  # type: ignore[attr-defined]
            ranges = {id(p): (0, p.numel()) for p in params}
            buffers = [OwnedRanges("grad", "dp", params, torch.empty(0), 0, ranges=ranges,
                                   fetch=lambda p: (p.main_grad, 0))]
        metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in TENSOR_METRICS], optimizer=optimizer,
                                topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1),
                                flat_buffers=buffers)
        return _measure(metrics, model, optimizer, rounds, device)
    config = {"metrics": entries or [f"{name}:1" for name in TENSOR_METRICS], "sinks": {}}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as run_dir:
        return _measure(TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=run_dir),
                        model, optimizer, rounds, device)


def _clock(device: str) -> Any:
    """Seconds: this thread's CPU time on the CPU (what the step costs, not what the other
    processes on a shared machine take from it); wall time after a device synchronisation on an
    accelerator, whose kernels run asynchronously."""
    if device == "cpu":
        return time.thread_time

    def synced() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()
    return synced


def _measure(metrics: TensorMetrics, model: Transformer, optimizer: torch.optim.Optimizer,
             rounds: int, device: str) -> dict[str, Any]:
    params = list(model.parameters())
    clock = _clock(device)

    def due(step: int) -> float:
        start = clock()
        with metrics.step(step):
            optimizer.step()
        return clock() - start

    def bare() -> float:
        start = clock()
        optimizer.step()
        return clock() - start

    def foreach() -> float:
        start = clock()
        torch._foreach_norm([p.grad for p in params])  # type: ignore[misc]
        return clock() - start

    due(1)  # the first due step plans
    counter = _CountOps()
    with counter:
        bare()
    bare_ops = counter.ops
    counter = _CountOps()
    with counter:
        due(2)
    tm_ops = counter.ops - bare_ops
    with_tm, without, norm = [], [], []
    for r in range(rounds):
        with_tm.append(due(3 + r))
        without.append(bare())
        norm.append(foreach())
    metrics.close()
    seconds = max(statistics.median(with_tm) - statistics.median(without), 0.0)
    config = model.config
    return {"tensors": len(params), "elements": sum(p.numel() for p in params), "layers": config.n_layers, "experts": config.n_experts, "width": config.d_model,
            "ops": tm_ops,
            "ms": seconds * 1e3, "us per tensor": seconds * 1e6 / len(params),
            "foreach ms": statistics.median(norm) * 1e3}


TENSOR_CASES = ((2, 16, 8), (16, 8, 8), (8, 40, 8), (16, 64, 8))
"""(layers, experts, width): 114 to 3,188 tensors, tiny (width 8) so per-tensor costs show."""

LARGE_CASES = ((8, 256, 8), (13, 256, 8), (2, 16, 512), (8, 40, 512))
"""``--large``: 6,204 and 10,079 tiny tensors, and 114 and 1,020 tensors of realistic width
(d_model = d_ff = 512)."""


def tensor_table(large: bool, device: str = "cpu") -> list[dict[str, Any]]:
    """Table 2's rows on ``device`` (``cpu`` or ``cuda``)."""
    cases = TENSOR_CASES + (LARGE_CASES if large else ())
    return [_tensor_case(layers, experts, width, rounds=15 if layers * experts < 2000 else 7, device=device)
            for layers, experts, width in cases]


def print_tensors(rows: list[dict[str, Any]]) -> None:
    print(f"Table 2: one process, {', '.join(TENSOR_METRICS)} due every step")
    head = (f"{'tensors':>7} {'layers x experts':>16} {'width':>5} | {'torch ops/due step':>18} | "
            f"{'tmetrics ms/due step':>20} {'us/tensor':>9} {'marginal':>8} | "
            f"{'_foreach_norm ms':>16} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    previous: dict[str, Any] | None = None
    for r in rows:
        ratio = r["ms"] / r["foreach ms"] if r["foreach ms"] else math.nan
        marginal = (f"{(r['ms'] - previous['ms']) * 1e3 / (r['tensors'] - previous['tensors']):>8.1f}"
                    if previous is not None and r["tensors"] > previous["tensors"] and r["width"] == previous["width"]
                    else f"{'':>8}")
        print(f"{r['tensors']:>7} {str(r['layers']) + ' x ' + str(r['experts']):>16} {r['width']:>5} | "
              f"{r['ops']:>18} | {r['ms']:>20.2f} {r['us per tensor']:>9.1f} "
              f"{marginal} | {r['foreach ms']:>16.3f} {ratio:>6.1f}")
        previous = r
    print("tmetrics ms: median due step with tmetrics minus the median bare optimizer step (thread CPU time on "
          "the CPU, synchronised wall time on an accelerator); torch ops: those above the bare step's; "
          "marginal: us per tensor added since the row above (the per-tensor cost without the fixed one).")


FLAT_CASES = ((16, 8, 8), (16, 64, 8))
"""Table 3's (layers, experts, width): 499 and 3,188 tiny tensors."""


def flat_table(device: str = "cpu") -> list[dict[str, Any]]:
    """Table 3's rows: each case with its gradients in each layout."""
    rows = []
    for layers, experts, width in FLAT_CASES:
        for gradients in (".grad", "flat buffer", "megatron parts"):
            row = _tensor_case(layers, experts, width, rounds=9, device=device, gradients=gradients)
            rows.append(row | {"gradients": gradients})
    return rows


def print_flat(rows: list[dict[str, Any]]) -> None:
    print(f"Table 3: gradients in a flat buffer (ZeRO's layout), one process, {', '.join(TENSOR_METRICS)} due every step")
    head = f"{'tensors':>7} {'gradients':>14} | {'torch ops/due step':>18} | {'tmetrics ms/due step':>20} {'us/tensor':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['tensors']:>7} {r['gradients']:>14} | {r['ops']:>18} | {r['ms']:>20.2f} {r['us per tensor']:>9.1f}")


QUANT_RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")
"""Table 4's recipes, one per row (docs/low-precision.md)."""

QUANT_CASES = ((2, 16, 8), (16, 8, 8), (2, 16, 64))
"""Table 4's (layers, experts, width): 114 and 499 tiny tensors (per-tensor cost), then 114
tensors of width 64 (per-element cost)."""


def quant_table(device: str = "cpu") -> list[dict[str, Any]]:
    """Table 4's rows: each case with ``layer-param-quant`` of each recipe due every step."""
    rows = []
    for layers, experts, width in QUANT_CASES:
        for recipe in QUANT_RECIPES:
            entry = {"name": "layer-param-quant", "interval": 1, "recipe": [recipe]}
            row = _tensor_case(layers, experts, width, rounds=5, device=device, entries=[entry])
            rows.append(row | {"recipe": recipe})
    return rows


def print_quant(rows: list[dict[str, Any]]) -> None:
    print("Table 4: low-precision statistics, one process, layer-param-quant due every step, one recipe per row")
    head = (f"{'tensors':>7} {'elements':>9} {'recipe':>14} | {'torch ops/due step':>18} | "
            f"{'tmetrics ms/due step':>20} {'us/tensor':>9} {'ms/M elements':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['tensors']:>7} {r['elements']:>9} {r['recipe']:>14} | {r['ops']:>18} | {r['ms']:>20.2f} "
              f"{r['us per tensor']:>9.1f} {r['ms'] * 1e6 / r['elements']:>13.1f}")
    print("As table 2: thread CPU time of the due step less the bare optimizer step; torch ops above the bare step's.")


def plot(rows: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed in this environment: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ops, ms) = plt.subplots(1, 2, figsize=(10, 4))
    for width in sorted({r["width"] for r in rows}):
        series = sorted((r for r in rows if r["width"] == width), key=lambda r: r["tensors"])
        n = [r["tensors"] for r in series]
        ops.plot(n, [r["ops"] for r in series], "o-", label=f"width {width}")
        ms.plot(n, [r["ms"] for r in series], "o-", label=f"tmetrics, width {width}")
        ms.plot(n, [r["foreach ms"] for r in series], "x--", label=f"foreach_norm pass, width {width}")
    for ax, title in ((ops, "torch ops per due step"), (ms, "ms per due step")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameter tensors")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    return f"plot saved to {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="add ~10,000 tensors and realistic widths")
    parser.add_argument("--plot", default="runs/bench_scaling.png", help="figure path for table 2")
    parser.add_argument("--no-world", action="store_true")
    parser.add_argument("--no-tensors", action="store_true")
    parser.add_argument("--no-flat", action="store_true")
    parser.add_argument("--quant", action="store_true", help="add table 4, the low-precision statistics per recipe")
    parser.add_argument("--device", default="cpu", help="device of table 2 (bench.gpu_overhead passes cuda)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    if not args.no_world:
        print_world(world_table())
        print()
    if not args.no_tensors:
        rows = tensor_table(args.large, args.device)
        print_tensors(rows)
        print(plot(rows, args.plot))
    if not args.no_flat:
        print()
        print_flat(flat_table(args.device))
    if args.quant:
        print()
        print_quant(quant_table(args.device))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
