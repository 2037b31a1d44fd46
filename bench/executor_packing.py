"""Collective calls and wall time of the executor against the two usual designs.

    python -m bench.executor_packing [--rounds 20]

4 gloo ranks as DP2 x TP2, 8 metrics over 100 tensors of 20 distinct shapes (Shard on both axes,
some tensors Owned on dp). Three ways to reduce the same prepared states:

- tmetrics: one executor pass over all metrics (requests packed per axis, op, dtype; shared
  statistics sent once);
- per metric: one executor pass per metric (one packed call per metric per round and axis,
  the reference design);
- per tensor: one executor pass per (metric, tensor): one all_reduce per tensor.

Rounds alternate the variants (order rotated) so machine drift cancels; the table gives the
median wall time per step, calls per step, and ratios against tmetrics, from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.harness import run_distributed
from tests.distributed.test_executor import eight_metrics, hundred_sites
from tmetrics_core.topology import Topology
from tmetrics_core.metrics.preparation import prepare_states
from tmetrics_core.distributed.executor import Executor


def _variant(name, metrics, sites, tensors, topology):
    """Prepare outside the clock, then time only the reductions (communication and packing)."""
    site_map = {s.key: s for s in sites}
    executor = Executor(topology, timeout_s=60)
    if name == "tmetrics":
        passes = [(prepare_states(metrics, sites, tensors, topology), site_map)]
    elif name == "per metric":
        passes = [(prepare_states([m], sites, tensors, topology), site_map) for m in metrics]
    else:
        passes = [(prepare_states([m], [s], [t], topology), {s.key: s})
                  for m in metrics for s, t in zip(sites, tensors) if m.accepts(s)]
    start = time.perf_counter()
    for prepared, sites_of_pass in passes:
        executor.run(prepared, sites_of_pass)
    return time.perf_counter() - start, executor.stats


def _rank(rank, world, rounds):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    topology = Topology.from_mesh(mesh)
    sites, tensors = hundred_sites(topology)
    metrics = eight_metrics()
    names = ["tmetrics", "per metric", "per tensor"]
    times = {n: [] for n in names}
    comm = {n: [] for n in names}
    calls = {}
    for r in range(rounds):
        order = names[r % 3:] + names[:r % 3]
        for n in order:
            seconds, stats = _variant(n, metrics, sites, tensors, topology)
            times[n].append(seconds)
            comm[n].append(stats.seconds)
            calls[n] = (sum(c for a, c in stats.calls.items() if a != "world"), stats.calls.get("world", 0),
                        sum(e for a, e in stats.elements.items() if a != "world"))
    return times, comm, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times, comm, calls = run_distributed(_rank, 4, args.rounds, timeout=900)[0]
    base_t = statistics.median(times["tmetrics"])
    base_comm = statistics.median(comm["tmetrics"])
    base_c = calls["tmetrics"][0] + calls["tmetrics"][1]
    print(f"8 metrics x 100 tensors (20 shapes), 4 gloo ranks DP2 x TP2, {args.rounds} alternating rounds")
    print(f"{'variant':<12} {'data calls':>10} {'control':>8} {'elements':>9} {'pass ms':>8} {'comm ms':>8} "
          f"{'calls x':>8} {'pass x':>7} {'comm x':>7}")
    for n in ["tmetrics", "per metric", "per tensor"]:
        data, control, elements = calls[n]
        t = statistics.median(times[n])
        c = statistics.median(comm[n])
        print(f"{n:<12} {data:>10} {control:>8} {elements:>9} {t * 1e3:>8.1f} {c * 1e3:>8.2f} "
              f"{(data + control) / base_c:>8.1f} {t / base_t:>7.1f} {c / base_comm:>7.1f}")
    print("pass ms: the whole reduction pass (Python planning, packing, collectives, host copy); "
          "comm ms: time inside the data collectives only; x: ratio to tmetrics")


if __name__ == "__main__":
    main()
