"""Optimizer state found by its meaning, not by Adam's key names.

tmetrics' state kinds are meanings: ``exp_avg`` is the first moment of the gradient (an
exponential average of it: Adam's ``exp_avg``, the ``momentum_buffer`` of SGD with momentum and
of Muon), ``exp_avg_sq`` the second moment (an exponential average of its square: Adam's
``exp_avg_sq``, RMSprop's ``square_avg``). Each torch optimizer class declares below which of
its state keys holds which meaning; a metric reading a meaning that an optimizer of the step does
not keep per element is refused at start-up, naming the optimizer and why (Adafactor keeps the
second moment of a matrix factored into row and column averages; Adagrad keeps a sum of squares,
not an average; SGD without momentum keeps nothing). Before, a state metric read Adam's keys on
any optimizer and wrote nothing, or NaN, with a false word.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["STATE_KEYS", "state_keys", "state_value", "torch_optimizers"]

_ADAM = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

STATE_KEYS: Mapping[str, Mapping[str, str]] = {
    "Adam": _ADAM, "AdamW": _ADAM, "NAdam": _ADAM, "RAdam": _ADAM, "SparseAdam": _ADAM,
    "Adamax": {"exp_avg": "exp_avg"},
    "SGD": {"exp_avg": "momentum_buffer"},
    "Muon": {"exp_avg": "momentum_buffer"},
    "RMSprop": {"exp_avg_sq": "square_avg"},
}
"""Optimizer class name -> tmetrics state kind -> the key of ``optimizer.state[param]`` that holds it."""

_WHY_NOT: Mapping[tuple[str, str], str] = {
    ("Adafactor", "exp_avg_sq"): "keeps the second moment of a matrix factored (row_var, col_var), not per element",
    ("Adafactor", "exp_avg"): "keeps no first moment",
    ("Adagrad", "exp_avg_sq"): "keeps a sum of squared gradients (sum), not an exponential average",
    ("Adamax", "exp_avg_sq"): "keeps an infinity norm (exp_inf), not a second moment",
    ("RMSprop", "exp_avg"): "keeps no first moment of the gradient (its momentum_buffer averages steps)",
}

_NAMES = {"exp_avg": "first moment (exp_avg)", "exp_avg_sq": "second moment (exp_avg_sq)"}


def torch_optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers whose state ``optimizer`` holds: its ``torch_optimizers`` (a chain,
    an integration's adapter) or the optimizer itself."""
    held = getattr(optimizer, "torch_optimizers", None)
    return tuple(held) if held is not None else (optimizer,)


def state_keys(optimizer: Any, kinds: set[str] | frozenset[str], metric: str, path: str = "optimizer"
               ) -> dict[str, tuple[str, ...]]:
    """Per state kind of ``kinds``, the keys that hold it in the optimizers of the step (one per
    optimizer class; a chain of Muon and AdamW gives ``exp_avg: (momentum_buffer, exp_avg)``).

    Raises:
        ConfigError: an optimizer of the step keeps no per-element state of that meaning, or is
            not known to tmetrics (at ``path``), naming the optimizer and ``metric``.
    """
    out: dict[str, tuple[str, ...]] = {}
    for kind in sorted(kinds):
        keys: list[str] = []
        for leaf in torch_optimizers(optimizer):
            name = type(leaf).__name__
            kept = _kept(leaf)
            key = kept.get(kind)
            if key is None:
                remedy = (f"keep the moments every optimizer has (the metric's option moments: {sorted(kept)})"
                          if kept else "drop the metric")
                raise ConfigError(f"metric {metric!r} reads the optimizer's {_NAMES.get(kind, kind)}, but {name} "
                                  f"{_why_not(name, kind)}; {remedy}", path=path)
            if key not in keys:
                keys.append(key)
        out[kind] = tuple(keys)
    return out


def _kept(optimizer: torch.optim.Optimizer) -> Mapping[str, str]:
    """The state kinds ``optimizer`` keeps, with their keys (SGD's momentum only where every
    parameter group has momentum)."""
    name = type(optimizer).__name__
    if name == "SGD" and not all(g.get("momentum", 0) for g in optimizer.param_groups):
        return {}
    return STATE_KEYS.get(name, {})


def _why_not(name: str, kind: str) -> str:
    """Why optimizer class ``name`` has no state of ``kind``."""
    if (name, kind) in _WHY_NOT:
        return _WHY_NOT[name, kind]
    if name == "SGD" and kind == "exp_avg":
        return "has momentum 0 in some parameter group: it keeps no first moment"
    if name in STATE_KEYS or any(n == name for n, _ in _WHY_NOT):
        return f"keeps no {_NAMES[kind].split(' (')[0]}"
    return "is not an optimizer whose state tmetrics knows (known: " + ", ".join(sorted(STATE_KEYS)) + ")"


def state_value(state: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of one parameter's optimizer ``state`` under the first of ``keys`` it holds (None
    when it holds none: no step yet)."""
    for key in keys:
        value = state.get(key)
        if value is not None:
            return value
    return None
