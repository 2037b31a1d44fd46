"""Issue 16: cases that used to print a plausible wrong number with no error, on real gloo ranks.

Each case builds a tiny model whose gradients are set by hand, so every expected value is a
closed form; every rank returns what it measured (or the error it raised, and the warnings it
logged) and the test checks every rank. All cases share one spawned run of two ranks (the
``ranks`` fixture) to keep the file fast.
"""

from __future__ import annotations

import logging
import math
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Axis, Topology


def _dp(rank: int, world: int) -> Topology:
    return Topology([Axis("dp", world, rank, dist.group.WORLD, tuple(range(world)))],
                    global_rank=rank, world_size=world)


def _block(*sizes: int) -> torch.nn.Module:
    """``layers.0.<a|b|c...>``: one block of bias-free Linear layers ``1 x size`` (one row),
    initialized alike on every rank (data-parallel replicas, as replica verification checks)."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    block = torch.nn.ModuleDict({name: torch.nn.Linear(size, 1, bias=False) for name, size in zip("abcd", sizes)})
    model.layers = torch.nn.ModuleList([block])
    return model


def _metrics(*names: str) -> list:
    return [(build_metric(name), 1) for name in names]


class _Warnings(logging.Handler):
    """The ``tmetrics`` logger's warnings on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("tmetrics").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _values(metrics: TensorMetrics) -> dict:
    return {(r.metric, r.layer): r.value for r in metrics.last_records}


def _all_cases(rank: int, world: int) -> dict:
    """Every case below, in one spawned run (each case's traceback instead of its result when
    it raises, so one broken case does not hide the others)."""
    out = {}
    for case in _CASES:
        try:
            out[case.__name__] = case(rank, world)
        except Exception:  # noqa: BLE001 - reported by the case's test
            out[case.__name__] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_all_cases, 2, timeout=300)


def _case(ranks: list[dict], case) -> list:
    """Every rank's result of ``case``; fails with the traceback of a case that raised."""
    got = [r[case.__name__] for r in ranks]
    for rank, value in enumerate(got):
        assert not isinstance(value, str), f"rank {rank}:\n{value}"
    return got


# -- item 11: gradients in main_grad; item 4: no gradient is not a zero gradient ----------------
def _gradient_cases(rank: int, world: int) -> dict:
    out = {}
    # Megatron-Core DDP: the gradient is in main_grad, .grad stays None.
    model = _block(2, 3)
    a, b = model.layers[0]["a"].weight, model.layers[0]["b"].weight
    a.main_grad = torch.tensor([[3.0, 4.0]])
    b.main_grad = torch.tensor([[0.0, 12.0, 0.0]])
    tm = TensorMetrics(model, metrics=_metrics("global-grad-l2", "layer-grad-rms"), topology=_dp(rank, world),
                       timeout_s=30)
    with tm.step(1):
        pass
    out["main_grad"] = _values(tm)
    # b gets no gradient: not part of the statistics, whichever columns the due set's rows pass
    # computes (zero counts with the RMS; sums of squares alone for RMS and L2).
    for path, names in (("general", ("layer-grad-zero-fraction", "layer-grad-rms")),
                        ("planned", ("layer-grad-rms", "global-grad-l2"))):
        model = _block(5, 5)
        model.layers[0]["a"].weight.grad = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
        tm = TensorMetrics(model, metrics=_metrics(*names), topology=_dp(rank, world), timeout_s=30)
        with tm.step(1):
            pass
        out[path] = _values(tm)
    return out


def test_gradients_from_main_grad_and_missing_gradients(ranks):
    for got in _case(ranks, _gradient_cases):
        assert got["main_grad"][("global-grad-l2", None)] == pytest.approx(13.0)
        assert got["main_grad"][("layer-grad-rms", 0)] == pytest.approx(math.sqrt(169 / 5))
        # zeros for b would give 0.6 and sqrt(3) = 1.732
        assert got["general"][("layer-grad-zero-fraction", 0)] == pytest.approx(0.2)
        assert got["general"][("layer-grad-rms", 0)] == pytest.approx(math.sqrt(6))
        assert got["planned"][("layer-grad-rms", 0)] == pytest.approx(math.sqrt(6))
        assert got["planned"][("global-grad-l2", None)] == pytest.approx(math.sqrt(30))


# -- items 9 and 10: a step entered twice; replica drift without a dp axis ----------------------
def _refusals(rank: int, world: int) -> dict:
    from tmetrics_core.errors import ConfigError, TMetricsError

    out = {}
    model = _block(2)
    tm = TensorMetrics(model, metrics=_metrics("global-grad-l2"), topology=_dp(rank, world), timeout_s=30)
    model.layers[0]["a"].weight.grad = torch.tensor([[3.0, 4.0]])
    with tm.step(1):  # first micro-batch
        pass
    out["first"] = _values(tm)
    for again in (1, 0):
        try:
            with tm.step(again):  # a second micro-batch in its own scope, or a step number going back
                pass
            out[again] = None
        except TMetricsError as exc:
            out[again] = (type(exc).__name__, str(exc))
    fsdp = Topology([Axis("fsdp", world, rank, dist.group.WORLD, tuple(range(world)))],
                    global_rank=rank, world_size=world)
    try:
        TensorMetrics(_block(2), metrics=_metrics("global-grad-l2", "dp-replica-drift"), topology=fsdp, timeout_s=30)
        out["drift"] = None
    except ConfigError as exc:
        out["drift"] = (exc.path, str(exc))
    return out


def test_a_step_entered_twice_and_replica_drift_without_dp_are_refused(ranks):
    for got in _case(ranks, _refusals):
        assert got["first"] == {("global-grad-l2", None): 5.0}
        for again in (1, 0):
            name, message = got[again]
            assert name == "TMetricsError" and "after step 1" in message and "micro-batches" in message
        path, message = got["drift"]
        assert path == "metrics[1]" and "dp-replica-drift" in message and "'dp'" in message and "fsdp" in message


# -- item 2: a declared Owned(r) reads the owner's copy only ------------------------------------
def _owned_cases(rank: int, world: int) -> dict:
    model = _block(2)
    weight = model.layers[0]["a"].weight
    with torch.no_grad():
        weight.copy_(torch.tensor([[3.0, 4.0]]) if rank == 0 else torch.tensor([[0.0, 1.0]]))  # rank 1: stale
    weight.grad = torch.tensor([[6.0, 8.0]]) if rank == 0 else torch.tensor([[1.0, 1.0]])
    tm = TensorMetrics(model, metrics=_metrics("global-param-l2", "global-grad-l2", "layer-param-rms"),
                       topology=_dp(rank, world), placements={"layers.0.a.weight": {"dp": "O0"}}, timeout_s=30)
    with tm.step(1):
        pass
    return _values(tm)


def test_declared_owned_reads_only_the_owner(ranks):
    for got in _case(ranks, _owned_cases):
        # the stale copy counted: sqrt(25 + 1) = 5.099
        assert got == {("global-param-l2", None): 5.0, ("global-grad-l2", None): 10.0,
                       ("layer-param-rms", 0): pytest.approx(math.sqrt(12.5))}


# -- item 3: every flat buffer of a kind is read --------------------------------------------------
def _flat_cases(rank: int, world: int) -> dict:
    from tmetrics_core.sources.flat import FlatBuffer

    model = _block(2, 3, 3, 2)
    a, b, c, d = (model.layers[0][n].weight for n in "abcd")
    dense = torch.tensor([3.0, 4.0, 0.0, 0.0, 5.0])  # a, b
    expert = torch.tensor([1.0, 2.0, 2.0])  # c
    buffers = []
    for params, full in (((a, b), dense), ((c,), expert)):
        chunk = -(-full.numel() // world)
        lo, hi = min(rank * chunk, full.numel()), min((rank + 1) * chunk, full.numel())
        buffers.append(FlatBuffer("grad", "dp", list(params), full[lo:hi].clone(), lo))
    d.grad = torch.tensor([[6.0, 8.0]])  # in no buffer: read from .grad
    tm = TensorMetrics(model, metrics=_metrics("layer-grad-l2", "global-grad-l2"), topology=_dp(rank, world),
                       flat_buffers=buffers, timeout_s=30)
    with tm.step(1):
        pass
    return _values(tm)


def test_every_flat_buffer_of_a_kind_is_read(ranks):
    for got in _case(ranks, _flat_cases):
        # the dense buffer dropped: sqrt(9 + 100) = 10.44
        assert got == {("layer-grad-l2", 0): pytest.approx(math.sqrt(159)),
                       ("global-grad-l2", None): pytest.approx(math.sqrt(159))}


# -- items 6, 11 and 4: a metric with nothing to measure says so; missing gradients are named ------
def _unfed_cases(rank: int, world: int) -> dict:
    out = {}
    warnings = _Warnings()
    torch.manual_seed(0)  # as _unfed_model_params
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.ModuleDict({
        "moe": torch.nn.ModuleDict({"router": torch.nn.Linear(4, 2, bias=False)}),
        "mlp": torch.nn.Linear(2, 1, bias=False)})])
    tm = TensorMetrics(model, metrics=_metrics("layer-router-logits-max", "global-grad-l2", "global-param-l2"),
                       topology=_dp(rank, world), timeout_s=30)
    for step in (1, 2):  # router outputs never observed; no gradient anywhere
        with tm.step(step):
            model.layers[0]["moe"]["router"](torch.ones(3, 4))
        out[step] = _values(tm)
    model.layers[0]["mlp"].weight.grad = torch.tensor([[3.0, 4.0]])
    with tm.step(3):
        pass
    out[3] = _values(tm)
    out["warnings"] = warnings.messages
    logging.getLogger("tmetrics").removeHandler(warnings)
    return out


def test_metrics_with_nothing_to_measure_warn_once_instead_of_writing_zeros(ranks):
    param = math.sqrt(sum(p.detach().pow(2).sum().item() for p in _unfed_model_params()))
    for rank, got in enumerate(_case(ranks, _unfed_cases)):
        for step in (1, 2):  # before: a global-grad-l2 of 0.0 on every step, and no word on the router
            assert got[step] == {("global-param-l2", None): pytest.approx(param)}
        assert got[3] == {("global-param-l2", None): pytest.approx(param), ("global-grad-l2", None): 5.0}
        if rank:
            assert got["warnings"] == []
            continue
        router = [w for w in got["warnings"] if "'layer-router-logits-max'" in w]
        grads = [w for w in got["warnings"] if "'global-grad-l2'" in w]
        missing = [w for w in got["warnings"] if "had no gradient" in w]
        assert len(router) == 1 and "tm.observe" in router[0] and "kind='router_logits'" in router[0]
        assert len(grads) == 1 and ".main_grad" in grads[0]
        assert len(missing) == 1 and "layers.0.moe.router.weight" in missing[0] and "layers.0.mlp.weight" in missing[0]


def _unfed_model_params():
    torch.manual_seed(0)
    return [torch.nn.Linear(4, 2, bias=False).weight, torch.nn.Linear(2, 1, bias=False).weight]


# -- items 7 and 8: closures read the gradients the update uses; wrapped optimizers are unwrapped --
def _norm(params) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))


def _closure_cases(rank: int, world: int) -> dict:
    from accelerate import Accelerator
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from tmetrics_core.errors import ConfigError

    out: dict = {}
    x = torch.tensor([[1.0, -2.0, 0.5]])

    def closure_for(model, optimizer, seen, then=None):
        def closure():
            optimizer.zero_grad()
            loss = model.layers[0]["a"](x).pow(2).sum()
            loss.backward()
            seen.append(_norm(model.parameters()))
            if then is not None:
                then()
            return loss
        return closure

    # SGD with a positional closure; Adam behind Lightning's LightningOptimizer, stepped as
    # Lightning's precision plugin steps it (closure=...); LBFGS behind accelerate's wrapper.
    accelerator = Accelerator(cpu=True)
    for name in ("sgd", "lightning-adam", "accelerate-lbfgs"):
        torch.manual_seed(0)
        model = _block(3)
        params = list(model.parameters())
        inner = {"sgd": lambda: torch.optim.SGD(params, lr=0.1), "lightning-adam": lambda: torch.optim.Adam(params, lr=0.1),
                 "accelerate-lbfgs": lambda: torch.optim.LBFGS(params, lr=0.1, max_iter=3)}[name]()
        given = {"sgd": inner, "lightning-adam": LightningOptimizer(inner),
                 "accelerate-lbfgs": accelerator.prepare_optimizer(inner)}[name]
        tm = TensorMetrics(model, metrics=_metrics("global-grad-l2"), optimizer=given, topology=_dp(rank, world),
                           timeout_s=30)
        got, seen = [], []
        for step in (1, 2, 3):
            start = len(seen)
            with tm.step(step):
                closure = closure_for(model, inner, seen)
                if name == "sgd":
                    inner.step(closure)
                elif name == "lightning-adam":
                    inner.step(closure=closure)
                else:
                    given.step(closure)
            # LBFGS calls the closure again at other points: the first call's gradients are the
            # ones at the parameters the step started from, which tmetrics reads.
            got.append((_values(tm).get(("global-grad-l2", None)), seen[start]))
        out[name] = ([c.__name__ for c in type(given).__mro__], got, len(seen))
    # observe_gradients() inside the closure, before clipping.
    torch.manual_seed(0)
    model = _block(3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    tm = TensorMetrics(model, metrics=_metrics("global-grad-l2"), optimizer=sgd, topology=_dp(rank, world), timeout_s=30)
    seen = []
    with tm.step(1):
        sgd.step(closure_for(model, sgd, seen, then=lambda: (
            tm.observe_gradients(), torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))))
    out["observed"] = (_values(tm)[("global-grad-l2", None)], seen[0])
    # Megatron-Core's ChainedOptimizer holds several (dense and expert): Adam state from each.
    model = _block(2, 2)
    a, b = model.layers[0]["a"].weight, model.layers[0]["b"].weight
    first, second = torch.optim.Adam([a], lr=0.1), torch.optim.Adam([b], lr=0.1)

    class Chained:  # the attribute Megatron-Core's ChainedOptimizer keeps its optimizers in
        chained_optimizers = [first, second]

        def step(self):
            first.step()
            second.step()

    tm = TensorMetrics(model, metrics=_metrics("global-grad-l2", "layer-optimizer-state-rms"), optimizer=Chained(),
                       topology=_dp(rank, world), timeout_s=30)
    a.grad, b.grad = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 12.0]])
    with tm.step(1):
        Chained().step()
    out["chained"] = {(r.metric, r.stat): r.value for r in tm.last_records}
    try:
        TensorMetrics(model, metrics=_metrics("global-grad-l2"), optimizer=object(), topology=_dp(rank, world))
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = str(exc)
    return out


def test_closures_and_wrapped_optimizers(ranks):
    for got in _case(ranks, _closure_cases):
        for name, wrapper in (("sgd", "SGD"), ("lightning-adam", "LightningOptimizer"),
                              ("accelerate-lbfgs", "AcceleratedOptimizer")):
            given, steps, calls = got[name]
            assert wrapper in given  # the real wrapper class (Lightning subclasses it per optimizer)
            for measured, hand in steps:  # before: 0.0 (or no record) at step 1, the previous step's later
                assert measured == pytest.approx(hand, rel=1e-6), name
            assert calls == 3 if name != "accelerate-lbfgs" else calls > 3
        measured, before_clipping = got["observed"]
        assert measured == pytest.approx(before_clipping, rel=1e-6) and measured > 0.01
        # Adam after one step: exp_avg = 0.1 g, exp_avg_sq = 0.001 g^2 (per tensor, each optimizer's own)
        chained = got["chained"]
        assert chained[("global-grad-l2", None)] == pytest.approx(13.0)
        assert chained[("layer-optimizer-state-rms", "exp_avg")] == pytest.approx(0.1 * math.sqrt(169 / 4))
        assert chained[("layer-optimizer-state-rms", "exp_avg_sq")] == pytest.approx(
            0.001 * math.sqrt((9 ** 2 + 16 ** 2 + 0 + 144 ** 2) / 4))
        assert "object" in got["refused"] and "torch.optim.Optimizer" in got["refused"] and ".optimizer" in got["refused"]


# -- item 4 on DTensor parameters: a sharded and a Partial(sum) gradient beside one without -------
def _dtensor_cases(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _block(4, 4, 4)
    a, b, c = (model.layers[0][n] for n in "abc")
    a.weight = torch.nn.Parameter(distribute_tensor(torch.ones(1, 4), mesh, [Shard(1)]))
    b.weight = torch.nn.Parameter(distribute_tensor(torch.ones(1, 4), mesh, [Replicate()]))
    c.weight = torch.nn.Parameter(distribute_tensor(torch.ones(1, 4), mesh, [Replicate()]))  # no gradient
    a.weight.grad = distribute_tensor(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), mesh, [Shard(1)])
    # Partial(sum): the ranks' parts add up to [[4, 4, 4, 4]]
    b.weight.grad = DTensor.from_local(torch.full((1, 4), 4.0 / world), mesh, [Partial()])
    tm = TensorMetrics(model, metrics=_metrics("layer-grad-rms", "layer-grad-zero-fraction"),
                       topology=Topology.from_mesh(mesh), timeout_s=30)
    with tm.step(1):
        pass
    return _values(tm)


def test_dtensor_gradients_without_one_are_left_out(ranks):
    for got in _case(ranks, _dtensor_cases):
        # zeros for c would give sqrt(78 / 12) = 2.550 and 5/12 = 0.417
        assert got == {("layer-grad-rms", 0): pytest.approx(math.sqrt(78 / 8)),
                       ("layer-grad-zero-fraction", 0): pytest.approx(1 / 8)}


_CASES = (_gradient_cases, _dtensor_cases, _refusals, _owned_cases, _flat_cases, _unfed_cases, _closure_cases)
