"""DDP on 2 gloo ranks with parameter program (snapshot, sums-of-squares phases) and
residual pairs over 3 steps x 2 micro-batches (no_sync on the first) equals one process."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed.harness import run_distributed

NAMES = ["layer-grad-l2", "layer-update-ratio", "layer-param-l2", "global-grad-l2", "layer-param-absmax",
         "layer-residual-accumulator-rms", "layer-residual-contribution-l2", "layer-residual-accumulator-l2"]
D = 5


def _model():
    from tests.sources.test_token_row_buffer import Net
    return Net(3)


def _steps(rank, world, own_group=False):
    from tmetrics_core.topology import Topology
    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics

    model = _model()
    topology = None
    wrapped = model
    if rank is not None:
        import torch.distributed as dist
        # own_group: the default group carries no CPU tensor (as NCCL's), so DDP, the data axis
        # and tmetrics' own agreements need groups of their own (a gloo one, made by tmetrics).
        group = dist.new_group(backend="gloo") if own_group else dist.group.WORLD
        if own_group:  # objects go where a group can move them: its CPU backend, else the accelerator
            from tmetrics_core.distributed.backends import object_device
            assert object_device(group) == torch.device("cpu")
            with pytest.raises(RuntimeError, match="no CPU backend"):
                object_device(None)
        topology = Topology.from_groups({"dp": group})
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1 if "residual" in n else 2) for n in NAMES],
                            optimizer=opt, topology=topology, timeout_s=30)
    import os
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ  # set only while tmetrics made its control group
    out = {}
    for step in (1, 2, 3, 4):
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(4, 3, D, generator=g) for _ in range(2)]
        with metrics.step(step):
            for k, x in enumerate(xs):
                part = x if rank is None else x[rank * 2:(rank + 1) * 2]
                ctx = wrapped.no_sync() if (rank is not None and k == 0) else contextlib.nullcontext()
                with ctx:
                    loss = wrapped(part).pow(2).sum() / (4 * 3 * D) * (1 if rank is None else world)
                    loss.backward()
            opt.step()
            opt.zero_grad()
        assert metrics.failures == [], metrics.failures
        out[step] = {(r.metric, r.layer, r.tensor, r.stat): r.value for r in metrics.last_records}
    metrics.close()
    return out


def _rank(rank, world):
    return _steps(rank, world)


def _rank_own_group(rank, world):
    return _steps(rank, world, own_group=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_ddp_equals_one_process(backend):
    """``cuda:gloo``: a default group with no CPU backend (``init_process_group("nccl")``'s
    case). Every agreement of a due step (failures, token sites) and the start-up exchange run
    as CPU tensors over tmetrics' gloo control group; one on the default group would raise."""
    want = _steps(None, 1)
    for got in run_distributed(_rank if backend == "gloo" else _rank_own_group, 2, timeout=120, backend=backend):
        for step, values in want.items():
            assert got[step].keys() == values.keys() and values, step
            for key, value in values.items():
                assert got[step][key] == pytest.approx(value, rel=1e-5), (step, key, got[step][key], value)
