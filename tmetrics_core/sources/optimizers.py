"""The torch optimizers behind what a training framework hands out.

Frameworks wrap the optimizer: accelerate's ``AcceleratedOptimizer`` (a ``torch.optim.Optimizer``
subclass that never runs its ``__init__``, so it has no hook tables), Lightning's
``LightningOptimizer`` (not an Optimizer; ``.optimizer``), Hugging Face Trainer's optimizer (an
``AcceleratedOptimizer``), Megatron-Core's optimizers (``.optimizer``) and its
``ChainedOptimizer``, which steps several in turn (``.chained_optimizers``: dense and expert
parameters). tmetrics hooks the torch optimizers themselves: :func:`unwrap_optimizer` follows
those attributes down to them. Several optimizers on one model (Muon for the matrices, AdamW for
the rest, as Moonlight and Kimi train) are passed as a list or tuple: they become one
:class:`OptimizerChain`, stepped in any order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["OptimizerChain", "unwrap_optimizer"]

_DEPTH = 8
"""Most wrappers followed (frameworks nest two or three)."""


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | OptimizerChain:
    """The torch optimizer inside ``optimizer``, or an :class:`OptimizerChain` of several.

    A list or tuple of optimizers (each may be a wrapper) is one chain of all of them. Follows
    ``.chained_optimizers`` (Megatron's ChainedOptimizer), then ``.optimizer``
    (accelerate, Lightning, Megatron), down to ``torch.optim.Optimizer`` instances. An object
    that is no torch optimizer but has its own ``register_step_pre_hook`` and
    ``register_step_post_hook`` (an integration's adapter around a framework's step, e.g.
    ``integrations.megatron.MegatronSteps``) is taken as it is.

    Raises:
        ConfigError: nothing that leads to a torch optimizer (with the type found and what is
            accepted), or DeepSpeed's ZeRO optimizer (its torch optimizer steps flat partitions;
            ``from_config(cfg, model=engine)`` reads them).
    """
    if not isinstance(optimizer, torch.optim.Optimizer) and all(
            callable(getattr(optimizer, hook, None)) for hook in ("register_step_pre_hook", "register_step_post_hook")):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        if not optimizer:
            raise ConfigError("optimizer= is an empty list; pass the optimizer(s) that step the model",
                              path="optimizer")
        inner = [o for one in optimizer for o in _inner(one, 0, type(one).__name__)]
        if len({id(o) for o in inner}) != len(inner):
            raise ConfigError("optimizer= lists one torch optimizer twice; list each once", path="optimizer")
        return inner[0] if len(inner) == 1 else OptimizerChain(inner)
    inner = _inner(optimizer, 0, type(optimizer).__name__)
    return inner[0] if len(inner) == 1 else OptimizerChain(inner)


def _inner(obj: Any, depth: int, given: str) -> list[torch.optim.Optimizer]:
    if any(c.__name__.startswith("DeepSpeedZeroOptimizer") for c in type(obj).__mro__):
        # Its torch optimizer steps flat fp32 partitions, not the model's parameters.
        raise ConfigError(f"optimizer= is DeepSpeed's {type(obj).__name__}: ZeRO keeps gradients, master weights and "
                          "Adam state in partitions that only its integration reads. Build with "
                          "TensorMetrics.from_config(cfg, model=engine)", path="optimizer")
    # Chained first: Megatron's ChainedOptimizer.optimizer asserts there is only one.
    chained = getattr(obj, "chained_optimizers", None) if depth < _DEPTH else None
    if chained:
        return [o for c in chained for o in _inner(c, depth + 1, given)]
    wrapped = getattr(obj, "optimizer", None) if depth < _DEPTH else None
    if wrapped is not None and wrapped is not obj:
        return _inner(wrapped, depth + 1, given)
    if isinstance(obj, torch.optim.Optimizer) and hasattr(obj, "_optimizer_step_pre_hooks"):
        return [obj]
    raise ConfigError(
        f"optimizer= is a {given} and tmetrics found no torch.optim.Optimizer in it (reached a "
        f"{type(obj).__name__}). Pass a torch.optim.Optimizer, or a wrapper that holds one in .optimizer "
        "(accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer, Megatron-Core's optimizers) or "
        "several in .chained_optimizers (Megatron-Core's ChainedOptimizer), or a list of those", path="optimizer")


class _ChainedState(Mapping[Any, Any]):
    """``state[param]`` from whichever optimizer of the chain holds ``param``."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: Any) -> Any:
        for optimizer in self._optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class _Handles:
    """The hook handles of every optimizer of a chain, removed together."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self._handles = list(handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class OptimizerChain:
    """Several torch optimizers that together make one optimizer step (Megatron-Core's
    ``ChainedOptimizer``; a list passed as ``optimizer=``). Hooks are registered on every one of
    them, and each hook is called with the optimizer that steps: ``TensorMetrics`` reads
    gradients and snapshots the parameters at the first pre-hook of a step, and reads updates
    and state once every optimizer of the chain has stepped (or at the step's end), so each
    parameter's update is the one its own optimizer made, whatever the order they step in.
    State is looked up in whichever optimizer holds the parameter.

    Attributes:
        optimizers: the torch optimizers, in step order.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)
        self.state = _ChainedState(self.optimizers)

    @property
    def torch_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers whose state this chain holds (see :mod:`~tmetrics_core.sources.optimizer_state`)."""
        return self.optimizers

    @property
    def defaults(self) -> dict[str, Any]:
        """The hyperparameter names every optimizer of the chain has (``betas`` when all are Adam)."""
        keys = set.intersection(*(set(o.defaults) for o in self.optimizers))
        return {k: self.optimizers[0].defaults[k] for k in keys}

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> _Handles:
        return _Handles([o.register_step_pre_hook(hook) for o in self.optimizers])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> _Handles:
        return _Handles([o.register_step_post_hook(hook) for o in self.optimizers])

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(o).__name__ for o in self.optimizers)})"
