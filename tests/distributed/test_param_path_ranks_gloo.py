"""The parameter side's one path when ranks differ (2 gloo ranks on ``tp``): a replicated DTensor
weight fed by sequence-parallel activations has a ``Partial(sum)`` gradient, materialized in an
executor round. A read that fails on one rank only fails the metrics reading that source on
every rank (the failure agreement), issues the same collectives on every rank (no hang), and
leaves the other metrics and the next step exact against float64 values of the full tensors."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed


def _model(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp_norm = torch.nn.Module()
    model.layers[0].mlp_norm.weight = torch.nn.Parameter(distribute_tensor(torch.ones(4) * 0.5, mesh, [Replicate()]))
    return model


def _failing_read(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _model(mesh)
    weight = model.layers[0].mlp_norm.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in ("layer-grad-l2", "layer-param-l2")],
                            optimizer=optimizer, topology=Topology.from_mesh(mesh), timeout_s=20)
    reads = metrics.params.reads
    real = reads.read

    def broken(source, entries, snapshot):
        if source == "grad":
            raise RuntimeError("injected on rank 1")
        return real(source, entries, snapshot)
    out = []
    for step in (1, 2, 3):
        reads.read = broken if rank == 1 and step == 2 else real  # type: ignore[method-assign]
        x = DTensor.from_local(torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + rank)), mesh,
                               [Shard(0)])
        before = len(metrics.failures)
        with metrics.step(step):
            (x * weight).sum().backward()
            grad = weight.grad.full_tensor().double().norm().item()
            param = weight.full_tensor().double().norm().item()
            optimizer.step()
            optimizer.zero_grad()
        out.append(({r.metric: r.value for r in metrics.last_records}, grad, param,
                    [(f.metric, f.ranks, f.error) for f in metrics.failures[before:]]))
    metrics.close()
    return out


@pytest.mark.timeout(120)
def test_a_read_failing_on_one_rank_fails_its_metrics_everywhere_and_keeps_the_others_exact():
    ranks = run_distributed(_failing_read, 2, timeout=100, collective_timeout=20)
    for steps in ranks:
        for step, (values, grad, param, failures) in enumerate(steps, start=1):
            assert values["layer-param-l2"] == pytest.approx(param, rel=1e-6)
            if step == 2:
                assert "layer-grad-l2" not in values
                assert [(m, r) for m, r, _ in failures] == [("layer-grad-l2", (1,))]
                assert "injected on rank 1" in failures[0][2]
            else:
                assert values["layer-grad-l2"] == pytest.approx(grad, rel=1e-6) and failures == []



def _stages(rank: int, world: int) -> list:
    import torch.distributed as dist

    from tmetrics_core.metrics.catalogue import build_metric
    from tmetrics_core.tensor_metrics import TensorMetrics
    from tmetrics_core.topology import Topology

    torch.manual_seed(rank)
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    if rank == 1:
        stage.layers[1].bias.requires_grad_(False)  # no gradient, no Adam state on this stage
    optimizer = torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=1e-2)
    names = ("layer-optimizer-state-rms", "layer-update-ratio", "global-grad-l2")
    metrics = TensorMetrics(stage, metrics=[(build_metric(n), 1) for n in names], optimizer=optimizer,
                            topology=Topology.from_groups({"pp": dist.group.WORLD}), layer_offset=2 * rank,
                            timeout_s=20)
    out = []
    for step in (1, 2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        with metrics.step(step):
            stage.layers[1](stage.layers[0](x)).square().sum().backward()
            grads = {n: p.grad.double().clone() for n, p in stage.named_parameters() if p.grad is not None}
            before = {n: p.detach().double().clone() for n, p in stage.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        state = {n: {k: optimizer.state[p][k].double().clone() for k in ("exp_avg", "exp_avg_sq")}
                 for n, p in stage.named_parameters() if p in optimizer.state}
        after = {n: p.detach().double().clone() for n, p in stage.named_parameters() if p.requires_grad}
        out.append(({(r.metric, r.layer, r.stat): r.value for r in metrics.last_records}, grads, before, after, state,
                    [f.metric for f in metrics.failures]))
    metrics.close()
    return out


@pytest.mark.timeout(120)
def test_pipeline_stages_read_adam_state_and_updates_of_their_own_entries_only():
    """Two stages (pp = 2), each holding two layers; every record equals the float64 value of
    the stage that holds the layer (Adam state RMS and update ratio per layer; the global
    gradient L2 over both stages). A frozen bias has no Adam state and no update: left out of
    both (and of the ratio's parameter norm)."""
    ranks = run_distributed(_stages, 2, timeout=100, collective_timeout=20)
    for step in range(2):
        total = sum(float(g.square().sum()) for r in ranks for g in r[step][1].values())
        for rank in ranks:
            values, _, _, _, _, failures = rank[step]
            assert failures == [] and values[("global-grad-l2", None, None)] == pytest.approx(total ** 0.5, rel=1e-9)
            for stage, held in enumerate(ranks):
                _, _, before, after, state, _ = held[step]
                for local in range(2):
                    layer, prefix = 2 * stage + local, f"layers.{local}."
                    names = [n for n in after if n.startswith(prefix)]
                    update = sum(float((after[n] - before[n]).square().sum()) for n in names) ** 0.5
                    norm = sum(float(after[n].square().sum()) for n in names) ** 0.5
                    assert values[("layer-update-ratio", layer, None)] == pytest.approx(update / norm, rel=1e-6)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        kept = [state[n][kind] for n in names if n in state]
                        rms = (sum(float(t.square().sum()) for t in kept) / sum(t.numel() for t in kept)) ** 0.5
                        assert values[("layer-optimizer-state-rms", layer, kind)] == pytest.approx(rms, rel=1e-6)
