"""The framework extension point (:mod:`tmetrics_core.integrations.adapter`): every framework is
one adapter in :data:`FRAMEWORKS`, each naming table belongs to one of them, and a framework
added in a test (its adapter alone) gives ``from_config`` its model, offsets and handles:
the records carry its global layer ids with the float64 hand norms, and ``close()`` removes
what it installed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tmetrics_core import build
from tmetrics_core.integrations.adapter import Prepared
from tmetrics_core.integrations.frameworks import FRAMEWORKS
from tmetrics_core.integrations.generic import Generic
from tmetrics_core.naming.layouts import LAYOUTS
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Topology


def test_every_adapter_has_the_protocols_parts_and_the_generic_one_answers_last():
    for adapter in FRAMEWORKS:
        assert isinstance(adapter.name, str) and isinstance(adapter.layouts, tuple)
        assert all(callable(getattr(adapter, m)) for m in ("unwrap", "detect", "topology", "prepare"))
    assert isinstance(FRAMEWORKS[-1], Generic)
    assert [a.name for a in FRAMEWORKS] == ["accelerate", "lightning", "deepspeed", "megatron", "torchtitan",
                                            "transformers", "torch"]


def test_each_naming_table_belongs_to_exactly_one_adapter():
    declared = [name for adapter in FRAMEWORKS for name in adapter.layouts]
    assert sorted(declared) == sorted(LAYOUTS)


class _Wrapper(torch.nn.Module):
    """The toy framework's wrapper: holds the model at ``.inner``, no parameter of its own."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _Layers(torch.nn.Module):
    """Two like blocks under ``layers``, as the toy framework's model holds them."""

    toy = True

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Handle:
    removed = 0

    def remove(self) -> None:
        _Handle.removed += 1


class _Toy:
    """A framework whose ranks hold layers 3 and 4 of a deeper model."""

    name = "toy"
    layouts: tuple[str, ...] = ()

    def unwrap(self, model, optimizer):
        return (model.inner if isinstance(model, _Wrapper) else model), optimizer

    def detect(self, model, optimizer, mesh):
        return getattr(model, "toy", False)

    def topology(self, model, optimizer, mesh, axes, *, timeout_s):
        return Topology.single_process()

    def prepare(self, model, optimizer, topology):
        return Prepared(model=model, optimizer=optimizer, offsets=(3, 0), handles=[_Handle()])


def test_a_framework_added_as_one_adapter_gives_offsets_and_removes_its_handles(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "FRAMEWORKS", (_Toy(), *FRAMEWORKS))
    torch.manual_seed(0)
    inner = _Layers()
    metrics = TensorMetrics.from_config({"metrics": ["layer-param-l2"], "sinks": ["jsonl"]}, model=_Wrapper(inner),
                                        run_dir=tmp_path)
    with metrics.step(1):
        inner(torch.ones(1, 3))
    metrics.close()
    assert _Handle.removed == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = {r["labels"]["layer"]: r["value"] for r in lines if r.get("metric") == "layer-param-l2"}
    hand = {3 + i: math.sqrt(sum(float(p.double().square().sum()) for p in layer.parameters()))
            for i, layer in enumerate(inner.layers)}
    assert got.keys() == hand.keys() and all(math.isclose(got[k], hand[k], rel_tol=1e-6) for k in hand)


def test_a_failing_adapter_removes_what_the_earlier_ones_installed(monkeypatch):
    class _Refusing(_Toy):
        def prepare(self, model, optimizer, topology):
            raise build.ConfigError("toy refuses")

    monkeypatch.setattr(build, "FRAMEWORKS", (_Toy(), _Refusing(), *FRAMEWORKS))
    model = _Layers()
    before = _Handle.removed
    with pytest.raises(build.ConfigError, match="toy refuses"):
        TensorMetrics.from_config({"metrics": ["layer-param-l2"]}, model=model)
    assert _Handle.removed == before + 1


def test_the_wrappers_of_accelerate_and_lightning_are_taken_off():
    from accelerate import Accelerator
    from lightning.pytorch import LightningModule

    class _Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    module = _Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    prepared = Accelerator(cpu=True).prepare_optimizer(optimizer)
    assert prepared is not optimizer
    model, inner = build._unwrapped(module, prepared)
    assert model is module.net and inner is optimizer


def test_a_transformers_model_is_detected_by_its_adapter():
    from tests.integrations.tiny import tiny_llama

    hf = next(a for a in FRAMEWORKS if a.name == "transformers")
    assert hf.detect(tiny_llama(), None, None)
    assert not hf.detect(torch.nn.Linear(2, 2), None, None)


def test_mesh_and_axes_together_are_refused():
    with pytest.raises(build.ConfigError, match="either mesh= or axes=, not both"):
        build.topology_for(mesh=object(), axes={"dp": None})


def _topology_without_a_say(rank: int, world: int) -> tuple[str, str]:
    model, refused = _Layers(), ""
    try:
        build.topology_for(model=model)
    except build.ConfigError as exc:
        refused = str(exc)
    from tmetrics_core.distributed import world as ranks

    return refused, repr(build.topology_for(model=model, axes={"dp": ranks.world_group()}))


def test_several_ranks_without_a_topology_are_refused_and_plain_ddp_is_one_dp_axis():
    from tests.distributed.harness import run_distributed

    for refused, given in run_distributed(_topology_without_a_say, 2, timeout=120):
        assert "torch.distributed runs 2 ranks but no topology was given" in refused
        assert given.startswith("Topology(dp=2; rank ")
