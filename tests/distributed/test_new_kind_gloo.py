"""A source kind added from outside the product, as docs/architecture.md's recipe says: its
record naming its installer (registered here, where a plugin would register it) and the
installer, both in this file; ``scope/observation_hooks.py`` knows nothing of it.

The kind, ``norm_input``, is the input of every ``LayerNorm``, read by a forward pre-hook. A
layer L2 norm and RMS of it, over two micro-batches and two steps, equal float64 over every
rank's tokens, at 1 rank and at 2 (``dp``, each rank its own half of the batch); after
``close()`` the installer's hooks are gone, and after the undo the kind is gone from the sets."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_distributed
from tmetrics_core import kinds
from tmetrics_core.kinds import Reader, SourceKind, register_kind
from tmetrics_core.metrics.norms import L2Norm, Rms
from tmetrics_core.sources.hook_context import HookContext
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology

def norm_input(token_rows: bool = True) -> SourceKind:
    """The kind's record; its rows are tokens or not (a kind without token rows is hooked too)."""
    return SourceKind("norm_input", (Reader.FORWARD,), (f"{__name__}:install_norm_inputs",), token_rows=token_rows,
                      feeds="norm_input sites are the inputs of LayerNorm modules; none ran in the step scope")
CALLS = [0]
"""How many times the installer's hooks ran in this process."""
LAYERS, WIDTH, BATCH, SEQ, MICRO, STEPS = 3, 8, 4, 5, 2, 2


def install_norm_inputs(hooks: HookContext) -> list:
    """The kind's installer: a forward pre-hook on every LayerNorm of the model."""
    record = hooks.record

    def hook(module: nn.Module, args: tuple) -> None:
        CALLS[0] += 1
        record(module, "", args[0], kind="norm_input", shard_dim=None)

    return [m.register_forward_pre_hook(hook) for _, m in hooks.index.named if isinstance(m, nn.LayerNorm)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _run(rank: int, world: int) -> list[dict]:
    """Each step's records of this rank, and its float64 sums of squares and counts per layer."""
    undo = register_kind(norm_input())
    try:
        return _steps(rank, world)
    finally:
        undo()


def _steps(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    model = Net()
    seen: dict[int, list[torch.Tensor]] = {}
    for i, block in enumerate(model.layers):
        block.norm.register_forward_pre_hook(
            lambda m, args, i=i: seen.setdefault(i, []).append(args[0].detach().double()))
    if world == 1:
        topology = Topology.single_process()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        topology = Topology.from_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    metrics = [L2Norm(name="layer-norm-input-l2", source_kinds=["norm_input"], scope="layer"),
               Rms(name="layer-norm-input-rms", source_kinds=["norm_input"], scope="layer")]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tm = TensorMetrics(model, metrics=[(m, 1) for m in metrics], optimizer=optimizer, topology=topology,
                       timeout_s=60)
    out = []
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        batch = torch.randn(BATCH, SEQ, 4, generator=g)[rank * BATCH // world:(rank + 1) * BATCH // world]
        seen.clear()
        with tm.step(step):
            for part in batch.chunk(MICRO):
                model(part).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert tm.failures == []
        out.append({"records": {(r.metric, r.labels.layer): r.value for r in tm.last_records},
                    "sumsq": {i: sum(float(x.square().sum()) for x in xs) for i, xs in seen.items()},
                    "count": {i: sum(x.numel() for x in xs) for i, xs in seen.items()}})
    tm.close()
    calls = CALLS[0]
    model(torch.randn(1, SEQ, 4))
    assert CALLS[0] == calls, "a hook of the installer outlived close()"
    return out


def _check(ranks: list[list[dict]]) -> None:
    for step in range(STEPS):
        want: dict[tuple[str, int], float] = {}
        for layer in range(LAYERS):
            sumsq = sum(r[step]["sumsq"][layer] for r in ranks)
            count = sum(r[step]["count"][layer] for r in ranks)
            want["layer-norm-input-l2", layer] = math.sqrt(sumsq)
            want["layer-norm-input-rms", layer] = math.sqrt(sumsq / count)
        for rank in ranks:
            got = rank[step]["records"]
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-12), (step, key)


def test_registered_kind_reaches_its_metrics_in_one_process() -> None:
    _check([_run(0, 1)])
    assert "norm_input" not in kinds.TOKEN_KINDS and "norm_input" not in {k.name for k in kinds.declared()}


def test_registered_kind_reaches_its_metrics_over_two_ranks() -> None:
    _check(run_distributed(_run, 2, timeout=300))


def test_a_kind_without_token_rows_is_refused_not_silently_left_unhooked() -> None:
    """The observed side installs and prepares registered kinds as token rows: a kind declared
    without them would never be hooked, so registering it raises, naming the fix."""
    with pytest.raises(ValueError, match="token_rows=True"):
        register_kind(norm_input(token_rows=False))
    assert "norm_input" not in {k.name for k in kinds.declared()}
