"""Low-precision element and scale formats, emulated with plain torch arithmetic.

Every format here is a sign-magnitude binary float with ``ebits`` exponent bits, ``mbits``
mantissa bits and exponent ``bias``. :func:`round_to` rounds to the nearest representable
value, ties to even, with subnormals below ``2**(1 - bias)``, exactly as the hardware casts and
``Tensor.to(torch.float8_e4m3fn)`` do. The arithmetic runs in float64 on the tensor's own device
(division and multiplication by powers of two are exact there, and ``torch.round`` rounds half
to even), so any device and any input dtype of at most 53 mantissa bits gives the same bits.

Saturation: a recipe clamps to ``±max`` before it casts (torchao does; TransformerEngine casts
with ``satfinite``), so a finite value beyond the range and an infinity both become ``±max``;
NaN stays NaN. :func:`round_to` reports which elements *overflowed*: those whose rounding
without saturation lands beyond ``max`` (an element just above ``max`` that rounds down to it
is not an overflow).

E8M0 scales (MX) are powers of two; :func:`e8m0_exponent` derives a block's biased exponent
from its absolute maximum in the four rounding modes of torchao's ``ScaleCalculationMode``.
"""

from __future__ import annotations

import math

import difflib
from dataclasses import dataclass

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["E8M0_BIAS", "FORMATS", "Format", "SCALE_MODES", "e8m0_exponent", "format_named", "pow2", "round_to"]


@dataclass(frozen=True, slots=True)
class Format:
    """A binary float format: ``ebits`` exponent bits, ``mbits`` mantissa bits, ``bias``;
    ``max`` is the largest finite value; ``inf`` whether it encodes infinities (``e4m3fn`` and
    ``e2m1`` do not). ``torch_dtype`` is torch's dtype of that format, where one exists."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    inf: bool
    torch_dtype: torch.dtype | None

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value, ``2**(1 - bias)``."""
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value, ``2**(1 - bias - mbits)``."""
        return 2.0 ** (1 - self.bias - self.mbits)

    @property
    def max_pow2(self) -> int:
        """``floor(log2(max))``: the exponent of the largest binade (8 for e4m3, 15 for e5m2, 2
        for e2m1), which MX scales target."""
        return math.floor(math.log2(self.max))  # host arithmetic: no tensor, no device read


FORMATS: dict[str, Format] = {
    "e4m3": Format("e4m3", 4, 3, 7, 448.0, False, torch.float8_e4m3fn),
    "e5m2": Format("e5m2", 5, 2, 15, 57344.0, True, torch.float8_e5m2),
    "e2m1": Format("e2m1", 2, 1, 1, 6.0, False, None),
}
"""Element formats by name: FP8 E4M3 (``float8_e4m3fn``, no infinity), FP8 E5M2 and FP4 E2M1."""

E8M0_BIAS = 127
"""Bias of the E8M0 scale format: biased exponent 127 is the scale 1; 255 encodes NaN."""

SCALE_MODES = ("floor", "ceil", "even", "rceil")
"""How an MX block's E8M0 exponent follows from its absolute maximum ``a`` (torchao's
``ScaleCalculationMode``; ``floor`` is torchao's default): ``floor``: ``floor(log2 a) - max_pow2``;
``ceil``: the same, plus one when ``a`` is not a power of two; ``even``: ``a`` rounded half up
to the element format's mantissa bits first; ``rceil``: ``ceil(log2(a / max))`` (cuBLAS and
TransformerEngine)."""


def format_named(name: str, *, path: str = "format") -> Format:
    """The element format ``name`` (``e4m3``, ``e5m2``, ``e2m1``).

    Raises:
        ConfigError: unknown name, with the nearest one and the valid set.
    """
    if name in FORMATS:
        return FORMATS[name]
    close = difflib.get_close_matches(str(name), list(FORMATS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown low-precision format {name!r}{hint} (valid: {', '.join(FORMATS)})", path=path)


def pow2(exponent: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``2.0 ** exponent`` exactly, for integer exponents in the normal range of ``dtype``
    (float64: ``[-1022, 1023]``; float32: ``[-126, 127]``): built from the bits (no ``pow`` or
    ``exp2``, whose last bit a device library may round)."""
    if dtype == torch.float32:
        return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def round_to(fmt: Format, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` rounded to ``fmt``, nearest and ties to even, saturated at ``±fmt.max``.

    Args:
        y: the scaled values, any floating dtype and shape.

    Returns:
        ``(q, overflow)``: ``q`` float64 of ``y``'s shape, every value representable in ``fmt``
        (``-0.0`` kept, NaN kept, ``±inf`` and finite overflow saturated to ``±max``);
        ``overflow`` bool, True where the unsaturated rounding exceeds ``max`` (``±inf`` included,
        NaN not).
    """
    # float32 arithmetic is exact here as float64 is for float64 input: ``a * 2**-ulp`` lies below
    # 2**(mbits + 1) and both scalings are by powers of two within float32's normal range.
    work = torch.float64 if y.dtype == torch.float64 else torch.float32
    a = y.to(work).abs()
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, m in [0.5, 1): floor(log2 a) = exponent - 1
    ulp_exp = torch.clamp(exponent - 1, min=1 - fmt.bias) - fmt.mbits
    magnitude = torch.round(a * pow2(-ulp_exp, work)) * pow2(ulp_exp, work)  # inf stays inf
    overflow = magnitude > fmt.max
    q = torch.copysign(torch.clamp(magnitude, max=fmt.max), y.to(work))
    return q.to(torch.float64), overflow


def e8m0_exponent(amax: torch.Tensor, element: Format, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The biased E8M0 exponent of blocks whose absolute maximum is ``amax``.

    Args:
        amax: float32 absolute maxima per block (NaN where the block holds one).
        element: the element format the block is cast to.
        mode: one of :data:`SCALE_MODES`.

    Returns:
        ``(biased, clamped)``: int32 biased exponents in ``[0, 255]`` (255: NaN) and a bool mask of
        blocks whose exponent was clamped to E8M0's range (the scale hit the format's limit).
    """
    a = amax.to(torch.float32)
    if mode == "rceil":
        descale = a / element.max  # float32, as torchao divides
        raw = torch.ceil(torch.log2(descale)).to(torch.float64)
        raw = torch.where(torch.isinf(descale), 127.0, raw)
        clamped = (raw < -E8M0_BIAS) | (raw > E8M0_BIAS)
        biased = torch.clamp(raw, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        biased = torch.where(torch.isinf(descale), 254.0, biased)
    else:
        bits = a.view(torch.int32)
        if mode == "even":
            half = 1 << (23 - element.mbits - 1)
            bits = (bits + half) & (0xFF << 23)
        elif mode not in ("floor", "ceil"):
            raise ConfigError(f"unknown MX scale mode {mode!r} (valid: {', '.join(SCALE_MODES)})", path="scale_mode")
        pow2 = ((bits >> 23) & 0xFF) - E8M0_BIAS
        if mode == "ceil":
            pow2 = pow2 + ((a.view(torch.int32) & 0x7FFFFF) > 0).to(torch.int32)
        raw = (pow2 - element.max_pow2).to(torch.float64)
        clamped = (raw < -E8M0_BIAS) | (raw > E8M0_BIAS + 1)
        biased = torch.clamp(raw, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    nan = torch.isnan(a)
    return torch.where(nan, 255.0, biased).to(torch.int32), clamped & ~nan
