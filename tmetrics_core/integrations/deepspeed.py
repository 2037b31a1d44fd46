"""DeepSpeed, natively: ``tm.TensorMetrics.from_config(cfg, model=engine)`` with the
``DeepSpeedEngine`` that ``deepspeed.initialize`` returned; the loop stays as it is::

    metrics = tm.TensorMetrics.from_config("tmetrics.yaml", model=engine)
    for step, batches in enumerate(steps, start=1):     # one scope per optimizer step
        with metrics.step(step):
            for batch in batches:                        # gradient_accumulation_steps of them
                engine.backward(engine(batch).loss)
                engine.step()                            # steps the optimizer at the boundary only

DeepSpeed is never imported here unless the user already did (:func:`found` looks in
``sys.modules``). ``model=engine.module, optimizer=engine.optimizer`` gives the same records.

**From the engine**: the model (``engine.module``), the optimizer (DeepSpeed's own, adapted by
:class:`DeepSpeedSteps`) and the topology: one axis ``dp``, the group ZeRO partitions over
(DeepSpeed's data-parallel group). Ranks hold different samples on it.

**When things are read.** :class:`DeepSpeedSteps` puts tmetrics' step hooks around the whole
``step()`` of DeepSpeed's optimizer, which ``engine.step()`` calls at the accumulation boundary
only: gradients are read before it (the reduced partitions, before DeepSpeed unscales or clips
them: ``global-grad-l2`` equals ``engine.get_global_grad_norm()``), Adam state and updates after
it (after DeepSpeed copied its fp32 partitions into the model's weights and, under ZeRO 1 and 2,
all-gathered them). What each kind reads is in
:mod:`tmetrics_core.integrations.deepspeed_partitions`: under ZeRO 1 and 2 the parameters are
the model's weights (whole on every rank, a verified ``Replica``) and their update the change
of those weights; under ZeRO 3 each rank reads its own partition (``ds_tensor``), so no due step
gathers a parameter, and its update is the change of that partition (a copy of it is taken
before the step on due steps that read updates). With bf16 the weights read are the bf16 ones
the forward uses; Adam state is the fp32 state of DeepSpeed's master partitions. Without ZeRO
(stage 0, fp32) the engine's client optimizer is hooked as usual and ``dp`` is a replica axis.

**Refused** with a ``ConfigError`` naming the feature (:func:`refuse`): ZeRO's optimizer with
another module, the pipeline engine, DeepSpeed-MoE, ZeRO++ hierarchical partitions, Ulysses
sequence parallelism, and without ZeRO gradient clipping and DeepSpeed's fp16/bf16 wrappers.

**fp16 with loss scaling** (ZeRO 1, 2 and 3): the gradients are read divided by DeepSpeed's
loss scale of the step (see ``deepspeed_partitions._unscaled``). A step DeepSpeed skips (inf or
NaN gradients: its ``overflow``) still writes its gradient metrics (``layer-grad-nonfinite``
counts the culprits; ``global-grad-l2`` is inf or NaN, as DeepSpeed's own norm); its update and
optimizer-state metrics write nothing, with a reason naming the skip, said at WARNING once
(later skips at INFO). Cotangent metrics (``*-grad-*`` of activations) divide by the same scale.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping

import torch

from tmetrics_core.distributed import world
from tmetrics_core.errors import ConfigError
from tmetrics_core.integrations.adapter import BaseAdapter, Prepared
from tmetrics_core.integrations.deepspeed_partitions import Zero3Updates, partitions
from tmetrics_core.integrations.megatron_shards import OwnedRanges
from tmetrics_core.integrations.step_hooks import StepHooks
from tmetrics_core.topology import Topology

__all__ = ["DeepSpeed", "DeepSpeedSetup", "DeepSpeedSteps", "Found", "found", "refuse", "setup", "topology"]

log = logging.getLogger("tmetrics")


def _engine_class() -> Any:
    module = sys.modules.get("deepspeed.runtime.engine")
    return getattr(module, "DeepSpeedEngine", None)


def _zero_stage(optimizer: Any) -> int:
    """3, 2 or 1 for DeepSpeed's ZeRO optimizers (by class name along the MRO), else 0."""
    for c in type(optimizer).__mro__:
        if c.__module__.startswith("deepspeed."):
            if c.__name__ == "DeepSpeedZeroOptimizer_Stage3":
                return 3
            if c.__name__ == "DeepSpeedZeroOptimizer":
                return 2 if optimizer.partition_gradients else 1
    return 0


@dataclass(frozen=True)
class Found:
    """A DeepSpeed run as tmetrics was handed it.

    Attributes:
        model: the engine's module.
        optimizer: the engine's optimizer (ZeRO's, or the client torch optimizer without ZeRO).
        engine: the ``DeepSpeedEngine`` when it was given, else None.
        stage: the ZeRO stage (0 without ZeRO).
    """

    model: torch.nn.Module
    optimizer: Any
    engine: Any
    stage: int


def found(model: Any, optimizer: Any = None) -> Found | None:
    """The DeepSpeed run behind ``model`` (a ``DeepSpeedEngine``) or behind ``optimizer`` (ZeRO's
    optimizer with ``model=engine.module``: the same records), else None.

    Raises:
        ConfigError: ``optimizer`` given with an engine and not the engine's; ZeRO's optimizer
            with a ``model`` none of whose parameters it steps (pass the engine).
    """
    engine_class = _engine_class()
    if engine_class is not None and isinstance(model, engine_class):
        if optimizer is not None and optimizer is not model.optimizer:
            raise ConfigError("model= is a DeepSpeedEngine and optimizer= is not its optimizer; pass the engine "
                              "alone (model=engine): tmetrics takes the optimizer from it", path="optimizer")
        return Found(model.module, model.optimizer, model, int(model.zero_optimization_stage()))
    stage = _zero_stage(optimizer) if optimizer is not None else 0
    if stage:
        stepped = {id(p) for group in _groups(optimizer) for p in group}
        if not isinstance(model, torch.nn.Module) or not any(id(p) in stepped for p in model.parameters()):
            raise ConfigError(f"optimizer= is DeepSpeed's {type(optimizer).__name__} but model= is not the module "
                              "it optimizes; pass TensorMetrics.from_config(cfg, model=engine)", path="optimizer")
        return Found(model, optimizer, None, stage)
    return None


def _groups(optimizer: Any) -> list[list[torch.nn.Parameter]]:
    return list(optimizer.fp16_groups if _zero_stage(optimizer) == 3 else optimizer.bit16_groups)


def topology(run: Found) -> Topology:
    """One axis ``dp``: the group ZeRO partitions over (see the module docstring).

    Raises:
        ConfigError: what :func:`refuse` refuses.
    """
    refuse(run)
    if run.engine is not None:
        group = run.engine.seq_data_parallel_group
    else:
        group = run.optimizer.dp_process_group
    return Topology.from_groups({"dp": group if group is not None else world.world_group()}, population_axes=("dp",))


def refuse(run: Found) -> None:
    """Raise ``ConfigError`` for what tmetrics does not read, naming it and what to do: the
    pipeline engine, DeepSpeed-MoE, Ulysses sequence parallelism, ZeRO++ hierarchical
    partitions, and without ZeRO: gradient clipping (it clips ``.grad``
    before the step's hooks) and DeepSpeed's fp16/bf16 optimizer wrappers."""
    engine, optimizer = run.engine, run.optimizer
    if any(c.__name__ in ("PipelineEngine", "PipelineModule") and c.__module__.startswith("deepspeed.")
           for obj in (engine, run.model) for c in type(obj).__mro__):
        raise ConfigError("DeepSpeed's PipelineEngine runs its own schedule (train_batch) with stages on other "
                          "ranks; tmetrics does not read it. Train with a DeepSpeedEngine without pipeline "
                          "parallelism, or use Megatron-Core's pipeline with tmetrics' Megatron integration")
    if any(type(m).__name__ == "MoE" and type(m).__module__.startswith("deepspeed.moe") for m in run.model.modules()):
        raise ConfigError("DeepSpeed-MoE (deepspeed.moe.layer.MoE) keeps expert parameters in expert-parallel "
                          "groups of their own; tmetrics does not read them. Measure a dense DeepSpeed model, or "
                          "an MoE model through Megatron-Core or torchtitan")
    groups = sys.modules.get("deepspeed.utils.groups")
    sequence = engine.sequence_parallel_size if engine is not None else (
        groups._get_sequence_parallel_world_size() if groups is not None else 1)
    if sequence > 1:
        raise ConfigError(f"DeepSpeed Ulysses sequence parallelism ({sequence} ranks) is not read by tmetrics yet; "
                          "train without sequence_parallel_size")
    hpz = int(getattr(optimizer, "zero_hpz_partition_size", 1) or 1)
    if hpz > 1:
        raise ConfigError(f"ZeRO++ hierarchical partitions (zero_hpz_partition_size={hpz}) keep a second copy of "
                          "ZeRO 3's parameters over a sub-group; tmetrics reads ZeRO's primary partitions only. "
                          "Leave zero_hpz_partition_size out of the DeepSpeed config")
    if run.stage == 0 and engine is not None and engine.gradient_clipping() > 0:
        raise ConfigError("DeepSpeed without ZeRO clips the gradients in .grad before its optimizer step, where "
                          "tmetrics reads them: the records would be of clipped gradients. Use ZeRO stage 1 or "
                          "more, or leave gradient_clipping out")
    if run.stage == 0 and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DeepSpeed without ZeRO wraps the optimizer in {type(optimizer).__name__} "
                          "(fp16/bf16 without ZeRO); tmetrics reads ZeRO stages 1, 2 and 3 and the plain "
                          "client optimizer. Set zero_optimization.stage to 1 or more")


class DeepSpeedSteps(StepHooks):
    """DeepSpeed's optimizer seen as tmetrics sees a torch one: step pre/post hooks around its
    whole ``step()`` (ZeRO's: norm, unscale and clip, the inner torch step, the copy back and
    all-gather of the weights), the inner torch optimizer's ``defaults``; its ``state`` is
    empty (ZeRO's Adam state is read from the partitions). A ``step()`` that DeepSpeed skipped
    (its ``overflow`` set: inf or NaN gradients, under fp16 or with bf16's overflow check) runs
    the skip hooks instead of the post hooks: the optimizer did not step, as with
    ``torch.amp.GradScaler``.
    """

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.inner = optimizer.optimizer
        self.state: dict[Any, Any] = {}

    def skipped(self) -> bool:
        return bool(getattr(self.wrapped, "overflow", False))

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner torch optimizer's defaults (``betas`` tells Adam)."""
        return dict(self.inner.defaults)


@dataclass
class DeepSpeedSetup:
    """What :func:`setup` hands to ``TensorMetrics``.

    Attributes:
        constructing: entered around ``TensorMetrics(...)``: under ZeRO 3 the parameters
            gathered once, so the manifest sees their shapes (their partitions are read after).
    """

    model: torch.nn.Module
    optimizer: Any
    stage: int
    flat_buffers: list[OwnedRanges] = field(default_factory=list)
    constructing: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    updates: Zero3Updates | None = None
    skip_said: bool = False

    def attach(self, tracker: Any) -> list[Any]:
        """The step hooks of this setup on ``tracker`` (the ``TensorMetrics`` built with it, whose
        ``params.due`` names the step's due metrics), removed with its hooks by ``close()``:

        - a step DeepSpeed skipped (see :class:`DeepSpeedSteps`) fails the due update and
          optimizer-state metrics of the step with a reason naming the skip (its gradient
          metrics were read before it), said at WARNING on the logging rank once, at INFO after;
        - under ZeRO 3, a copy of this rank's partitions before a due step whose metrics read
          updates, dropped after it.

        Under fp16 it also gives ``tracker`` DeepSpeed's loss scale (``optimizer.loss_scale``,
        a float read at each step's first cotangent), which cotangent metrics divide by, as
        they divide by a ``GradScaler``'s (:mod:`~tmetrics_core.sources.cotangents`)."""
        if not isinstance(self.optimizer, DeepSpeedSteps):
            return []
        observer, updates, wrapped = tracker.params, self.updates, self.optimizer.wrapped
        if getattr(wrapped, "dtype", None) == torch.float16:
            tracker._loss_scale = lambda: wrapped.loss_scale  # read where a GradScaler's scale is

        def skipped(*_: Any) -> None:
            if updates is not None:
                updates.forget()
            if not observer.due:
                return
            reason = (f"DeepSpeed skipped the optimizer step of step {observer.step}: a gradient was inf or NaN "
                      f"(overflow; loss scale now {getattr(self.optimizer.wrapped, 'loss_scale', 1.0)}); "
                      "layer-grad-nonfinite counts them. No update, the optimizer state unchanged")
            observer.fail_post(reason)
            if tracker.reporter.speaks:
                log.log(logging.INFO if self.skip_said else logging.WARNING, "tmetrics: %s%s", reason,
                        "" if self.skip_said else ". Said at WARNING once; later skips at INFO")
            self.skip_said = True

        handles: list[Any] = [self.optimizer.register_step_skipped_hook(skipped), self.optimizer]  # last: step back
        if updates is None:
            return handles
        zero3 = updates

        def before(*_: Any) -> None:
            if any("update" in m.source_kinds for m in observer.due):
                zero3.take()

        def after(*_: Any) -> None:
            zero3.forget()

        return [*handles, self.optimizer.register_step_pre_hook(before),
                self.optimizer.register_step_post_hook(after)]


def setup(run: Found, topology: Topology) -> DeepSpeedSetup:
    """The run's model, its optimizer (adapted by :class:`DeepSpeedSteps` under ZeRO; the client
    torch optimizer without ZeRO) and the partitions each kind is read from.

    Raises:
        ConfigError: what :func:`refuse` refuses; ``topology`` without ZeRO's data-parallel
            ranks as ``dp``; what :func:`~tmetrics_core.integrations.deepspeed_partitions.partitions` raises.
    """
    refuse(run)
    model, optimizer, stage = run.model, run.optimizer, run.stage
    if stage == 0:
        return DeepSpeedSetup(model=model, optimizer=optimizer, stage=0)
    group = optimizer.dp_process_group
    ranks = world.group_ranks(group)
    dp = topology.axes.get("dp")
    if dp is None or sorted(dp.ranks) != sorted(ranks):
        raise ConfigError(f"DeepSpeed's ZeRO partitions over ranks {sorted(ranks)}, but the topology's dp axis is "
                          f"{sorted(dp.ranks) if dp else 'absent'}; leave mesh= and axes= out: the engine gives them")
    flat, updates = partitions(optimizer, stage, ranks)
    steps = DeepSpeedSteps(optimizer)
    constructing: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    if stage == 3:
        gathered = sys.modules["deepspeed"].zero.GatheredParameters
        params = list(model.parameters())

        def constructing() -> ContextManager[Any]:
            return gathered(params, modifier_rank=None)  # type: ignore[no-any-return]
    return DeepSpeedSetup(model=model, optimizer=steps, stage=stage, flat_buffers=flat, constructing=constructing,
                          updates=updates)


class DeepSpeed(BaseAdapter):
    """The :class:`~tmetrics_core.integrations.adapter.FrameworkAdapter` of DeepSpeed: detected
    from a ``DeepSpeedEngine`` or ZeRO's optimizer (:func:`found`); the topology from ZeRO's
    data-parallel group unless ``mesh=`` or ``axes=`` is given; the rest from :func:`setup`."""

    name = "deepspeed"
    layouts: tuple[str, ...] = ()

    def detect(self, model: Any, optimizer: Any, mesh: Any) -> bool:
        return "deepspeed" in sys.modules and found(model, optimizer) is not None

    def topology(self, model: Any, optimizer: Any, mesh: Any, axes: Mapping[str, Any] | None, *,
                 timeout_s: float) -> Topology | None:
        run = found(model, optimizer)
        return topology(run) if run is not None and mesh is None and axes is None else None

    def prepare(self, model: Any, optimizer: Any, topology: Topology) -> Prepared:
        run = found(model, optimizer)
        assert run is not None  # detect() found it
        speed = setup(run, topology)
        return Prepared(model=speed.model, optimizer=speed.optimizer, flat_buffers=speed.flat_buffers,
                        constructing=speed.constructing, attach=speed.attach)
