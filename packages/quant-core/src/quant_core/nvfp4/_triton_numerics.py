"""NVFP4's numerics in the Triton kernels (`_triton_quantize`, `_triton_dequantize`): the tensor
scale S, block scales, E2M1 codes in and out, and the counter RNG's draws of the register-blocks
quantize ([Note: counter RNG]). Numerics every format shares are in `shared._triton_numerics`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quant_core.fp8._triton_scale import scale_of
from quant_core.shared._triton_numerics import decode_fp8, encode_fp8


@triton.jit
def tensor_scale(amax_ptr):
    """S = `nvfp4_tensor_scale` of the fp32 amax at amax_ptr: 448 * 6 / amax (1 unless amax > 0),
    clamped to the largest fp32; each program computes it rather than the caller (no launches)."""
    S, _ = scale_of(tl.load(amax_ptr), 2688.0, 1.0, False)
    return S


@triton.jit
def _nvfp4_scale(amax, S, HARDWARE: tl.constexpr):
    """(enc, s) of blocks: s = e4m3(amax / 6 * S) as a uint8 code, enc = S / fp32(s) (0 where s is 0)."""
    s = encode_fp8(tl.div_rn(amax, 6.0) * S, True, HARDWARE)
    s_f32 = decode_fp8(s, True, HARDWARE)
    enc = tl.where(s_f32 > 0, tl.minimum(tl.div_rn(S, s_f32), 3.4028234663852886e38), 0.0)
    return enc, s


@triton.jit
def _sign_bits(v):
    """The top four bits of fp32 v (the sign as bit 3), NaN read as +inf (IEEE minNum)."""
    return tl.minimum(v, float("inf")).to(tl.int32, bitcast=True) >> 28


@triton.jit
def _encode_scaled(v, sign_mask):
    """E2M1 codes (int32) of fp32 v = x * enc, exactly `encode_e2m1`'s, with the sign kept where
    `sign_mask` is 8 (0 where the block's s is 0: its codes are all 0).

    [Note: E2M1 by magic addition] a + 2^22 rounds a = |v| to a multiple of 0.5 (the spacing of
    fp32 in [2^22, 2^23)), to nearest even, in one IEEE addition, so the low bits of the sum count
    halves: codes 0-4 for a < 2. Likewise + 2^23 counts units for 2 <= a < 4 (codes 2 + count) and
    + 2^24 counts twos above (codes 4 + count). a is clamped to 6 first (saturation), so the magic
    number is 2^(22 + a's exponent), at least 2^22, and 2 * (its exponent field - 149) is the code
    offset. Ties go to the even count, which is the even code, as `encode_e2m1`'s thresholds
    (> 0.25, >= 0.75, ...) do. IEEE maxNum/minNum drop a NaN: max(|v|, 0) is 0 and min(v, inf) is
    +inf, so NaN encodes as 0; -0 keeps its sign (code 0x8).
    """
    a = tl.minimum(tl.maximum(tl.abs(v), 0.0), 6.0)
    magic = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + (22 << 23), 0x4A800000)
    code = (a + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic - 298 + (magic >> 22)
    return code | (_sign_bits(v) & sign_mask)


@triton.jit
def _encode_stochastic(v, random24, sign_mask):
    """`encode_e2m1_stochastic(v, random24)` with `_encode_scaled`'s sign mask, in fewer steps: with
    the step 0.5, 1 or 2 of |v|'s range, |v| / step is exact, its floor counts the steps of the
    lower neighbour (code = count + 0, 2 or 4) and the fraction above decides the rounding up."""
    a = tl.minimum(tl.maximum(tl.abs(v), 0.0), 8.0)  # NaN -> 0; from 6 up every draw saturates
    small = a < 2.0
    middle = a < 4.0
    steps = a * tl.where(small, 2.0, tl.where(middle, 1.0, 0.5))
    lower = tl.floor(steps)
    # random24 < fraction * 2^24, compared as integers (random24 < ceil(...)): no 64-bit conversion.
    up = (random24 < tl.math.ceil((steps - lower) * 16777216.0).to(tl.int32)).to(tl.int32)
    code = tl.minimum(lower.to(tl.int32) + tl.where(small, 0, tl.where(middle, 2, 4)) + up, 7)
    return code | (_sign_bits(v) & sign_mask)


@triton.jit
def _rng_state(first_index, index_step, seed):
    """splitmix64's first state (i + 1) * golden + seed of i = first_index + index_step, summed
    from the broadcast operands' products (one per row, one per column)."""
    golden: tl.constexpr = 0x9E3779B97F4A7C15
    return ((first_index + 1).to(tl.uint64) * golden + seed) + index_step.to(tl.uint64) * golden


@triton.jit
def _random24(state):
    """The top 24 bits of splitmix64 from its first state ([Note: counter RNG]); the final
    xor-shift by 31 leaves bits 40-63 as they are, so it is skipped."""
    z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return (z >> 40).to(tl.int32)


@triton.jit
def _codes(x, enc, rng_state, STOCHASTIC: tl.constexpr):
    """int32 E2M1 codes of x * enc, 0 where enc is 0 (the block's s is 0)."""
    sign_mask = tl.where(enc > 0, 8, 0)
    if STOCHASTIC:
        codes = _encode_stochastic(x * enc, _random24(rng_state), sign_mask)
    else:
        codes = _encode_scaled(x * enc, sign_mask)
    return codes


@triton.jit
def _decode_e2m1(codes):
    """fp32 values of 4-bit E2M1 codes: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (exact)."""
    exponent = (codes >> 1) & 0x3
    mantissa = (codes & 0x1).to(tl.float32)
    step = tl.where(exponent == 1, 0.5, tl.where(exponent == 2, 1.0, 2.0))  # 2^(exponent - 2)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * step)
    # Times -1 rather than `-magnitude`: Triton 3.6 negates floats as 0 - x, which turns -0 into +0.
    return tl.where((codes & 0x8) != 0, magnitude * -1.0, magnitude)


@triton.jit
def _decode_nibbles(codes):
    """fp32 values of the E2M1 codes in the low nibbles of int32 `codes`: the magnitude bits m
    shifted to bit 22 read as fp32 are the value times 2^-126 (m = 1: the subnormal 2^-127;
    m >= 2: (1 + (m & 1) / 2) * 2^(m // 2 - 127)), so one exact product with 2^126 decodes them."""
    bits = ((codes & 0x7) << 22) | ((codes & 0x8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _block_factor(stored, amax_ptr, TENSOR_SCALE: tl.constexpr, HARDWARE: tl.constexpr):
    """fp32(s) / S for E4M3 block-scale bytes `stored`, or fp32(s) alone without TENSOR_SCALE."""
    s = decode_fp8(stored, True, HARDWARE)
    if TENSOR_SCALE:
        s = tl.div_rn(s, tensor_scale(amax_ptr))
    return s
