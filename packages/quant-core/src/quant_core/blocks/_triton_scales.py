"""The block scales of the FP8 block-format quantize kernels (`_triton_quantize`,
`_triton_two_pass`): per scale rule, the multiplier a block is encoded with and the scale stored
for it, and the stores of those scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quant_core.shared._triton_numerics import max_exponent_within, power_of_two, store_bytes

# Scale rules (constexpr SCALE_RULE): MXFP8's E8M0, blockwise power-of-two, blockwise fmax / amax.
_MXFP8, _POWER_OF_TWO, _FMAX_OVER_AMAX = 0, 1, 2


@triton.jit
def _block_scale(amax, SCALE_RULE: tl.constexpr, E4M3: tl.constexpr):
    """(multiplier applied before encoding, stored dequantization scale) of blocks with this amax."""
    if SCALE_RULE == 0:
        # MXFP8: e = smallest integer with amax <= 448 * 2^e, in [-127, 127]; stored e + 127.
        exponent = tl.minimum(tl.maximum(-max_exponent_within(amax, 8, 0x600000), -127), 127)
        multiplier = power_of_two(-exponent)
        stored = (exponent + 127).to(tl.uint8)
    else:
        if SCALE_RULE == 1:
            fmax_exponent: tl.constexpr = 8 if E4M3 else 15  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
            exponent = tl.where(amax > 0, tl.minimum(max_exponent_within(amax, fmax_exponent, 0x600000), 127), 0)
            multiplier = power_of_two(exponent)
        else:
            fmax: tl.constexpr = 448.0 if E4M3 else 57344.0
            multiplier = tl.where(amax > 0, tl.minimum(tl.div_rn(fmax, amax), 3.4028234663852886e38), 1.0)
        stored = tl.div_rn(1.0, multiplier)
    return multiplier, stored


@triton.jit
def _power_of_two_scale(amax, SCALE_RULE: tl.constexpr, E4M3: tl.constexpr):
    """`_block_scale` of finite amax >= 0, the power-of-two rules read off amax's exponent field.

    With amax = 1.m * 2^(f - 127) and fmax = 1.75 * 2^F, both rules step at m = 0.75 (0x600000).
    MXFP8: e = f - 127 - 8 + (m > 0.75) clamped to >= -127, so the E8M0 byte is
    max(f - 8 + (m > 0.75), 0) and the multiplier 2^-e = 2^(127 - byte). Blockwise:
    s = 127 + F - f - (m > 0.75) limited to 127 (0 if amax is 0), scale_inv 2^-s exactly (what
    1 / 2^s rounds to: 2^-127 is the subnormal 0x00400000). A subnormal amax (f = 0) gives
    the clamped exponent either way, so no renormalisation is needed.
    """
    if SCALE_RULE == 2:
        multiplier, stored = _block_scale(amax, SCALE_RULE, E4M3)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        field = bits >> 23
        above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        if SCALE_RULE == 0:
            biased = tl.maximum(field - 8 + above, 0)
            multiplier = ((254 - biased) << 23).to(tl.float32, bitcast=True)
            stored = biased.to(tl.uint8)
        else:
            fmax_exponent: tl.constexpr = 8 if E4M3 else 15
            exponent = tl.where(amax > 0, tl.minimum(127 + fmax_exponent - field - above, 127), 0)
            multiplier = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
            stored = tl.where(exponent < 127, (127 - exponent) << 23, 0x00400000).to(tl.float32, bitcast=True)
    return multiplier, stored


@triton.jit
def _store_scales(ptr, offsets, stored, mask):
    """Stores block scales: fp32 scale_inv as they are, E8M0 bytes through store_bytes."""
    if ptr.dtype.element_ty == tl.float32:
        tl.store(ptr + offsets, stored, mask=mask)
    else:
        store_bytes(ptr, offsets, stored, mask)
