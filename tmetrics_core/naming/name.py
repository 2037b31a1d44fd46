"""``CanonicalName``: the canonical name of one stored tensor or of one logical slice of it,
and how that slice is read from the stored tensor (:meth:`CanonicalName.view`); the names
themselves are made by :mod:`tmetrics_core.naming.canonical`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CanonicalName"]


@dataclass(frozen=True, slots=True)
class CanonicalName:
    """The canonical name of one stored tensor, or of one logical slice of it.

    - ``name``: the canonical name, e.g. ``"layers.3.attn.q.weight"``.
    - ``original``: the name ``named_parameters()`` gave, wrappers included.
    - ``layer``: global layer index (pipeline offset applied), None outside blocks.
    - ``expert``: global expert index (expert-parallel offset applied), None when the tensor
      is not one expert's (a stacked tensor of all experts has None).
    - ``component``: the module path without layer, expert and leaf: ``"attn.q"``,
      ``"moe.experts.up"``, ``"embed"``; for unknown names their module path.
    - ``family``: ``name`` with layer and expert indices replaced by ``*``:
      ``"layers.*.moe.experts.*.up.weight"``; it groups the same tensor across layers.
    - ``part``: for a slice of a fused tensor, the index of its part in storage order
      (Hugging Face ``gate_up_proj``: 0 gate, 1 up); None otherwise.
    - ``transposed``: the weight is stored ``[in, out]`` (GPT-2 ``Conv1D``); ``view``
      returns the logical ``[out, in]`` orientation.
    - ``expert_dim``: the dim of the stored tensor that indexes experts (torchtitan and
      transformers 5.x stack all experts of a layer into one tensor: dim 0), else None.
    - ``region``: for a slice, ``(dim, start, stop)`` ranges of the stored tensor that hold
      it, in the coordinates of the tensor passed in (global ones for a DTensor); empty for
      a whole tensor.
    - ``groups``: ``(dim, length)`` when the slice is read from the stored tensor with dim
      ``dim`` unflattened into ``[groups, length]`` first (torchtitan's fused ``wqkv``: one
      group of rows per key/value head); ``region`` is then in the unflattened coordinates
      and the slice keeps the group dim. None otherwise.
    - ``tied``: original names of parameters sharing this tensor, dropped from the list.
    - ``layout``: the layout that named it, None for unknown names.
    """

    name: str
    original: str
    layer: int | None
    expert: int | None
    component: str
    family: str
    part: int | None = None
    transposed: bool = False
    expert_dim: int | None = None
    region: tuple[tuple[int, int, int], ...] = ()
    groups: tuple[int, int] | None = None
    tied: tuple[str, ...] = ()
    layout: str | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The logical tensor this entry names, as a view of the stored ``tensor`` (no copy).

        Unflattens ``groups``, narrows to ``region``, drops the expert dim of an expert slice, and transposes the last
        two dims when ``transposed``. ``tensor`` must be the stored tensor this entry was made
        from (same shape); a 1-D weight is returned as is.
        """
        out = tensor
        if self.groups is not None:
            out = out.unflatten(self.groups[0], (-1, self.groups[1]))
        for dim, start, stop in self.region:
            out = out.narrow(dim, start, stop - start)
        if self.region and self.expert is not None and self.expert_dim is not None:
            out = out.squeeze(self.expert_dim)
        if self.transposed and out.dim() >= 2:
            out = out.transpose(-2, -1)
        return out
