"""What replica verification costs, at start-up and on a due step, against a due step without it.

    python -m bench.verification_cost [--rounds 30] [--steps 3] [--layers 8] [--width 256]

2 gloo ranks, real DDP over ``dp`` (every tensor a Replica claim), a stack of ``--layers``
blocks of two ``--width`` x ``--width`` linears, Adam, and five parameter-side metrics due every
step (global and per-layer gradient L2, per-layer parameter L2, Adam state RMS, update ratio).
Three variants run side by side in one process, interleaved in rounds with the order rotated
(``bench.rounds``), so the machine's drift hits them alike:

- ``due step``: a training step with every metric due, ``verify_replicas: never``;
- ``due step + verification``: the same with ``always``, which checks the parameters,
  gradients and both Adam states at every due step: what the first due step costs under the
  default ``first`` (later due steps then cost as ``due step``);
- ``start-up verification``: the parameter check ``TensorMetrics`` runs once when built.

Printed: median milliseconds per step (rank 0) and each variant's paired ratio to ``due step``
(start-up: its time over a due step's, so 0.05 is 5% of one due step, paid once).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench.rounds import interleave
from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

__all__ = ["main"]

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-param-l2", "layer-optimizer-state-rms", "layer-update-ratio")


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


class _Trainer:
    """One DDP model with its optimizer and TensorMetrics, stepping on fixed batches."""

    def __init__(self, rank: int, layers: int, width: int, mode: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.parallel.DistributedDataParallel(_Stack(layers, width))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.metrics = TensorMetrics(self.model, metrics=[(build_metric(n), 1) for n in METRICS],
                                     optimizer=self.optimizer, topology=Topology.from_groups({"dp": dist.group.WORLD}),
                                     verify_replicas=mode, timeout_s=120)
        self.batch = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            with self.metrics.step(self.step):
                self.model(self.batch).square().mean().backward()
                self.optimizer.step()
                self.optimizer.zero_grad()


def _rank(rank: int, world: int, rounds: int, steps: int, layers: int, width: int) -> dict:
    plain = _Trainer(rank, layers, width, "never")
    checked = _Trainer(rank, layers, width, "always")
    params = checked.metrics.manifest.sites("param")

    def startup(n: int) -> None:
        for _ in range(n):
            checked.metrics.params.replicas.verify(["param"], params, "at start-up")

    for trainer in (plain, checked):
        trainer.run(2)  # warm-up: Adam state exists, first-step work done
    result = interleave({"due step": plain.run, "due step + verification": checked.run,
                         "start-up verification": startup}, rounds=rounds, steps=steps)
    claims = sum(1 for e in checked.metrics.manifest.entries for a, _ in e.origins if a == "dp")
    out: dict[str, object] = {"claims": claims, "params": sum(p.numel() for p in plain.model.parameters())}
    for name in result.wall:
        out[name] = (result.median_ms(name), result.paired(name, "due step"))
    plain.metrics.close()
    checked.metrics.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    out = run_distributed(_rank, 2, args.rounds, args.steps, args.layers, args.width, timeout=3600)[0]
    print(f"2 gloo ranks, DDP, {args.layers} blocks of 2 x {args.width}^2 linears ({out['params']:,} parameters, "
          f"{out['claims']} Replica claims on dp), {len(METRICS)} metrics due every step; "
          f"{args.rounds} rounds x {args.steps} steps, rank 0")
    print(f"{'variant':<26}{'ms per step':>12}{'ratio to due step':>19}")
    for name in ("due step", "due step + verification", "start-up verification"):
        ms, ratio = out[name]
        print(f"{name:<26}{ms:>12.2f}{ratio:>19.3f}")


if __name__ == "__main__":
    main()
