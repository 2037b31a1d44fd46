"""``layer-{param,grad,activation}-quant``: what low-precision recipes would do to each layer.

One :class:`QuantMetric` compares one or more recipes in one pass: each recipe contributes
two statistics (sums and extremes, :mod:`tmetrics_core.metrics.quant.statistics`) per site,
and the records of a layer carry one stat per (recipe, quantity), named ``<recipe>.<quantity>``:

- ``underflow``: non-zero finite elements decoded as 0, over all elements (TE ``underflows%``/100);
- ``overflow``: elements rounded beyond the format's largest value, saturated, over all elements
  (TE ``overflows%``/100);
- ``sqnr-db``: ``10 log10(sum x**2 / sum (x - dq(x))**2)`` over finite elements;
- ``rel-error``: mean of ``|x - dq(x)| / |x|`` over finite non-zero elements;
- ``mse``: ``sum (x - dq(x))**2 / N`` (TE ``mse``);
- ``amax``: ``max |x|`` (TE ``cur_amax``);
- ``scale-min``, ``scale-max``: the smallest and largest decode scale (TE ``scale_inv_min``,
  ``scale_inv_max``) over blocks with a finite non-zero amax;
- ``scale-std``: the std of ``log2`` of those decode scales, in binades;
- ``dynamic-range``: ``log2(amax / min |x|)`` over finite non-zero x (TE ``dynamic_range``);
- ``scale-at-limit``: the fraction of those blocks whose scale was clamped to its format's range;
- ``nonfinite``: the count of non-finite decoded values.

Every value is exact across ranks: counts are integers summed in float64, sums are float64,
extremes reduce by MAX; the std follows from the summed ``sum`` and ``sum of squares``.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Mapping, Sequence

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.activations import DEFAULT_MODULES
from tmetrics_core.metrics.base import StatMetric
from tmetrics_core.metrics.quant.recipes import recipe_named
from tmetrics_core.metrics.quant.statistics import MAX_FIELDS, SUM_FIELDS, Held, QuantStatistic, quant_rows, scale_axes
from tmetrics_core.site import Site

__all__ = ["QUANT_STATS", "QuantMetric"]

QUANT_STATS = ("underflow", "overflow", "sqnr-db", "rel-error", "mse", "amax", "scale-min", "scale-max",
               "scale-std", "dynamic-range", "scale-at-limit", "nonfinite")
"""The quantities each recipe reports, in record order."""


_READ_ONCE = frozenset({"param", "grad"})
"""Kinds read once per step (the last read counts, as ``observe_gradients()`` called again)."""


class QuantMetric(StatMetric):
    """Low-precision statistics of one source kind under one or more recipes.

    Args:
        recipe: a recipe name of :data:`~tmetrics_core.metrics.quant.recipes.RECIPES` or a list of
            them (default ``mxfp8``).
        format: FP8 recipes: ``e4m3`` or ``e5m2`` instead of the recipe's default.
        scale_mode: ``mxfp8``: ``floor`` (default), ``ceil``, ``even`` or ``rceil``.
        modules: activation kinds: globs on canonical module names or module paths whose outputs
            are read (default :data:`~tmetrics_core.metrics.activations.DEFAULT_MODULES`).

    Raises:
        ConfigError: an unknown recipe, format or scale mode (nearest name given), a recipe listed
            twice, or an option the recipe cannot take.
    """

    planned = False
    resume_agreed = False
    formula = "per recipe: underflow, overflow, sqnr-db, rel-error, mse, amax, scale-min/max/std, dynamic-range"

    def __init__(self, *, recipe: str | Sequence[str] | None = None, format: str | None = None,
                 scale_mode: str | None = None, modules: str | Sequence[str] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        chosen = (modules,) if isinstance(modules, str) else tuple(modules or ())
        self.modules: tuple[str, ...] = chosen or DEFAULT_MODULES
        names = (recipe,) if isinstance(recipe, str) else tuple(recipe or ("mxfp8",))
        (kind,) = self.source_kinds
        self.recipes = tuple(recipe_named(n, kind, format=format, scale_mode=scale_mode) for n in names)
        if len(set(names)) != len(names):
            raise ConfigError(f"recipe lists {list(names)}: a recipe appears twice; list each once", path="recipe")
        self.held = Held()
        self.statistics = tuple(QuantStatistic(r, part, self.held) for r in self.recipes for part in ("sums", "extremes"))

    def accepts(self, site: Site) -> bool:
        """Sites of the metric's kind (and ``select``); activations of a chosen module only (as
        ``layer-activation-rms``: the canonical module name or the path in the model)."""
        if not super().accepts(site):
            return False
        if not site.kind.startswith("activation"):  # activations and their gradients come from modules
            return True
        path = dict(site.meta).get("module")
        return any(fnmatchcase(site.name, m) or (isinstance(path, str) and fnmatchcase(path, m)) for m in self.modules)

    def prepare(self, sites, tensors, topology, memo):
        held = [i for i, t in enumerate(tensors) if t is not None]
        cut = {i for i in held if scale_axes(sites[i], topology)}
        state: dict = {s.key: [] for s in sites}
        if any(r.tensor_amax for r in self.recipes):
            for i in cut:  # a copy: the optimizer step or later layers may change the tensor in place
                copy = tensors[i].detach().clone()
                if sites[i].kind in _READ_ONCE:  # one read per step: a later read replaces it
                    self.held.reading[sites[i].key] = [copy]
                else:  # one copy per observation (micro-batch)
                    self.held.reading.setdefault(sites[i].key, []).append(copy)
                self.held.two.add(sites[i].key)
        for recipe, sums_stat, max_stat in zip(self.recipes, self.statistics[::2], self.statistics[1::2]):
            now = [i for i in held if not (recipe.tensor_amax and i in cut)]
            sums, maxes = quant_rows(recipe, [tensors[i] for i in now]) if now else (None, None)
            rows = {i: r for r, i in enumerate(now)}
            for j, site in enumerate(sites):
                if tensors[j] is None:
                    state[site.key] += [sums_stat.placeholder(site, topology), max_stat.placeholder(site, topology)]
                elif j in rows:
                    state[site.key] += [sums[rows[j]], maxes[rows[j]]]  # type: ignore[index]
                else:
                    first = _amax_flag(tensors[j])
                    state[site.key] += [first, first]
        return state

    def start(self, state, sites, topology):
        self.held.begin()
        return super().start(state, sites, topology)

    def finalize(self, stats: Mapping[str, list[float]]):
        out: dict[str, float] = {}
        for recipe, sums_stat, max_stat in zip(self.recipes, self.statistics[::2], self.statistics[1::2]):
            s = dict(zip(SUM_FIELDS, stats[sums_stat.name]))
            m = dict(zip(MAX_FIELDS, stats[max_stat.name]))
            if not s["elements"]:
                continue
            out.update({f"{recipe.name}.{k}": v for k, v in _values(s, m).items()})
        return out or None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, recipes={[r.name for r in self.recipes]})"


def _amax_flag(t: torch.Tensor) -> torch.Tensor:
    """``[amax with NaN skipped, NaN flag]`` float64 of a local tensor (``[0, 0]`` when empty)."""
    x = t.detach()
    if not x.numel():
        return torch.zeros(2, dtype=torch.float64, device=x.device)
    a = x.abs().to(torch.float32)
    nan = torch.isnan(a)
    return torch.stack([torch.where(nan, 0.0, a).amax().to(torch.float64), nan.any().to(torch.float64)])


def _values(s: Mapping[str, float], m: Mapping[str, float]) -> dict[str, float]:
    """The reported quantities from one recipe's merged sums ``s`` and extremes ``m``."""
    n, blocks = s["elements"], s["blocks"]
    nan = math.nan
    err, energy = s["err_sumsq"], s["sumsq"]
    sqnr = nan if not energy else (math.inf if not err else 10.0 * math.log10(energy / err))
    mean = s["log2_scale_sum"] / blocks if blocks else nan
    var = max(s["log2_scale_sumsq"] / blocks - mean * mean, 0.0) if blocks else nan
    low = -m["neg_min_nonzero"]
    amax = m["amax"] if m["amax"] != -math.inf else nan
    return {
        "underflow": s["underflow"] / n,
        "overflow": s["overflow"] / n,
        "sqnr-db": sqnr,
        "rel-error": s["rel_sum"] / s["rel_count"] if s["rel_count"] else nan,
        "mse": err / n,
        "amax": amax,
        "scale-min": -m["neg_scale_min"] if blocks else nan,
        "scale-max": m["scale_max"] if blocks else nan,
        "scale-std": math.sqrt(var),
        "dynamic-range": math.log2(amax / low) if math.isfinite(low) and low > 0 and amax == amax else nan,
        "scale-at-limit": s["blocks_at_limit"] / blocks if blocks else nan,
        "nonfinite": s["nonfinite"],
    }
