"""The step-overhead table on a CUDA machine, in absolute times from CUDA events.

    python -m bench.gpu_overhead [--rounds 30] [--steps 5] [--nproc N] [--d-model 512] ...

The same variants as ``bench.step_overhead`` (the standard bundle every 1, 10 and 100 steps
and on not-due steps, ``wandb.watch(log="all", log_freq=1)`` offline, a per-parameter
``.norm().item()`` loop) on the demo transformer, sized by the flags, on ``cuda:0``. The step
(forward, backward, ``observe_gradients``, ``clip_grad_norm_``, AdamW, ``zero_grad``) has no
host synchronisation of its own: the MoE runs the fixed-shape dispatch (no ``nonzero``), the
loss stays on the device, and a round's time is read from CUDA events once, after its steps.
Host synchronisations inside a step are counted with ``torch.cuda.set_sync_debug_mode``
(tmetrics: none on a not-due step; one result copy on a due step; none with
``read_results="next-step"``, whose copy is read at the next step's end). Peak memory per variant is
``torch.cuda.max_memory_allocated`` over three steps, each variant alone on the device.

With ``--nproc N`` (N <= number of GPUs) a second table runs N ranks under DDP on NCCL: the
bundle every step against the bare loop and the per-parameter loop with one ``all_reduce``
per norm, with collective calls per step and the host synchronisations of one step (tmetrics:
one, the results' copy; its agreements run on the host over a gloo group).

Then, on ``cuda:0``, the tables of ``bench.scaling`` (tensors: torch ops per due step, time per
due step against one ``torch._foreach_norm`` pass, with the host synchronisations of a due step
counted by ``torch.cuda.set_sync_debug_mode``) and of ``bench.compile_counts`` (graphs, graph
breaks, recompiles under ``torch.compile(fullgraph=True)`` with ``inductor``); ``--skip-tables``
leaves them out.

Without a CUDA device it prints why and exits with status 2; the CPU tables of
``bench.step_overhead`` are the reference figures in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.demo_variants import BUNDLE, NEVER, NormLoop, WandbWatch
from bench.rounds import Rounds
from tmetrics_core.topology import Topology
from tmetrics_core.demo.model import ModelConfig, Transformer, fixed_shape_dispatch
from tmetrics_core.demo.train import NullMetrics
from tmetrics_core.distributed.host_copy import HostCopy
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["main"]

VARIANTS = ("bare", "tmetrics every 1", "tmetrics every 1 next-step", "tmetrics every 10", "tmetrics every 100",
            "tmetrics not due", "wandb.watch all/1", "norm().item() loop")
DDP_VARIANTS = ("bare", "tmetrics every 1", "tmetrics every 1 next-step", "norm + all_reduce each")


@dataclass
class _Job:
    """One variant: its model, optimizer, metrics object and step counter on one device."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    metrics: Any
    batches: list[torch.Tensor]
    step: int = 0

    def run(self, steps: int) -> None:
        vocab = 256
        for _ in range(steps):
            self.step += 1
            tokens = self.batches[self.step % len(self.batches)]
            with self.metrics.step(self.step):
                logits = self.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
                loss.backward()
                self.metrics.observe_gradients()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, d_ff=args.d_ff,
                       n_experts=args.experts, top_k=args.top_k, seq_len=args.seq_len)


def _job(name: str, args: argparse.Namespace, device: torch.device, *, ddp: bool = False) -> _Job:
    config = _config(args)
    model = Transformer(config, seed=0).to(device)
    for block in model.layers.values():
        if hasattr(block, "moe"):
            block.moe.dispatch = fixed_shape_dispatch
    module: torch.nn.Module = model
    if ddp:
        module = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)
    generator = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, config.seq_len + 1), generator=generator).to(device)
               for _ in range(4)]
    return _Job(module, optimizer, _metrics(name, module, optimizer, ddp), batches)


def _metrics(name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, ddp: bool) -> Any:
    if name == "bare":
        return NullMetrics()
    if name.startswith("tmetrics"):
        interval = NEVER if name.endswith("not due") else int(name.split()[2])
        topology = Topology.from_groups({"dp": dist.group.WORLD}) if ddp else None
        return TensorMetrics(module, metrics=[(build_metric(n), interval) for n in BUNDLE], optimizer=optimizer,
                             topology=topology, read_results="next-step" if name.endswith("next-step") else "now")
    if name.startswith("wandb"):
        return WandbWatch(module)
    return NormLoop(module, all_reduce=name.startswith("norm + all_reduce"))


def _interleave(jobs: dict[str, _Job], rounds: int, steps: int) -> Rounds:
    """Rounds as in ``bench.rounds``, timed by CUDA events (milliseconds -> seconds per step)."""
    names = list(jobs)
    out = Rounds({n: [] for n in names}, {n: [] for n in names})
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            jobs[name].run(steps)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / steps
            out.wall[name].append(seconds)
            out.cpu[name].append(seconds)
    return out


@contextlib.contextmanager
def _counting_syncs() -> Iterator[list[int]]:
    """Counts the host's waits for the device inside the block (in the yielded list's one
    element, set on exit): ``set_sync_debug_mode`` warnings (``.item()``, blocking copies,
    ``nonzero``), and reads of tmetrics' results copy whose event had not completed, a wait
    that mode does not report (an event's ``synchronize``)."""
    torch.cuda.synchronize()
    count = [0]
    waited = [0]
    original = HostCopy.read

    def read(copy: HostCopy) -> list[float]:
        waited[0] += not copy.ready()
        return original(copy)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HostCopy.read = read  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode("default")
            HostCopy.read = original  # type: ignore[method-assign]
    count[0] = sum("synchroniz" in str(w.message) for w in caught) + waited[0]


def _syncs(job: _Job) -> int:
    """Host waits for the device during one step (:func:`_counting_syncs`)."""
    with _counting_syncs() as count:
        job.run(1)
    return count[0]


def _peak_bytes(name: str, args: argparse.Namespace, device: torch.device) -> int:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    job = _job(name, args, device)
    job.run(3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    job.run(3)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    job.metrics.close()
    del job
    return peak


def single_gpu(args: argparse.Namespace) -> list[str]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    jobs = {name: _job(name, args, device) for name in VARIANTS}
    for job in jobs.values():
        job.run(2)  # warm-up; spends the always-due first step of "not due"
    result = _interleave(jobs, args.rounds, args.steps)
    syncs = {name: _syncs(jobs[name]) for name in ("bare", "tmetrics every 1", "tmetrics every 1 next-step",
                                                    "tmetrics not due", "norm().item() loop")}
    for job in jobs.values():
        job.metrics.close()
    jobs.clear()
    peaks = {name: _peak_bytes(name, args, device) for name in ("bare", "tmetrics every 1", "norm().item() loop")}
    base = "bare"
    lines = [f"GPU table: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, model {_config(args)}, "
             f"batch {args.batch}, {args.rounds} rounds x {args.steps} steps (CUDA events)",
             f"{'variant':<28} {'ms/step':>8} {'x bare':>7} {'mean x':>7} {'host syncs/step':>16} {'peak MiB':>9}"]
    for name in VARIANTS:
        sync = f"{syncs[name]:>16}" if name in syncs else f"{'':>16}"
        peak = f"{peaks[name] / 2**20:>9.1f}" if name in peaks else f"{'':>9}"
        lines.append(f"{name:<28} {result.median_ms(name):>8.3f} {result.paired(name, base):>7.3f} "
                     f"{result.mean(name, base):>7.3f} {sync} {peak}")
    lines.append("x bare: median over rounds of the paired ratio; mean x: trimmed mean of the per-round ratios; "
                 "host syncs: during one step; peak: torch.cuda.max_memory_allocated above the memory before the "
                 "variant existed")
    return lines


def _ddp_rank(rank: int, world: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        jobs = {name: _job(name, args, device, ddp=True) for name in DDP_VARIANTS}
        for job in jobs.values():
            job.run(2)
        syncs = {name: _syncs(jobs[name]) for name in ("bare", "tmetrics every 1", "tmetrics every 1 next-step")}
        tracked = ("tmetrics every 1", "tmetrics every 1 next-step")
        calls = {name: jobs[name].metrics.executor.stats.total_calls for name in tracked}
        loop = jobs["norm + all_reduce each"].metrics.collectives
        result = _interleave(jobs, args.rounds, args.steps)
        n = args.rounds * args.steps
        per_step = {"bare": 0.0, "norm + all_reduce each": (jobs["norm + all_reduce each"].metrics.collectives - loop) / n,
                    **{name: (jobs[name].metrics.executor.stats.total_calls - calls[name]) / n for name in tracked}}
        if rank == 0:
            queue.put((result.wall, per_step, syncs))
    finally:
        dist.destroy_process_group()


def multi_gpu(args: argparse.Namespace) -> list[str]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_ddp_rank, args=(args.nproc, args, port, queue), nprocs=args.nproc, start_method="spawn")
    wall, calls, syncs = queue.get(timeout=60)
    result = Rounds(wall, wall)
    lines = [f"DDP table: {args.nproc} ranks on NCCL, {args.rounds} rounds x {args.steps} steps (rank 0, CUDA events)",
             f"{'variant':<28} {'ms/step':>8} {'x bare':>7} {'metric collectives/step':>24} {'host syncs/step':>16}"]
    for name in DDP_VARIANTS:
        sync = f"{syncs[name]:>16}" if name in syncs else f"{'':>16}"
        lines.append(f"{name:<28} {result.median_ms(name):>8.3f} {result.paired(name, 'bare'):>7.3f} "
                     f"{calls[name]:>24.1f} {sync}")
    lines.append("host syncs: during one step on rank 0 (set_sync_debug_mode); tmetrics' agreements run on the host "
                 "over its gloo control group, its results leave the device in one copy")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant and round (default 5)")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs for the DDP table (default 1: no DDP table)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step and rank (default 16)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--d-ff", type=int, default=1024, help="expert hidden width (default 1024)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE block (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--skip-tables", action="store_true", help="leave out the scaling and compile tables")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write(f"bench.gpu_overhead needs a CUDA device, and torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a "
                         "GPU machine; on this one, python -m bench.step_overhead gives the CPU tables.\n")
        raise SystemExit(2)
    if args.nproc > torch.cuda.device_count():
        sys.stderr.write(f"--nproc {args.nproc} but only {torch.cuda.device_count()} CUDA device(s) are visible\n")
        raise SystemExit(2)
    for line in single_gpu(args):
        print(line)
    if args.nproc > 1:
        print()
        for line in multi_gpu(args):
            print(line)
    if not args.skip_tables:
        print()
        device_tables()


def device_tables() -> None:
    """bench.scaling's tensor table and bench.compile_counts' table on ``cuda``, and the host
    synchronisations of one due step at the largest tensor count."""
    from bench import compile_counts, scaling

    rows = scaling.tensor_table(large=False, device="cuda")
    scaling.print_tensors(rows)
    print(f"host synchronisations in one due step ({syncs_of_due_step()} counted by set_sync_debug_mode)")
    print()
    print("| backend | token metrics due | graphs | graph breaks | recompiles after step 1 | warnings |")
    print("|---|---|---|---|---|---|")
    for cadence, interval in compile_counts.CADENCES.items():
        counts = compile_counts.run("inductor", interval, device="cuda")
        print(f"| inductor | {cadence} | {counts.graphs} | {counts.breaks} | {counts.recompiles} | {len(counts.warnings)} |")


def syncs_of_due_step() -> int:
    """Synchronising CUDA calls in one due step of the scaling bench's largest default model
    (after its first due step, which plans), counted by :func:`_counting_syncs`."""
    from bench import scaling

    layers, experts, width = scaling.TENSOR_CASES[-1]
    model = scaling._moe(layers, experts, width).to("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    from tmetrics_core.tensor_metrics import TensorMetrics

    metrics = TensorMetrics.from_config({"metrics": [f"{n}:1" for n in scaling.TENSOR_METRICS], "sinks": {}},
                                        model=model, optimizer=optimizer)
    with metrics.step(1):
        optimizer.step()
    with _counting_syncs() as count:
        with metrics.step(2):
            optimizer.step()
    metrics.close()
    return count[0]


if __name__ == "__main__":
    main()
