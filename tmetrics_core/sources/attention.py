"""Attention sites: queries and keys of each attention layer, handed to the attention metrics.

An observation (``tm.observe(module, name, (q, k), kind="attn_qk", attention=spec)``, or the
Hugging Face interface wrapper of :mod:`tmetrics_core.integrations.hf_attention`) arrives here
on due steps only. Its site (kind ``attn_qk``, logical shape ``(global query heads,)``) is built
once per run; the due metrics that read it prepare their per-head parts at once, and only those
small vectors outlive the call (nothing of ``[T x T]`` size is kept or made).

Placements of a site: ``Shard(0)`` on ``tp`` when the heads are split there (``shard_dim=1``:
the head dim of ``q [B, H, T, D]``), ``Shard(None)`` on the axes whose ranks hold other queries
(the population axes), none on the ``key_split`` axis (its ranks hold the same queries and other
keys); the token plan adds ``Owned`` for a pipeline stage's layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.metrics.attention_heads import KIND, AttentionObservation
from tmetrics_core.placements import Placement, Shard
from tmetrics_core.site import Site

if TYPE_CHECKING:
    from tmetrics_core.sources.tokens import TokenObserver

__all__ = ["observe_attention"]


@torch.no_grad()
def observe_attention(observer: "TokenObserver", module: torch.nn.Module, name: str, q: torch.Tensor,
                      k: torch.Tensor, spec: AttentionSpec | None, shard_dim: int | None) -> None:
    """Prepare the due attention metrics of one observed attention call (see the module
    docstring); a metric that raises is recorded in ``observer.errors``, never raised."""
    if torch._C._current_graph_task_id() != -1:
        return  # recomputation inside backward (activation checkpointing): observed in the forward
    spec = spec if spec is not None else AttentionSpec()
    path = observer.index.path(module)
    full = ".".join(p for p in (observer.index.name_of(path), name) if p)
    try:
        site = _site(observer, full, path, q, shard_dim, spec.key_split)
    except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
        for metric in observer.metrics:
            if KIND in metric.source_kinds:
                observer.errors.setdefault(metric.name, f"{type(exc).__name__}: {exc}")
        return
    observation = AttentionObservation(q.detach(), k.detach(), spec)
    memo: dict = {}  # the four metrics share one recompute of the scores
    for metric, _ in observer._readers(site, path):
        if metric.name in observer.errors:
            continue
        try:
            observer._check(metric, site)
            state = metric.prepare([site], [observation], observer.topology, memo)  # type: ignore[list-item]
            previous = observer.states.get(metric.name)
            observer.states[metric.name] = state if previous is None else metric.merge(previous, state)
        except Exception as exc:  # noqa: BLE001 - reported and skipped on every rank
            observer.errors[metric.name] = f"{type(exc).__name__}: {exc}"


def _site(observer: "TokenObserver", full: str, path: str, q: torch.Tensor, shard_dim: int | None,
          key_split: str | None) -> Site:
    if q.dim() != 4:
        raise ValueError(f"attn_qk at {path}: queries must be [batch, heads, tokens, head_dim]; got {tuple(q.shape)}")
    if shard_dim not in (None, 1):
        raise ValueError(f"attn_qk at {path}: shard_dim must be 1 (heads split on tp) or None; got {shard_dim}")
    topology = observer.topology
    tp = topology.axes.get("tp")
    split = shard_dim is not None and tp is not None and tp.size > 1
    heads = int(q.shape[1]) * (tp.size if split and tp is not None else 1)
    known = (full, KIND, heads, shard_dim, path, key_split)
    site = observer.known.sites.get(known)
    if site is None:
        placements: list[tuple[str, Placement]] = []
        for axis in topology.names:
            if topology.axes[axis].size == 1 or axis == key_split:
                continue
            if axis in topology.population_axes:
                placements.append((axis, Shard(None)))
            elif axis == "tp" and split:
                placements.append((axis, Shard(0)))
        meta: tuple[tuple[str, object], ...] = (("module", path),)
        if key_split is not None:
            meta += (("key_split", key_split),)
        site = observer.known.sites[known] = Site(
            name=full, kind=KIND, logical_shape=(heads,), dtype=str(q.dtype).replace("torch.", ""),
            placements=tuple(placements), layer=observer.index.layer_of(path),
            family=observer.index.family_of(path), meta=meta)
    observer.sites[site.key] = site
    return site
