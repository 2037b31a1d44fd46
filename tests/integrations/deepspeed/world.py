"""What each gloo rank runs: DeepSpeed cases on its CPU accelerator, tmetrics attached by the one
line a user writes (``from_config(cfg, model=engine)``), records returned by key; and the float64
single-process reference of the same global batches, trained by hand. No placements, offsets or
hooks here."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.integrations.deepspeed import cpu_shims

IN, D, H = 5, 7, 13
BLOCKS = 3
MICRO = 2  # samples per rank and micro-batch
LR, WD = 1e-2, 0.0  # no weight decay: the Trainer exempts biases from it
METRICS = ["global-grad-l2", "layer-grad-l2", "layer-param-l2", "layer-update-ratio", "layer-optimizer-state-rms",
           "layer-grad-nonfinite"]

Key = tuple[str, int, Any, Any]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H)
        self.fc2 = torch.nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    """An input projection, ``BLOCKS`` residual MLP blocks under ``layers`` and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(IN, D)
        self.layers = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        out = self.head(h)
        return out if y is None else {"loss": (out - y).square().mean()}  # the Trainer's form


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    gas: int = 1  # gradient accumulation steps
    clip: float = 0.0
    steps: int = 2
    metrics: tuple[str, ...] = tuple(METRICS)
    extra: dict[str, Any] = field(default_factory=dict)  # more of DeepSpeed's config (zero_optimization keys)
    interval: int = 1
    count_gathers: bool = False
    bf16: bool = False
    fp16: bool = False  # dynamic loss scaling, from 2^8
    inject: tuple[int, ...] = ()  # steps with +inf put into one gradient element: DeepSpeed skips them
    path: str = "engine"  # "engine": from_config(model=engine); "module": model=engine.module,
    # optimizer=engine.optimizer; "accelerate": attach() with a DeepSpeedPlugin; "trainer": the HF
    # Trainer with TrainingArguments(deepspeed=...) and TMetricsCallback


def batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step: ``world * MICRO`` samples, rank ``r`` takes rows
    ``r*MICRO .. (r+1)*MICRO - 1``."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(world * MICRO, IN, generator=g), torch.randn(world * MICRO, 1, generator=g)


def ds_config(case: Case, world: int) -> dict[str, Any]:
    zero = {"stage": case.stage, **case.extra}
    if case.stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)  # every parameter partitioned
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case.gas,
            "train_batch_size": MICRO * case.gas * world, "gradient_clipping": case.clip,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "bf16": {"enabled": case.bf16},
            "zero_force_ds_cpu_optimizer": False,  # the client torch optimizer under offload (no C++ op)
            **({"fp16": {"enabled": True, "initial_scale_power": 8}} if case.fp16 else {})}


def tm_config(case: Case, run_dir: str) -> dict[str, Any]:
    return {"run": {"name": case.name, "dir": run_dir}, "sinks": {"jsonl": {}},
            "metrics": [f"{m}:{case.interval}" for m in case.metrics]}


def run_cases(rank: int, world: int, cases: list[Case], run_dir: str) -> dict[str, Any]:
    """Every case trained under DeepSpeed: ``{case: {"records": {key: value} (rank 0),
    "reference": {key: value} (rank 0), "norms": [DeepSpeed's norm per step], "gathers": [...],
    "own": {key: value} (bf16, fp16), "said": [(level, message)] of skipped steps}}``, and
    ``{"refusals": {feature: message}}``."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cpu_shims.apply()
    out: dict[str, Any] = {}
    runners = {"engine": _train, "module": _train, "accelerate": _accelerate, "trainer": _trainer}
    for case in cases:
        out[case.name] = runners[case.path](case, rank, world, f"{run_dir}/{case.name}")
        out[case.name]["records"] = _records(f"{run_dir}/{case.name}") if rank == 0 else {}
        if rank == 0:
            out[case.name]["reference"] = reference(case, world)
    out["refusals"] = refusals(rank, world, f"{run_dir}/refused")  # last: a pipeline engine changes DeepSpeed's groups
    return out


def _train(case: Case, rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import deepspeed

    import tmetrics_core as tm

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(case, world))
    cfg = tm_config(case, run_dir)
    if case.path == "module":
        metrics = tm.TensorMetrics.from_config(cfg, model=engine.module, optimizer=engine.optimizer)
    else:
        metrics = tm.TensorMetrics.from_config(cfg, model=engine)
    gathers = _GatherCount() if case.count_gathers else None
    norms = []
    own: dict[Key, float] = {}
    said = _Said()
    injected = engine.module.layers[INJECTED].fc1.bias
    for step in range(1, case.steps + 1):
        handle = injected.register_hook(_plus_inf) if step in case.inject else None
        if gathers is not None:
            gathers.count = 0
        with metrics.step(step):
            for micro in range(case.gas):
                x, y = batch(step, micro, world)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                dtype = torch.bfloat16 if case.bf16 else torch.float16 if case.fp16 else torch.float32
                loss = (engine(x[rows].to(dtype)).float() - y[rows]).square().mean()
                engine.backward(loss)
                low = case.bf16 or case.fp16
                before = _own_before(engine, step, own) if low and micro == case.gas - 1 else None
                engine.step()
                if before is not None and not engine.optimizer.overflow:
                    _own_after(engine, step, before, own)
        if handle is not None:
            handle.remove()
        norm = engine.get_global_grad_norm()  # None without ZeRO: DeepSpeed keeps none
        norms.append(float(norm) if norm is not None else math.nan)
        if gathers is not None:
            gathers.steps.append(gathers.count)
    metrics.close()
    said.remove()
    if gathers is not None:
        gathers.remove()
    return {"norms": norms, "gathers": gathers.steps if gathers is not None else [], "own": own,
            "said": said.records}


INJECTED = 1  # the block whose fc1.bias gets +inf in element 0 on the steps of Case.inject


def _plus_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


class _Said(logging.Handler):
    """tmetrics' own line on a step DeepSpeed skipped, as ``(level, message)``, INFO included (the
    executor's reports of the metrics that failed with it are not counted here)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, str]] = []
        self.level_was = logging.getLogger("tmetrics").level
        logging.getLogger("tmetrics").setLevel(logging.INFO)
        logging.getLogger("tmetrics").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("tmetrics: DeepSpeed skipped the optimizer step"):
            self.records.append((record.levelno, record.getMessage()))

    def remove(self) -> None:
        logging.getLogger("tmetrics").removeHandler(self)
        logging.getLogger("tmetrics").setLevel(self.level_was)


def _full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The model's weights as the forward uses them (bf16), whole: gathered under ZeRO 3 (by the
    test, with DeepSpeed's own context)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().double().clone() for n, p in named}


def _own_before(engine: Any, step: int, own: dict[Key, float]) -> dict[str, torch.Tensor]:
    """From DeepSpeed's own tensors, between the boundary's backward and its step: the reduced
    gradients (``safe_get_full_grad``, divided by the loss scale under fp16) and the weights;
    returns the weights."""
    from deepspeed.utils import safe_get_full_grad

    scale = engine.optimizer.loss_scale if engine.fp16_enabled() else 1.0
    grads = {n: safe_get_full_grad(p).double() / scale for n, p in engine.module.named_parameters()}
    weights = _full_weights(engine)
    own[("global-grad-l2", step, None, None)] = _norm(grads.values())
    for layer in range(BLOCKS):
        own[("layer-grad-l2", step, layer, None)] = _norm(g for n, g in grads.items() if _layer(n) == layer)
        own[("layer-param-l2", step, layer, None)] = _norm(w for n, w in weights.items() if _layer(n) == layer)
    return weights


def _own_after(engine: Any, step: int, before: dict[str, torch.Tensor], own: dict[Key, float]) -> None:
    """From DeepSpeed's own tensors after its step: the weights' change and its Adam state
    (``safe_get_full_optimizer_state``)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    after = _full_weights(engine)
    named = list(engine.module.named_parameters())
    for layer in range(BLOCKS):
        mine = [n for n, _ in named if _layer(n) == layer]
        own[("layer-update-ratio", step, layer, None)] = (
            _norm(after[n] - before[n] for n in mine) / _norm(after[n] for n in mine))
        for kind in ("exp_avg", "exp_avg_sq"):
            states = [safe_get_full_optimizer_state(p, kind).double() for n, p in named if n in mine]
            own[("layer-optimizer-state-rms", step, layer, kind)] = (
                sum(float(t.square().sum()) for t in states) / sum(t.numel() for t in states)) ** 0.5


def _accelerate(case: Case, rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """The loop of accelerate's docs with a ``DeepSpeedPlugin``, and ``attach`` around it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from tmetrics_core.integrations.accelerate import attach

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch` sets for a DeepSpeed config
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(case, world)))
    model, optimizer = accelerator.prepare(model, optimizer)
    norms = []
    with attach(accelerator, model, optimizer, tm_config(case, run_dir)):
        for step in range(1, case.steps + 1):
            for micro in range(case.gas):
                x, y = batch(step, micro, world)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                with accelerator.accumulate(model):
                    accelerator.backward((model(x[rows]) - y[rows]).square().mean())
                    optimizer.step()
                    optimizer.zero_grad()
            norms.append(float(model.get_global_grad_norm()))
    AcceleratorState._reset_state(True)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED")
    return {"norms": norms, "gathers": []}


def _trainer(case: Case, rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """A ``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)`` and the callback; its
    sampler is sequential so that rank ``r`` trains on the rows :func:`batch` gives it."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from tmetrics_core.integrations.hf import TMetricsCallback

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    rows = [{"x": x, "y": y} for step in range(1, case.steps + 1) for micro in range(case.gas)
            for x, y in zip(*batch(step, micro, world))]
    torch.manual_seed(0)
    model = Net()
    args = TrainingArguments(f"{run_dir}/out", max_steps=case.steps, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=case.gas, max_grad_norm=case.clip, learning_rate=LR,
                             weight_decay=WD, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             deepspeed={**ds_config(case, world), "gradient_clipping": "auto",
                                        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                        "gradient_accumulation_steps": "auto"})
    trainer = InOrder(model=model, args=args, train_dataset=rows,
                      callbacks=[TMetricsCallback(tm_config(case, run_dir))])
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    AcceleratorState._reset_state(True)
    return {"norms": norms, "gathers": []}


def _records(run_dir: str) -> dict[Key, Any]:
    """The records the jsonl sink wrote, by ``(metric, step, layer, stat)`` (each once)."""
    out: dict[Key, Any] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (r["metric"], r["step"], r["labels"].get("layer"), r["labels"].get("stat"))
        assert key not in out, f"{key} written twice"
        out[key] = float(r["value"]) if r["value"] in ("Infinity", "-Infinity", "NaN") else r["value"]
    return out


class _GatherCount:
    """Counts the all-gathers DeepSpeed's communication backend issues (its ZeRO 3 parameter
    fetches among them); tmetrics never calls it."""

    def __init__(self) -> None:
        from deepspeed import comm

        self.backend = comm.comm.cdb
        self.count = 0
        self.steps: list[int] = []
        self.names = [n for n in ("all_gather_into_tensor", "all_gather", "all_gather_base", "allgather_fn",
                                  "all_gather_coalesced") if callable(getattr(self.backend, n, None))]
        for name in self.names:
            original = getattr(self.backend, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            setattr(self.backend, name, counted)

    def remove(self) -> None:
        for name in self.names:
            self.backend.__dict__.pop(name, None)


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def reference(case: Case, world: int) -> dict[Key, float]:
    """The same training in float64 on one process: the global batch of each micro-step, the
    loss of each rank's rows averaged over ranks and micro-batches (what DeepSpeed's averaged
    gradients are of), clipped as DeepSpeed clips, AdamW."""
    torch.manual_seed(0)
    model = copy.deepcopy(Net()).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    out: dict[Key, float] = {}
    named = list(model.named_parameters())
    residual = [0.0] * BLOCKS  # sums of squares of each block's output over the step's tokens
    cotangent = [0.0] * BLOCKS  # and of the applied loss's cotangent there

    def add(layer: int) -> Any:
        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            residual[layer] += float(output.detach().square().sum())
            output.register_hook(lambda g: cotangent.__setitem__(layer, cotangent[layer] + float(g.square().sum())))
        return hook

    for layer, block in enumerate(model.layers):
        block.register_forward_hook(add(layer))
    for step in range(1, case.steps + 1):
        optimizer.zero_grad()
        residual[:] = cotangent[:] = [0.0] * BLOCKS
        for micro in range(case.gas):
            x, y = batch(step, micro, world)
            for r in range(world):
                rows = slice(r * MICRO, (r + 1) * MICRO)
                loss = (model(x[rows].double()) - y[rows].double()).square().mean()
                (loss / (world * case.gas)).backward()
        before = {n: p.detach().clone() for n, p in named}
        grads = {n: p.grad.detach().clone() for n, p in named}
        if step in case.inject:  # DeepSpeed skips the step: no update, no state change
            grads[f"layers.{INJECTED}.fc1.bias"].view(-1)[0] = math.inf
        elif case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        if step not in case.inject:
            optimizer.step()
        after = {n: p.detach().clone() for n, p in named}
        out[("global-grad-l2", step, None, None)] = _norm(grads.values())
        for layer in range(BLOCKS):
            mine = [n for n, _ in named if _layer(n) == layer]
            out[("layer-grad-l2", step, layer, None)] = _norm(grads[n] for n in mine)
            out[("layer-residual-accumulator-l2", step, layer, None)] = residual[layer] ** 0.5
            out[("layer-residual-grad-l2", step, layer, None)] = cotangent[layer] ** 0.5
            out[("layer-param-l2", step, layer, None)] = _norm(before[n] for n in mine)
            out[("layer-update-ratio", step, layer, None)] = (
                _norm(after[n] - before[n] for n in mine) / _norm(after[n] for n in mine))
            for stat in ("nan", "posinf", "neginf", "total"):
                out[("layer-grad-nonfinite", step, layer, stat)] = float(
                    step in case.inject and layer == INJECTED and stat in ("posinf", "total"))
            for kind in ("exp_avg", "exp_avg_sq"):
                states = [optimizer.state[p][kind] for n, p in named if n in mine]
                count = sum(s.numel() for s in states)
                out[("layer-optimizer-state-rms", step, layer, kind)] = (
                    float(sum(float(s.square().sum()) for s in states) / count) ** 0.5)
    return out


def _norm(tensors: Any) -> float:
    return float(sum(float(t.double().square().sum()) for t in tensors)) ** 0.5


def refusals(rank: int, world: int, run_dir: str) -> dict[str, str]:
    """What ``from_config(cfg, model=engine)`` says for each DeepSpeed feature tmetrics refuses
    (``{feature: message}``; ``"accepted"`` where it built)."""
    import deepspeed

    import tmetrics_core as tm
    from tmetrics_core.errors import ConfigError

    cfg = {"run": {"name": "refused", "dir": run_dir}, "sinks": {}, "metrics": ["layer-grad-l2"]}
    base = Case("refused", 2)
    builds: dict[str, Any] = {
        "zero0-clip": lambda: _engine(Net(), ds_config(Case("clip", 0, clip=1.0), world)),
        "moe": lambda: _engine(_MoeNet(), ds_config(base, world)),
        "hpz": lambda: _engine(Net(), {**ds_config(Case("hpz", 3, extra={"zero_hpz_partition_size": world}),
                                                     world)}),
        "pipeline": lambda: _engine(deepspeed.pipe.PipelineModule(
            [torch.nn.Linear(D, D) for _ in range(world)], num_stages=world),
            {**ds_config(Case("pipe", 1), world), "train_batch_size": MICRO}),  # one data-parallel rank
    }
    out = {}
    engine = _engine(Net(), ds_config(base, world))
    try:  # another module than the one the ZeRO optimizer steps
        tm.TensorMetrics.from_config(cfg, model=Net(), optimizer=engine.optimizer).close()
        out["foreign-module"] = "accepted"
    except ConfigError as exc:
        out["foreign-module"] = str(exc)
    try:  # TensorMetrics built directly, as without an integration: only from_config reads ZeRO
        from tmetrics_core.metrics.catalogue import build_metric

        tm.TensorMetrics(engine.module, metrics=[(build_metric("layer-grad-l2"), 1)], optimizer=engine.optimizer)
        out["direct"] = "accepted"
    except ConfigError as exc:
        out["direct"] = str(exc)
    for feature, build in builds.items():  # the pipeline last: its topology stays DeepSpeed's
        engine = build()
        try:
            tm.TensorMetrics.from_config(cfg, model=engine).close()
            out[feature] = "accepted"
        except ConfigError as exc:
            out[feature] = str(exc)
    return out


def _engine(model: torch.nn.Module, config: dict[str, Any]) -> Any:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.AdamW(groups, lr=LR)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


class _MoeNet(torch.nn.Module):
    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(hidden_size=D, expert=torch.nn.Linear(D, D), num_experts=2, ep_size=1, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]
