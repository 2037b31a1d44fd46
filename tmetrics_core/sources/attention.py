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

Inner-attention modules of known frameworks (torchtitan's SDPA wrapper) are observed with no user
code by a forward pre-hook (:func:`install_inner_attention`); their classes are declared as data
(:data:`INNER_ATTENTION`), no framework is imported.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tmetrics_core.attention_spec import AttentionSpec
from tmetrics_core.errors import ConfigError
from tmetrics_core.observe import watched
from tmetrics_core.metrics.attention_heads import KIND, AttentionObservation
from tmetrics_core.placements import Placement, Shard
from tmetrics_core.site import Site
from tmetrics_core.sources.hook_context import HookContext
from tmetrics_core.sources.token_step import TokenStep
from tmetrics_core import torch_private

__all__ = ["INNER_ATTENTION", "install_inner_attention", "observe_attention"]


@torch.no_grad()
def observe_attention(observer: TokenStep, module: torch.nn.Module, name: str, q: torch.Tensor,
                      k: torch.Tensor, spec: AttentionSpec | None, shard_dim: int | None) -> None:
    """Prepare the due attention metrics of one observed attention call (see the module
    docstring); a metric that raises is recorded in ``observer.errors``, never raised."""
    if torch_private.in_backward():
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
    for metric, _ in observer.readers(site, path):
        if metric.name not in observer.errors:
            observer.prepare(metric, site, observation, memo)


def _site(observer: TokenStep, full: str, path: str, q: torch.Tensor, shard_dim: int | None,
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


INNER_ATTENTION = {("torchtitan", "ScaledDotProductAttention"): "sdpa", ("torchtitan", "FlexAttention"): "refused",
                   ("torchtitan", "VarlenAttention"): "refused"}
"""``(top package, class name)`` of inner-attention modules found with no user code: ``sdpa`` ones
take ``(q [B, L, Hq, D], k [B, L, Hkv, D], v, *, scale=None, is_causal=True)`` and hold no other
mask (torchtitan's ``ScaledDotProductAttention``); ``refused`` ones apply masks tmetrics cannot
read from their arguments (block masks, packed lengths)."""


def install_inner_attention(hooks: HookContext) -> list[Any]:
    """Forward pre-hooks on the recognised inner-attention modules of the measured model handing
    their queries and keys to ``hooks.record_attention`` on due steps (``attn_qk``'s second
    installer), heads split over ``tp`` where ``tp`` has more than one rank (torchtitan's tensor
    parallelism). Returns the handles.

    Raises:
        ConfigError: a recognised module whose masks cannot be read (torchtitan's FlexAttention
            and VarlenAttention): never a table with some layers missing.
    """
    tp = hooks.topology.axes.get("tp")
    record, heads_split = hooks.record_attention, tp is not None and tp.size > 1
    handles = []
    for path, module in hooks.model.named_modules():
        cls = type(module)
        how = INNER_ATTENTION.get((cls.__module__.partition(".")[0], cls.__name__))
        if how == "refused":
            raise ConfigError(
                f"the attention metrics cannot read the mask of {cls.__module__}.{cls.__name__} at {path!r} (block "
                "masks or packed lengths). Use its SDPA inner attention, or call tm.observe(self, 'qk', (q, k), "
                "kind='attn_qk', attention=tm.AttentionSpec(causal=True, segment_ids=...)) in the attention's "
                "forward, with q and k after RoPE")
        if how == "sdpa":
            handles.append(module.register_forward_pre_hook(_sdpa_hook(record, heads_split), with_kwargs=True))
    return handles


def _sdpa_hook(record: Callable[..., None], heads_split: bool) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not watched("attn_qk"):
            return
        q, k = args[0], args[1]
        spec = AttentionSpec(scale=kwargs.get("scale"), causal=bool(kwargs.get("is_causal", True)))
        record(module, "qk", q.transpose(1, 2), k.transpose(1, 2), spec=spec, shard_dim=1 if heads_split else None)
    return hook
