"""The training loop on one process: schedule, clipping, learning, the metrics hook point, and
each injection showing up where it should."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from tmetrics_core.demo.data import ByteCorpus, stdlib_files
from tmetrics_core.demo.model import ModelConfig
from tmetrics_core.demo.parallel import ParallelModel, parallelize
from tmetrics_core.demo.degrees import ParallelDegrees
from tmetrics_core.demo.train import Injection, TrainConfig, Trainer
from tmetrics_core.errors import ConfigError
from tmetrics_core.observe import observing

SMALL = ModelConfig(d_model=32, n_layers=3, n_heads=2, d_ff=32, n_experts=4, top_k=2, seq_len=32)


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_files(stdlib_files()[:20], source="first twenty stdlib files")


def _trainer(corpus: ByteCorpus, metrics: object = None, **train: object) -> Trainer:
    config = TrainConfig(**{"steps": 10, "batch_size": 4, "warmup_steps": 2, **train})  # type: ignore[arg-type]
    parallel = parallelize(SMALL, ParallelDegrees(), seed=config.seed, batch_size=config.batch_size)
    return Trainer(parallel, corpus, config, metrics=metrics)  # type: ignore[arg-type]


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert config.lr_at(1) == pytest.approx(1e-4)
    assert config.lr_at(10) == pytest.approx(1e-3)
    assert config.lr_at(55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way down the cosine
    assert config.lr_at(100) == pytest.approx(1e-4)
    constant = TrainConfig(steps=5, lr=2e-3, warmup_steps=0, min_lr_ratio=1.0)
    assert [constant.lr_at(s) for s in range(1, 6)] == pytest.approx([2e-3] * 5)


def test_training_learns_the_text(corpus: ByteCorpus) -> None:
    results = _trainer(corpus, steps=40, batch_size=8, lr=3e-3).run(progress=False)
    assert results[0].loss == pytest.approx(math.log(256), abs=0.1)
    assert sum(r.loss for r in results[-5:]) / 5 < results[0].loss - 1.5
    assert not any(r.skipped for r in results)


def test_clipping_matches_torch_on_one_process(corpus: ByteCorpus) -> None:
    trainer = _trainer(corpus)
    trainer.forward_backward(1)
    model: ParallelModel = trainer.parallel
    reference = copy.deepcopy(model.model)
    for param, ref in zip(model.model.parameters(), reference.parameters()):
        ref.grad = param.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1).item()
    assert model.clip_grad_norm_(0.1) == pytest.approx(expected, rel=1e-6)
    assert expected > 0.1
    for (name, param), ref in zip(model.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-6, atol=0, msg=name)


@dataclass
class _Probe:
    """A metrics object that records, per step, what an optimizer pre-hook sees and the sites."""

    model: nn.Module
    optimizer: Optimizer
    layer: int
    events: list[str] = field(default_factory=list)
    nonfinite: dict[int, dict[str, int]] = field(default_factory=dict)
    topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    kinds: frozenset[str] = frozenset({"router_topk"})
    current: int = 0

    def __post_init__(self) -> None:
        self.optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer: Optimizer, args: object, kwargs: object) -> None:
        self.events.append(f"pre-step {self.current}")
        self.nonfinite[self.current] = {
            name: int((~p.grad.isfinite()).sum()) for name, p in self.model.named_parameters() if p.grad is not None
        }

    def record(self, module: nn.Module, name: str, tensor: torch.Tensor, *, kind: str, shard_dim: int | None) -> None:
        if module is self.model.layers[str(self.layer)].moe:
            self.topk.setdefault(self.current, []).append(tensor.clone())

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        self.current = step
        self.events.append(f"enter {step}")
        with observing(self):
            yield
        self.events.append(f"exit {step}")

    def observe_gradients(self) -> None:
        self.events.append(f"gradients {self.current}")

    def log(self, values: dict[str, float]) -> None:
        self.events.append(f"log {sorted(values)} {self.current}")

    def close(self) -> None:
        self.events.append("close")


def _probe_factory(layer: int, built: list[_Probe]):
    def factory(model: nn.Module, optimizer: Optimizer, mesh: object) -> _Probe:
        assert mesh is None
        built.append(_Probe(model, optimizer, layer))
        return built[-1]
    return factory


def test_metrics_hook_point_wraps_each_whole_step(corpus: ByteCorpus) -> None:
    built: list[_Probe] = []
    _trainer(corpus, metrics=_probe_factory(0, built), steps=3).run(progress=False)
    (probe,) = built
    assert probe.events == [event for step in (1, 2, 3) for event in (
        f"enter {step}", f"gradients {step}", f"pre-step {step}", f"log ['loss', 'lr'] {step}", f"exit {step}")] + ["close"]
    assert all(len(probe.topk[s]) == 1 for s in (1, 2, 3))  # one routing site per step in the layer


def test_nan_grad_is_seen_by_metrics_and_the_update_is_skipped(corpus: ByteCorpus) -> None:
    built: list[_Probe] = []
    inject = Injection(kind="nan-grad", layer=1, start_step=3)
    trainer = _trainer(corpus, metrics=_probe_factory(1, built), inject=inject)
    for step in (1, 2):
        trainer.step(step)
    before = {n: p.detach().clone() for n, p in trainer.parallel.model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}
    result = trainer.step(3)
    (probe,) = built
    name = "layers.1.attn.q.weight"
    assert result.skipped and math.isnan(result.grad_norm)
    assert probe.nonfinite[3][name] == SMALL.d_model ** 2
    assert sum(probe.nonfinite[3].values()) == SMALL.d_model ** 2  # only that tensor
    assert sum(probe.nonfinite[2].values()) == 0
    for n, p in trainer.parallel.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in trainer.optimizer.state.items())
    after = trainer.step(4)
    assert not after.skipped and math.isfinite(after.loss)
    assert not torch.equal(trainer.parallel.model.layers["1"].attn.q.weight, before[name])


def test_dead_expert_gets_no_tokens_from_its_start(corpus: ByteCorpus) -> None:
    built: list[_Probe] = []
    inject = Injection(kind="dead-expert", layer=2, expert=3, start_step=3)
    _trainer(corpus, metrics=_probe_factory(2, built), inject=inject, steps=5).run(progress=False)
    (probe,) = built
    chosen = {step: set(t[0].unique().tolist()) for step, t in probe.topk.items()}
    assert all(3 in chosen[s] for s in (1, 2))
    assert all(3 not in chosen[s] and chosen[s] == {0, 1, 2} for s in (3, 4, 5))


def test_lr_spike_multiplies_one_layers_learning_rate(corpus: ByteCorpus) -> None:
    inject = Injection(kind="lr-spike", layer=1, start_step=4, duration=2, factor=1000.0)
    trainer = _trainer(corpus, inject=inject)
    seen: dict[int, dict[int | None, set[float]]] = {}
    for step in range(1, 7):
        trainer.step(step)
        lrs: dict[int | None, set[float]] = {}
        for group in trainer.optimizer.param_groups:
            lrs.setdefault(group["layer"], set()).add(group["lr"])
        seen[step] = lrs
    for step, lrs in seen.items():
        base = trainer.config.lr_at(step)
        spiking = step in (4, 5)
        assert sorted(lrs[1]) == pytest.approx([base * (1000.0 if spiking else 1.0)])
        for layer in (0, 2, None):
            assert sorted(lrs[layer]) == pytest.approx([base])


def test_injection_defaults_and_errors() -> None:
    config = ModelConfig(n_layers=4, n_experts=4, dense_layers=(2,))
    spike = Injection.default("lr-spike", config, steps=300)
    assert (spike.layer, spike.start_step, spike.duration) == (2, 100, 5)
    dead = Injection.default("dead-expert", config, steps=300)
    assert (dead.layer, dead.expert) == (3, 3)  # layer 2 is dense: the next MoE layer
    with pytest.raises(ConfigError, match="valid: lr-spike, dead-expert, nan-grad"):
        Injection.default("explode", config, steps=10)
    with pytest.raises(ConfigError, match="top_k < n_experts"):
        Injection.default("dead-expert", ModelConfig(n_experts=2, top_k=2), steps=10)


def test_train_config_errors() -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(steps=0)
    assert err.value.path == "--steps"
    with pytest.raises(ConfigError):
        TrainConfig(lr=0.0)
