"""A float64 reference for the parameter side: every record recomputed from the tensors themselves.

:class:`Capture` hooks a model's optimizer and ``TensorMetrics.observe_gradients`` and copies,
in float64, what each parameter-side kind holds at the moment tmetrics documents it reads it:
gradients at the last ``observe_gradients()`` before the optimizer step (else in its pre-hook,
else at the step's end), parameters before the step (metrics of parameters alone: read before
it or from the update snapshot) and after it (metrics that read updates or Adam state), updates
as their difference, Adam state after the step. :meth:`Capture.reference` then gives each
record of a moments metric from those copies with plain float64 torch reductions (sums of
squares, sums, extremes with their NaN flags, zero and element counts; a tensor this rank does
not read joins as its statistic's neutral element), grouped by the metric's scope, through the
metric's own ``finalize`` (its formula, a few lines of arithmetic). The manifest gives only names,
labels and expert views, never values.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.sources.params import grad_of
from tmetrics_core.sources.params import local_view
from tmetrics_core.tensor_metrics import TensorMetrics

__all__ = ["Capture", "assert_matches"]

_OPS = {"sumsq": "sum", "sum": "sum", "count": "sum", "zeros": "sum", "nonfinite": "sum", "absmax": "max",
        "max": "max", "min": "min"}
_NEUTRAL = {"sum": 0.0, "max": -math.inf, "min": math.inf}
_POST = frozenset({"update", "exp_avg", "exp_avg_sq"})


def _vector(stat: str, x: torch.Tensor) -> list[float]:
    """One tensor's vector of ``stat``, in float64 (``x`` is float64)."""
    nan = bool(torch.isnan(x).any())
    if stat == "sumsq":
        return [float(x.square().sum())]
    if stat == "sum":
        return [float(x.sum())]
    if stat == "count":
        return [float(x.numel())]
    if stat == "zeros":
        return [float((x == 0).sum())]
    if stat == "nonfinite":
        return [float(torch.isnan(x).sum()), float((x == math.inf).sum()), float((x == -math.inf).sum())]
    if stat == "absmax":
        return [0.0, 1.0] if nan else [float(x.abs().max()) if x.numel() else 0.0, 0.0]
    if stat == "max":
        return [-math.inf, 1.0] if nan else [float(x.max()) if x.numel() else -math.inf, 0.0]
    if stat == "min":
        return [math.inf, -1.0] if nan else [float(x.min()) if x.numel() else math.inf, 0.0]
    raise KeyError(stat)


def _fold(op: str, held: list[float] | None, values: list[float]) -> list[float]:
    if held is None:
        return list(values)
    pick = {"sum": lambda a, b: a + b, "max": max, "min": min}[op]
    return [pick(a, b) for a, b in zip(held, values)]


def known(metric: Any) -> bool:
    """Whether the reference computes ``metric``: a moments :class:`StatMetric`."""
    return isinstance(metric, StatMetric) and all(s.name in _OPS for s in metric.statistics)


class Capture:
    """Float64 copies of what ``metrics`` reads each step (see the module docstring); call
    :meth:`begin` and :meth:`end` around each step scope's body."""

    def __init__(self, metrics: TensorMetrics, optimizer: Any) -> None:
        self.metrics = metrics
        self.optimizer = optimizer
        self.manifest = metrics.params.reads.manifest
        self.sites = metrics.params.reads.kind_sites
        self._observe: Callable[[], None] = metrics.observe_gradients
        metrics.observe_gradients = self._observed  # type: ignore[method-assign]
        begin = metrics.params.begin

        def due_step(step: int, due: Any) -> None:
            self.due = {m.name for m in due}
            begin(step, due)
        metrics.params.begin = due_step  # type: ignore[method-assign]
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self._pre())
            optimizer.register_step_post_hook(lambda *_: self._post())
        self.begin()

    def begin(self) -> None:
        self.grads: dict[str, torch.Tensor | None] | None = None
        self.before: dict[str, torch.Tensor | None] | None = None
        self.after: dict[str, torch.Tensor | None] | None = None
        self.state: dict[str, dict[str, torch.Tensor | None]] = {}
        self.steps = 0
        self.due: set[str] = set()
        """The names of the metrics due in this step scope."""

    def end(self) -> None:
        if self.before is None:
            self.before = self._read(lambda p: p)
        if self.grads is None:
            self.grads = self._read(grad_of)

    def _observed(self) -> None:
        if self.steps == 0:
            self.grads = self._read(grad_of)
        self._observe()

    def _pre(self) -> None:
        if self.steps == 0:
            self.before = self._read(lambda p: p)
            if self.grads is None:
                self.grads = self._read(grad_of)

    def _post(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self.after = self._read(lambda p: p)
            for kind in ("exp_avg", "exp_avg_sq"):
                self.state[kind] = self._read(lambda p, k=kind: self.optimizer.state.get(p, {}).get(k))

    def _read(self, of: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {}
        for entry in self.manifest.entries:
            p = self.manifest.local.get(entry.name)
            t = of(p) if p is not None else None
            t = local_view(t) if t is not None else None
            out[entry.name] = None if t is None else self.manifest.viewed(entry.name, t.detach()).double().clone()
        return out

    def tensors(self, kind: str, post: bool) -> dict[str, torch.Tensor | None]:
        """Canonical name -> the float64 tensor a metric of ``kind`` read (``post``: the metric
        reads updates or Adam state, so its parameters are those after the step)."""
        assert self.before is not None and self.grads is not None
        if kind == "grad":
            return self.grads
        if kind == "param":
            return self.after if post and self.after is not None else self.before
        if kind == "update":
            assert self.after is not None
            return {n: None if a is None or self.before[n] is None else a - self.before[n]
                    for n, a in self.after.items()}
        return self.state.get(kind, {})

    def reference(self, metric: StatMetric) -> dict[tuple, float]:
        """``(metric, layer, expert, tensor, stat) -> value`` of every record ``metric`` writes:
        none when it reads no tensor at all (it found nothing to measure)."""
        post = bool(metric.source_kinds & _POST)
        groups: dict[tuple, dict[str, list[float]]] = {}
        labels: dict[tuple, Any] = {}
        accepted = [s for kind in sorted(metric.source_kinds) for s in self.sites[kind] if metric.accepts(s)]
        kept = metric.kept(accepted)
        if kept is not None:
            accepted = [accepted[i] for i in kept]
        if all(self.tensors(s.kind, post).get(s.name) is None for s in accepted):
            return {}
        for site in accepted:
            key = metric._group(site)
            bucket = groups.setdefault(key, {})
            labels.setdefault(key, site)
            x = self.tensors(site.kind, post).get(site.name)
            for stat in metric.statistics:
                op = _OPS[stat.name]
                values = _vector(stat.name, x) if x is not None else [_NEUTRAL[op]] * stat.size(site)
                for name in (stat.name, f"{site.kind}:{stat.name}"):
                    bucket[name] = _fold(op, bucket.get(name), values)
        out: dict[tuple, float] = {}
        for key, stats in groups.items():
            value = metric.finalize(stats)
            if value is None:
                continue
            scope, layer, expert, tensor = metric._labels(labels[key])
            if isinstance(value, Mapping):
                out.update(((metric.name, layer, expert, tensor, stat), v) for stat, v in value.items())
            else:
                out[(metric.name, layer, expert, tensor, None)] = value
        return out


def assert_matches(records: dict[tuple, float], capture: Capture, failed: set[str], *, rel: float,
                   where: str = "") -> int:
    """Every known metric (:func:`known`) due this step or that wrote some record, and not
    failed, wrote the reference's records (NaN equal to NaN, rel ``rel``): the same keys, so a
    due metric that wrote nothing fails unless the reference has no record either. Returns how
    many records were checked."""
    metrics = {m.name: m for m, _ in capture.metrics.metrics}
    written = {key[0] for key in records}
    checked = 0
    for name in sorted((written | capture.due) - failed):
        metric = metrics.get(name)
        if metric is None or not known(metric):
            continue
        want = capture.reference(metric)
        got = {k: v for k, v in records.items() if k[0] == name}
        assert got.keys() == want.keys(), (where, name, set(got) ^ set(want))
        for key, value in got.items():
            expected = want[key]
            if math.isnan(expected) or math.isinf(expected):
                assert (math.isnan(value) and math.isnan(expected)) or value == expected, (where, key, value, expected)
            else:
                assert value == _approx(expected, rel), (where, key, value, expected)
            checked += 1
    return checked


def _approx(expected: float, rel: float) -> Any:
    import pytest

    return pytest.approx(expected, rel=rel, abs=1e-300)
