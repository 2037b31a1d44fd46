"""Low-precision formats and recipes: hand-derived values on adversarial inputs (±0, the
smallest subnormals, the largest value ± one ulp, ties, inf, NaN, all-zero blocks, padded tails,
one outlier per block), and bit-for-bit equality with torch's float8 casts and torchao's
MX / NVFP4 / float8 casts."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.quant.formats import FORMATS, e8m0_exponent, format_named, pow2, round_to
from tmetrics_core.metrics.quant.recipes import recipe_named
from tmetrics_core.metrics.quant.statistics import MAX_FIELDS, SUM_FIELDS, quant_rows

E4M3, E5M2, E2M1 = FORMATS["e4m3"], FORMATS["e5m2"], FORMATS["e2m1"]
NAN, INF = math.nan, math.inf


def _round(fmt, values):
    q, overflow = round_to(fmt, torch.tensor(values, dtype=torch.float64))
    return q.tolist(), overflow.tolist()


@pytest.mark.parametrize("fmt, cases", [
    # (input, value, overflow): ulp in [256, 512) is 32 for e4m3, so 464 is a tie to the even 448
    (E4M3, [(0.0, 0.0, False), (2.0 ** -9, 2.0 ** -9, False), (2.0 ** -10, 0.0, False),
            (3 * 2.0 ** -10, 2.0 ** -8, False), (1.25 * 2.0 ** -10, 2.0 ** -9, False), (416.0, 416.0, False),
            (448.0, 448.0, False), (464.0, 448.0, False), (464.0001, 448.0, True), (480.0, 448.0, True),
            (INF, 448.0, True), (-INF, -448.0, True), (-1e30, -448.0, True), (100.0, 96.0, False)]),
    # e5m2: 61440 is the tie between 57344 (odd mantissa) and 65536: rounds up, overflows
    (E5M2, [(2.0 ** -16, 2.0 ** -16, False), (2.0 ** -17, 0.0, False), (57344.0, 57344.0, False),
            (61439.0, 57344.0, False), (61440.0, 57344.0, True), (INF, 57344.0, True)]),
    # e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6}: 5 ties to 4; 7 ties to 8, beyond 6
    (E2M1, [(0.25, 0.0, False), (0.26, 0.5, False), (0.75, 1.0, False), (2.5, 2.0, False), (5.0, 4.0, False),
            (6.0, 6.0, False), (6.99, 6.0, False), (7.0, 6.0, True), (-7.0, -6.0, True)]),
])
def test_round_to_golden(fmt, cases):
    values, overflow = _round(fmt, [c[0] for c in cases])
    assert values == [c[1] for c in cases]
    assert overflow == [c[2] for c in cases]


def test_signed_zero_and_nan_kept():
    q, overflow = round_to(E4M3, torch.tensor([-0.0, 0.0, -(2.0 ** -11), NAN]))
    assert torch.signbit(q[:3]).tolist() == [True, False, True]  # -2**-11 underflows to -0
    assert q[:3].tolist() == [0.0, 0.0, 0.0] and math.isnan(q[3]) and not overflow.any()


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_to_equals_torch_cast_bit_for_bit(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    every_bf16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for x in (bits.view(torch.float32), every_bf16, torch.linspace(-7e4, 7e4, 100_001)):
        want = x.to(fmt.torch_dtype).to(torch.float64)
        want = torch.where(torch.isinf(want), torch.copysign(torch.tensor(fmt.max, dtype=torch.float64), want), want)
        got, _ = round_to(fmt, x)
        assert torch.equal(got.view(torch.int64), want.view(torch.int64)) or (
            torch.equal(got.isnan(), want.isnan())
            and torch.equal(got[~got.isnan()].view(torch.int64), want[~want.isnan()].view(torch.int64)))


def test_pow2_is_exact():
    e = torch.tensor([-1022, -149, -127, 0, 1, 127, 1023])
    assert pow2(e).tolist() == [2.0 ** int(v) for v in e]


def test_e8m0_modes_golden():
    amax = torch.tensor([1.0, 1.5, 0.0, 1e-39, NAN, 448.0, 3.0e38])
    floor, clamped = e8m0_exponent(amax, E4M3, "floor")
    # floor(log2 a) - 8 + 127; 0 and fp32 subnormals clamp to -127 (biased 0); NaN is 255
    assert floor.tolist() == [119, 119, 0, 0, 255, 127, 127 + 127 - 8]
    assert clamped.tolist() == [False, False, True, True, False, False, False]
    ceil, _ = e8m0_exponent(amax, E4M3, "ceil")
    assert ceil.tolist()[:2] == [119, 120]
    even, _ = e8m0_exponent(torch.tensor([1.9375, 1.875]), E4M3, "even")  # 1.9375 rounds up to 2 at 3 bits
    assert even.tolist() == [120, 119]
    rceil, _ = e8m0_exponent(torch.tensor([448.0, 449.0, INF]), E4M3, "rceil")
    assert rceil.tolist() == [127, 128, 254]


def _stats(recipe, x, amax=None):
    sums, maxes = quant_rows(recipe, [x], amax)
    return dict(zip(SUM_FIELDS, sums[0].tolist())) | dict(zip(MAX_FIELDS, maxes[0].tolist()))


def test_tensorwise_golden_counts():
    # amax 448: scale 1, so the elements are cast as they are
    x = torch.tensor([448.0, -0.0, 0.0, 2.0 ** -9, 2.0 ** -10, -(2.0 ** -11), 100.0])
    s = _stats(recipe_named("fp8-tensorwise", "param"), x)
    assert (s["elements"], s["nonzero"], s["underflow"], s["overflow"], s["nonfinite"]) == (7, 5, 2, 0, 0)
    assert s["err_sumsq"] == 16.0 + 2.0 ** -20 + 2.0 ** -22
    assert s["amax"] == 448.0 and -s["neg_min_nonzero"] == 2.0 ** -11
    assert (s["blocks"], s["log2_scale_sum"], s["blocks_at_limit"]) == (1, 0.0, 0)
    # gradients cast to e5m2: 100 is exact there, 2**-10 too (e5m2 keeps down to 2**-16) at scale 57344/448
    g = _stats(recipe_named("fp8-tensorwise", "grad"), x)
    assert g["underflow"] == 0


def test_tensorwise_nan_and_inf_poison_the_scale():
    x = torch.tensor([1.0, NAN, 2.0])
    s = _stats(recipe_named("fp8-tensorwise", "param"), x)
    assert s["nonfinite"] == 3 and s["blocks"] == 0  # a NaN amax: every element decodes to NaN
    y = torch.tensor([1.0, INF, 2.0])
    s = _stats(recipe_named("fp8-tensorwise", "param"), y)
    # scale 448/inf = 0: every element casts to 0 and decodes as 0 / 0, NaN (as torchao's round trip)
    assert math.isinf(s["amax"]) and s["nonfinite"] == 3 and s["underflow"] == 0


def test_mxfp8_blocks_padding_zero_block_and_outliers():
    # 2 rows x 40: blocks [0:32], [32:40]+24 padding per row; row 1's first block all zero
    x = torch.zeros(2, 40)
    x[0, 0] = 1.0                        # outlier of block 0: scale 2**(0 - 8)
    x[0, 1] = 2.0 ** -17                 # scaled 2**-9: e4m3's smallest subnormal, kept
    x[0, 2] = 2.0 ** -18                 # scaled 2**-10: ties to 0, an underflow
    x[0, 32] = 448.0                     # block 1 (tail): scale 2**0, 448 exact
    x[0, 33] = 464.0 * 2.0 ** -8 * 256   # = 464 at scale 1: ties to 448
    x[1, 35] = 1e-39                     # tail block of row 1: fp32 subnormal amax, scale clamped
    s = _stats(recipe_named("mxfp8", "activation"), x)
    assert s["elements"] == 80 and s["nonzero"] == 6
    assert s["underflow"] == 1 and s["overflow"] == 0  # 2**-18
    assert s["blocks"] == 3 and s["blocks_at_limit"] == 1  # the all-zero block has no scale
    assert s["scale_max"] == 1.0 and -s["neg_scale_min"] == 2.0 ** -127
    assert s["log2_scale_sum"] == -8 + 0 - 127
    # torchao encodes a clamped block with 2**-126 and decodes it with 2**-127: 1e-39 comes back halved
    tiny = torch.tensor(1e-39).double().item()
    q, _ = round_to(E4M3, torch.tensor([1e-39]) / torch.tensor([2.0 ** -126]))
    assert s["err_sumsq"] == (2.0 ** -18) ** 2 + 16.0 ** 2 + (tiny - q.item() * 2.0 ** -127) ** 2


def test_fp8_block_weight_tiles_and_rowwise_pow2():
    w = torch.zeros(130, 130)
    w[0, 0], w[129, 129], w[5, 129] = 448.0, 2.0, 7.0
    s = _stats(recipe_named("fp8-block", "param"), w)   # 128x128 tiles: 4, one all zero
    assert (s["elements"], s["blocks"]) == (130 * 130, 3)
    r = recipe_named("fp8-rowwise", "activation")
    b = r.quantise(torch.tensor([[3.0, 1.0], [448.0, 1.0]]))
    # 448/3 = 149.33 rounds down to 128; 448/448 = 1
    assert b.decode.tolist() == [1 / 128, 1.0] and b.q[0].tolist() == [384.0, 128.0]


def test_nvfp4_two_level_scales_golden():
    # tensor amax 2688 = 448 * 6: tensor scale 1; block 0 amax 6 (block scale 1), block 1 amax 2688
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, 5.0, 0.25    # 5 ties to 4; 0.25 ties to 0
    x[0, 16], x[0, 17] = 2688.0, 448.0            # block scale 448: 448 -> 1.0
    b = recipe_named("nvfp4", "activation").quantise(x)
    assert b.decode.tolist() == [1.0, 448.0]
    assert b.q[0, :3].tolist() == [6.0, 4.0, 0.0] and b.q[1, :2].tolist() == [6.0, 1.0]
    w = recipe_named("nvfp4", "param")
    assert w.block == (16, 16)


def test_against_torchao_casts():
    import torchao.prototype.mx_formats.mx_tensor as mx
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=g) * torch.logspace(-35, 25, 128)
    x[1, 3], x[2, :32], x[3, 40], x[4, :32] = NAN, 0.0, INF, 1e-40
    for fmt in ("e4m3", "e5m2"):
        for mode in ("floor", "ceil", "even", "rceil"):
            scale, data = mx.to_mx(x, FORMATS[fmt].torch_dtype, 32, getattr(ScaleCalculationMode, mode.upper()))
            b = recipe_named("mxfp8", "activation", format=fmt, scale_mode=mode).quantise(x)
            want = data.to(torch.float64).reshape(-1, 32)
            assert torch.equal(b.q.nan_to_num(7.0), want.nan_to_num(7.0)), (fmt, mode)
            assert torch.equal(b.decode.nan_to_num(-1.0), mx.get_fp_scale(scale).double().reshape(-1).nan_to_num(-1.0))
    y = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    amax = y.float().abs().amax()
    scales, packed = nvfp4_quantize(y, 16, per_tensor_amax_to_scale(amax))
    b = recipe_named("nvfp4", "activation").quantise(y, amax)
    assert torch.equal(b.q, f4_unpacked_to_f32(unpack_uint4(packed)).double().reshape(-1, 16))
    assert torch.equal(b.decode, scales.double().reshape(-1) * per_tensor_amax_to_scale(amax).double())
    for name, pow2_scales in (("fp8-tensorwise", False), ("fp8-rowwise", True)):
        z = torch.randn(8, 48, generator=g) * 3e-3
        amax = z.abs().amax(-1, keepdim=True) if pow2_scales else z.abs().amax()
        want = to_fp8_saturated(z * amax_to_scale(amax, torch.float8_e4m3fn, pow2_scales), torch.float8_e4m3fn)
        b = recipe_named(name, "activation").quantise(z)
        assert torch.equal(b.q.reshape(8, 48), want.double()), name


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="did you mean 'mxfp8'"):
        recipe_named("mxfp9", "param")
    with pytest.raises(ConfigError, match="did you mean 'e4m3'"):
        recipe_named("fp8-tensorwise", "param", format="e4m4")
    with pytest.raises(ConfigError, match="mxfp8.*only"):
        recipe_named("fp8-rowwise", "param", scale_mode="rceil")
    with pytest.raises(ConfigError, match="did you mean 'rceil'"):
        recipe_named("mxfp8", "param", scale_mode="rceli")
    with pytest.raises(ConfigError, match="e2m1 only"):
        recipe_named("nvfp4", "param", format="e4m3")
    with pytest.raises(ConfigError, match="did you mean 'e5m2'"):
        format_named("e5m3")
