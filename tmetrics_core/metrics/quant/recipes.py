"""Low-precision training recipes: how a tensor is cut into scale blocks, scaled and cast.

A :class:`Recipe` quantises a tensor viewed as ``[rows, cols]`` (``cols``: the last dim; the
other dims flattened into rows; a 0-d or 1-d tensor is one row). Each *scale block* of
``block_rows x block_cols`` elements gets one scale from its absolute maximum (``amax``); its
elements are multiplied by the encode scale, saturated and rounded to the element format
(:func:`~tmetrics_core.metrics.quant.formats.round_to`), and decode as ``q * d`` with ``d`` the
block's decode scale (``scale_inv`` in TransformerEngine's words).

======================  =====================================  ===============================
recipe                  scale blocks                           scale
======================  =====================================  ===============================
``fp8-tensorwise``      the whole tensor                       fp32 ``fmax / amax`` (torchao)
``fp8-rowwise``         each row (1 x cols)                    fp32 ``fmax / amax`` rounded down
                                                               to a power of two (torchao)
``fp8-block``           1 x 128; 128 x 128 for weights         fp32 ``fmax / amax`` (DeepSeek-V3)
``mxfp8``               1 x 32                                 E8M0, torchao's ``floor`` default
``nvfp4``               1 x 16; 16 x 16 for weights (TE)       E4M3 block scale x fp32 tensor
                                                               scale ``amax / (448 * 6)``
======================  =====================================  ===============================

fp32 scales use torchao's ``amax_to_scale`` arithmetic (the quotient in float64, then float32;
``amax`` floored at 1e-12). FP8 recipes cast to E4M3, except ``fp8-tensorwise`` on gradients,
which casts to E5M2 (the classic FP8 recipe); ``format`` overrides both. A last dim that is not
a multiple of the block's width is padded with zeros to the next multiple (as TransformerEngine
pads MXFP8 and NVFP4 inputs); padding never changes a block's ``amax`` and is never counted.
Inputs are read as float32 (bf16 and fp16 exactly; a float64 tensor is rounded to float32 first,
as the recipes' casts do).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.quant.formats import (
    E8M0_BIAS,
    FORMATS,
    SCALE_MODES,
    Format,
    e8m0_exponent,
    pow2,
    round_to,
)

__all__ = ["AMAX_EPS", "RECIPES", "Blocks", "Recipe", "recipe_named"]

AMAX_EPS = 1e-12
"""Floor of ``amax`` in fp32 scales (torchao's ``EPS``): an all-zero block hits it."""

_E4M3 = FORMATS["e4m3"]
_E4M3_TINY = 2.0 ** -6
"""torchao's ``E4M3_EPS``: NVFP4 block scales are clamped to ``[2**-6, 448]`` before their cast."""

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")
"""Recipe names, as the ``recipe:`` option takes them."""


@dataclass(frozen=True, slots=True)
class Blocks:
    """One tensor group's quantisation, blocks as rows: ``x`` float32 ``[blocks, width]`` (the
    elements, zero-padded), ``valid`` bool of the same shape or None (no padding), ``amax``
    float32 ``[blocks]`` (each block's own, NaN where it holds one), ``q`` float64
    (the element-format values), ``overflow`` bool, ``dq`` float64 (``q`` times the block's
    decode scale), ``decode`` float64 ``[blocks]`` and ``clamped`` bool ``[blocks]`` (the scale
    hit its format's limit)."""

    x: torch.Tensor
    valid: torch.Tensor | None
    amax: torch.Tensor
    q: torch.Tensor
    overflow: torch.Tensor
    dq: torch.Tensor
    decode: torch.Tensor
    clamped: torch.Tensor


@dataclass(frozen=True, slots=True)
class Recipe:
    """A recipe applied to one source kind.

    Attributes:
        name: one of :data:`RECIPES`.
        element: the element format.
        block: ``(rows, cols)`` of a scale block; ``0`` means the whole extent of that dim.
        scale_mode: MX only: one of :data:`~tmetrics_core.metrics.quant.formats.SCALE_MODES`.
    """

    name: str
    element: Format
    block: tuple[int, int]
    scale_mode: str = "floor"

    @property
    def tensor_amax(self) -> bool:
        """Whether the scale needs the amax of the whole tensor (over every shard) before any
        element is cast: tensorwise scaling and NVFP4's fp32 tensor scale."""
        return self.name in ("fp8-tensorwise", "nvfp4")

    def shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The block ``(rows, cols)`` for a ``[rows, cols]`` tensor."""
        br, bc = self.block
        return (br or max(rows, 1), bc or max(cols, 1))

    def quantise(self, x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> Blocks:
        """Quantise ``x`` (any shape) as a ``[rows, cols]`` tensor; ``tensor_amax`` (a 0-d or
        1-element tensor) replaces the local amax where :attr:`tensor_amax` (the amax over every
        shard). Blocks are returned in row-major block order."""
        rows, cols = _matrix_shape(x)
        blocks, valid = block_rows(self, x.detach().reshape(rows, cols).to(torch.float32))
        amax = None if tensor_amax is None else tensor_amax.reshape(1).to(torch.float32).expand(blocks.shape[0])
        return self.quantise_blocks(blocks, valid, amax)

    def quantise_blocks(self, x: torch.Tensor, valid: torch.Tensor | None,
                        tensor_amax: torch.Tensor | None) -> Blocks:
        """Quantise blocks given as rows ``x`` (float32 ``[blocks, width]``, zero-padded);
        ``tensor_amax`` float32 ``[blocks]``: each block's tensor amax (required for NVFP4 and
        for tensorwise scales over several shards; else the block amax is used)."""
        own = amax = x.abs().amax(1) if x.shape[1] else x.new_zeros(x.shape[0])
        if self.name in ("fp8-tensorwise", "fp8-rowwise", "fp8-block"):
            if self.name == "fp8-tensorwise" and tensor_amax is not None:
                amax = tensor_amax
            scale = (self.element.max / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
            if self.name == "fp8-rowwise":
                scale = torch.exp2(torch.floor(torch.log2(scale)))
            clamped = amax < AMAX_EPS
            q, overflow = round_to(self.element, x.to(torch.float32) * scale.unsqueeze(1))
            decode = 1.0 / scale.to(torch.float64)
        elif self.name == "mxfp8":
            biased, clamped = e8m0_exponent(amax, self.element, self.scale_mode)
            decode = pow2(biased - E8M0_BIAS)
            decode = torch.where(biased == 255, torch.nan, decode)
            if self.scale_mode == "rceil":
                rcp = pow2(E8M0_BIAS - biased).to(torch.float32)
                rcp = torch.where(biased == 254, 2.0 ** -127, torch.where(biased == 0, 1.0, rcp))
                rcp = torch.where(biased == 255, torch.nan, rcp)
                y = x * rcp.unsqueeze(1)
            else:
                encode = torch.clamp(torch.where(biased == 255, torch.inf, decode).to(torch.float32),
                                     min=torch.finfo(torch.float32).tiny)
                y = x / encode.unsqueeze(1)
            q, overflow = round_to(self.element, y)
        else:  # nvfp4
            if tensor_amax is None:
                tensor_amax = amax.amax().expand(amax.shape[0])
            per_tensor = tensor_amax.to(torch.float32) / (_E4M3.max * self.element.max)
            scaled = (amax / self.element.max) / per_tensor
            clamped = (scaled < _E4M3_TINY) | (scaled > _E4M3.max)
            block_scale, _ = round_to(_E4M3, torch.clamp(scaled, min=_E4M3_TINY, max=_E4M3.max))
            block_scale = block_scale.to(torch.float32)
            reciprocal = (1.0 / per_tensor) / block_scale
            q, overflow = round_to(self.element, x * reciprocal.unsqueeze(1))
            decode = block_scale.to(torch.float64) * per_tensor.to(torch.float64)
        dq = q * decode.unsqueeze(1)
        return Blocks(x, valid, own, q, overflow, dq, decode, clamped & ~torch.isnan(amax))


def _matrix_shape(x: torch.Tensor) -> tuple[int, int]:
    """``(rows, cols)`` of ``x`` viewed as a matrix over its last dim."""
    if x.dim() == 0:
        return (1, 1)
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0, cols)


def block_rows(recipe: Recipe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[rows, cols]`` float32 ``x`` cut into ``recipe``'s blocks, one block per row
    (``[blocks, block_rows * block_cols]``, blocks in row-major order), zero-padded to whole
    blocks; and the mask of real elements (None when nothing was padded)."""
    rows, cols = x.shape
    br, bc = recipe.shape(rows, cols)
    pr, pc = -rows % br, -cols % bc
    valid = None
    if pr or pc:
        valid = torch.nn.functional.pad(torch.ones_like(x, dtype=torch.bool), (0, pc, 0, pr))
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    nbr, nbc = x.shape[0] // br, x.shape[1] // bc
    if br == 1:
        out = x.reshape(nbr * nbc, bc)
        return out, None if valid is None else valid.reshape(nbr * nbc, bc)
    out = x.reshape(nbr, br, nbc, bc).permute(0, 2, 1, 3).reshape(nbr * nbc, br * bc)
    if valid is not None:
        valid = valid.reshape(nbr, br, nbc, bc).permute(0, 2, 1, 3).reshape(nbr * nbc, br * bc)
    return out, valid


_WEIGHT_KINDS = frozenset({"param"})
"""Source kinds read as weights (2-D blocks in ``fp8-block`` and ``nvfp4``)."""

_GRADIENT_KINDS = frozenset({"grad", "activation_grad"})
"""Source kinds read as gradients (E5M2 in ``fp8-tensorwise``)."""


def recipe_named(name: str, kind: str, *, format: str | None = None, scale_mode: str | None = None) -> Recipe:
    """The recipe ``name`` as applied to tensors of source ``kind``.

    Args:
        name: one of :data:`RECIPES`.
        kind: the site kind (``param`` reads weights; ``grad`` and ``activation_grad`` gradients;
            any other kind activations).
        format: FP8 recipes only: ``e4m3`` or ``e5m2`` instead of the recipe's default.
        scale_mode: ``mxfp8`` only: one of :data:`~tmetrics_core.metrics.quant.formats.SCALE_MODES`.

    Raises:
        ConfigError: an unknown recipe, format or scale mode (with the nearest name), a format
            the recipe cannot take, or a scale mode on a recipe without E8M0 scales.
    """
    if name not in RECIPES:
        close = difflib.get_close_matches(str(name), RECIPES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown low-precision recipe {name!r}{hint} (valid: {', '.join(RECIPES)})", path="recipe")
    weight = kind in _WEIGHT_KINDS
    if name == "nvfp4":
        if format not in (None, "e2m1"):
            raise ConfigError(f"recipe 'nvfp4' casts to e2m1 only; got format {format!r}: drop format: or pick an FP8 "
                              "recipe", path="format")
        element = FORMATS["e2m1"]
    else:
        if format is not None and format not in ("e4m3", "e5m2"):
            close = difflib.get_close_matches(str(format), ["e4m3", "e5m2"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"recipe {name!r} casts to e4m3 or e5m2; got format {format!r}{hint}", path="format")
        default = "e5m2" if name == "fp8-tensorwise" and kind in _GRADIENT_KINDS else "e4m3"
        element = FORMATS[format or default]
    if scale_mode is not None and name != "mxfp8":
        raise ConfigError(f"scale_mode applies to mxfp8 (E8M0 scales) only; recipe {name!r} takes none: drop "
                          "scale_mode:", path="scale_mode")
    mode = scale_mode or "floor"
    if mode not in SCALE_MODES:
        close = difflib.get_close_matches(str(mode), SCALE_MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown MX scale mode {mode!r}{hint} (valid: {', '.join(SCALE_MODES)})", path="scale_mode")
    block = {"fp8-tensorwise": (0, 0), "fp8-rowwise": (1, 0), "fp8-block": (128, 128) if weight else (1, 128),
             "mxfp8": (1, 32), "nvfp4": (16, 16) if weight else (1, 16)}[name]
    return Recipe(name, element, block, mode)
