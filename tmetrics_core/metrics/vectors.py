"""The one entry path of statistics: their local vectors of a list of tensors.

:func:`statistic_vectors` computes, for the statistics of one call (a metric's), the rows of the
tensors once, with the columns the statistics declare (:attr:`Statistic.reads`, one batched pass
of :func:`tmetrics_core.kernels.rows.rows` on any device), and hands each statistic the tensors
and those rows (:meth:`Statistic.compute`). Rows and vectors are kept in the step's memo, so
metrics reading the same statistics of the same sites share one computation.
"""

from __future__ import annotations

import operator
from typing import Any, Hashable, Sequence

import torch

from tmetrics_core.kernels.rows import FIELDS, rows
from tmetrics_core.metrics.statistics import Statistic
from tmetrics_core.site import Site
from tmetrics_core.topology import Topology

__all__ = ["statistic_vectors"]

_KEY = operator.attrgetter("key")


def statistic_vectors(statistics: Sequence[Statistic], tensors: Sequence[torch.Tensor], sites: Sequence[Site],
                      topology: Topology, memo: dict[Hashable, Any]) -> list[torch.Tensor | list[torch.Tensor]]:
    """Per statistic, its first-stage vectors of ``tensors`` (the local tensors of ``sites``):
    a float64 ``[len(tensors), size]`` matrix or a list of one vector per tensor
    (:meth:`Statistic.compute`). Tensors that require grad are read detached while autograd
    records. The rows (float64 ``[len(tensors), 5]``, the union of the statistics' columns) and
    each statistic's result are kept in ``memo`` under the site keys, for every later call of the
    step with the same sites: a later call that reads other columns computes only those.
    Vectors are shared: never change them in place.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):  # under no_grad read as they are
        tensors = [t.detach() if t.requires_grad else t for t in tensors]
    keys = tuple(map(_KEY, sites))
    columns = frozenset().union(*(s.reads for s in statistics))
    read = _rows(tensors, keys, columns, memo) if columns else None
    out = []
    for stat in statistics:
        vectors = memo.get((stat.name, keys))
        if vectors is None:
            vectors = memo[(stat.name, keys)] = stat.compute(tensors, sites, topology, read if stat.reads else None)
        out.append(vectors)
    return out


_FIELD = {name: i for i, name in enumerate(FIELDS)}


def _rows(tensors: Sequence[torch.Tensor], keys: tuple, columns: frozenset[str],
          memo: dict[Hashable, Any]) -> torch.Tensor:
    """The rows of ``tensors`` with (at least) ``columns``, from the memo's rows of the same
    sites where they hold them, else the memo's rows completed by one pass over the missing
    columns only (``absmax`` asked beside a real maximum or minimum is read as both)."""
    held = memo.get(("rows", keys))
    if held is None:
        read = rows(tensors, columns)
        memo[("rows", keys)] = (columns, read)
        return read
    have, read = held
    fields = have - {"absmax"}
    if "absmax" in have and not {"max", "min"} & fields:
        fields |= {"absmax"}  # max and min hold the absolute maximum and its negation
    missing = {c for c in columns if c not in fields and not (c == "absmax" and {"max", "min"} <= fields)}
    if not missing:
        return read
    if "absmax" in missing or ("absmax" in fields and missing & {"max", "min"}):
        missing = (missing - {"absmax"}) | {"max", "min"}  # real extremes; absmax reads them too
    extra = rows(tensors, missing)
    out = read.clone()
    at = sorted({_FIELD[c] for c in missing})
    out[:, at] = extra[:, at]
    memo[("rows", keys)] = (have | missing, out)
    return out
