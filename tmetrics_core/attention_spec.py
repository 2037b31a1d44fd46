"""What an attention observation needs besides its queries and keys: score function and mask.

``tm.observe(module, "attn", (q, k), kind="attn_qk", attention=AttentionSpec(...))`` hands a
layer's queries and keys to the attention metrics; this record says how their scores are formed
and which keys each query sees, without materialising a ``[T x T]`` mask where the structure is
known (causal, sliding window, padding, packed sequences). Vocabulary: imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["AttentionSpec"]


@dataclass(frozen=True, eq=False, slots=True)
class AttentionSpec:
    """How scores are formed from ``q [B, Hq, Tq, D]`` and ``k [B, Hkv, Tk, D]`` (``Hq`` a
    multiple of ``Hkv``: grouped-query attention), and which keys each query sees.

    The pre-softmax score of query ``i`` and key ``j`` is ``x = scale * q_i . k_j``, then
    ``softcap * tanh(x / softcap)`` with a soft cap (Gemma 2), plus ``mask`` when that is an
    additive float mask (as ``scaled_dot_product_attention`` adds it).

    Attributes:
        scale: score scale; ``None``: ``D ** -0.5`` (SDPA's default).
        causal: key ``j`` is visible from query ``i`` only when ``pos_j <= pos_i``.
        window: sliding window: only keys with ``pos_i - pos_j < window`` (Mistral's and
            Hugging Face's ``sliding_window``); ``None``: no window.
        softcap: logit soft cap; ``None``: none.
        token_mask: bool or 0/1 ``[B, T]`` over global positions, True for real tokens:
            padded keys are invisible, padded queries are not counted.
        segment_ids: int ``[B, T]`` over global positions: packed sequences; a query sees only
            keys of its own segment, and each segment has its own first token (sink).
        mask: an explicit ``[B or 1, Hq or 1, Tq, Tk]`` mask as SDPA takes it (bool, True =
            attend; or float, added to the scores) instead of the structure above; its sink
            key is each query's first visible key.
        q_positions, k_positions: int64 ``[Tq]``, ``[Tk]``: global positions of the local
            queries and keys (a rank holding a slice of the sequence); ``None``: ``0..T-1``.
        key_split: the axis (``"cp"``) over whose ranks the keys are split while every rank
            holds the same queries: the per-query softmax parts are merged across it exactly.

    Raises:
        ConfigError: a window below 1, a soft cap not above 0, or an explicit mask together
            with structural mask fields or a key split.
    """

    scale: float | None = None
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    token_mask: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    k_positions: torch.Tensor | None = None
    key_split: str | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ConfigError(f"AttentionSpec.window: got {self.window}; need >= 1 (keys within the window) or None")
        if self.softcap is not None and not self.softcap > 0:
            raise ConfigError(f"AttentionSpec.softcap: got {self.softcap}; need > 0 or None")
        if self.mask is not None and (self.causal or self.window is not None or self.token_mask is not None
                                      or self.segment_ids is not None or self.key_split is not None):
            raise ConfigError(
                "AttentionSpec: an explicit mask replaces causal, window, token_mask and segment_ids, and cannot "
                "be split by keys across ranks; pass either the mask or the structure (the structure costs no "
                "[T x T] tensor)")
