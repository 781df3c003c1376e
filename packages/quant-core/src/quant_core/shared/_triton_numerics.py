"""The numerics of docs/design.md, 'Numerics', in Triton: the element encodings, scale rules and RNG every CUDA kernel shares.

Each function mirrors its plain-torch reference in `_numerics.py` (and the C++ in csrc/common.h)
bit for bit; kernels that call them launch with `enable_fp_fusion=False` and divide with
`tl.div_rn` ([Note: exact Triton arithmetic] in `_triton.py`).

[Note: Triton FP8 casts] On the GPU, fp32 -> FP8 uses the hardware conversion
(`cvt.rn.satfinite.{e4m3,e5m2}x2.f32`: round to nearest even, +-Inf and overflow saturate to +-max,
which is the references' clamp-then-round), with NaN remapped to 0x7F; FP8 -> fp32 uses the exact hardware
upcast. Triton's CPU interpreter mis-rounds FP8 casts, so under TRITON_INTERPRET=1 the same
functions compute the codes with integer arithmetic on the fp32 bits instead (the mirror of
csrc/common.h's `encode_fp8`). `tests/test_triton_fp8.py` checks on the GPU that both paths give
the same code for every one of the 2^32 fp32 bit patterns.

Host helpers: the launch options, the seed tensor, the tile choices (`Tiles`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Whether kernels use the hardware FP8 conversions ([Note: Triton FP8 casts]).
HARDWARE_FP8 = os.environ.get("TRITON_INTERPRET", "0") != "1"
# Launch options of every bit-exact kernel ([Note: exact Triton arithmetic]).
EXACT = {"enable_fp_fusion": False}

# A constexpr, so that Inductor's copy of a kernel's source carries it along.
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


def seed_tensor(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The counter RNG's seed as a 0-d int64 tensor holding its uint64 bits (kernels load it)."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    seed &= (1 << 64) - 1
    return torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64, device=device)


# ---- FP8 ------------------------------------------------------------------------------------------


@triton.jit
def encode_fp8(v, E4M3: tl.constexpr, HARDWARE: tl.constexpr):
    """uint8 codes of fp32 v: clamp to +-max, round to nearest even, NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    raw_magnitude = bits & 0x7FFFFFFF
    if HARDWARE:
        if E4M3:
            codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            codes = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        # csrc/common.h encode_fp8, with the subnormal results rounded in integers too.
        max_bits: tl.constexpr = 0x43E00000 if E4M3 else 0x47600000  # 448, 57344
        min_normal_bits: tl.constexpr = 0x3C800000 if E4M3 else 0x38800000  # 2^-6, 2^-14
        shift: tl.constexpr = 20 if E4M3 else 21  # 23 - mantissa bits
        rebias: tl.constexpr = (120 << 3) if E4M3 else (112 << 2)  # (127 - bias) << mantissa bits
        # Exponent field of the subnormal step (2^-9, 2^-16) plus 23.
        subnormal_base: tl.constexpr = 141 if E4M3 else 134
        magnitude = tl.minimum(raw_magnitude, max_bits)
        normal = ((magnitude + ((1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)) >> shift) - rebias
        # A subnormal result is significand * 2^(exponent - 150) / step: shift the 24-bit
        # significand right by subnormal_base - exponent (>= 21), rounding to nearest even; shifts
        # of 25 or more give 0 (clamped to 31 to stay defined).
        exponent = magnitude >> 23
        significand = (magnitude & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
        right = tl.minimum(tl.maximum(subnormal_base - exponent, 1), 31)
        half_minus_one = (1 << (right - 1)) - 1
        subnormal = (significand + half_minus_one + ((significand >> right) & 1)) >> right
        sign = (bits >> 24) & 0x80
        codes = sign | tl.where(magnitude >= min_normal_bits, normal, subnormal)
    return tl.where(raw_magnitude > 0x7F800000, 0x7F, codes).to(tl.uint8)


@triton.jit
def decode_fp8(codes, E4M3: tl.constexpr, HARDWARE: tl.constexpr):
    """Exact fp32 values of uint8 FP8 codes (NaN codes give a NaN)."""
    if HARDWARE:
        if E4M3:
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        c = codes.to(tl.int32)
        sign = (c & 0x80) << 24
        if E4M3:
            exponent = (c >> 3) & 0xF
            mantissa = c & 0x7
            normal = ((exponent + 120) << 23) | (mantissa << 20)
            subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9
            nan = (exponent == 0xF) & (mantissa == 0x7)
            magnitude = tl.where(exponent == 0, subnormal, normal)
        else:
            exponent = (c >> 2) & 0x1F
            mantissa = c & 0x3
            normal = ((exponent + 112) << 23) | (mantissa << 21)
            subnormal = (mantissa.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # m * 2^-16
            nan = (exponent == 0x1F) & (mantissa != 0)
            magnitude = tl.where(exponent == 0, subnormal, tl.where(exponent == 0x1F, 0x7F800000, normal))
        magnitude = tl.where(nan, 0x7FC00000, magnitude)
        values = (sign | magnitude).to(tl.float32, bitcast=True)
    return values


@triton.jit
def encode_fp8_stochastic(v, random16, E4M3: tl.constexpr, HARDWARE: tl.constexpr):
    """uint8 codes of fp32 v rounded stochastically ([Note: FP8 stochastic rounding]; random16:
    int32 below 2^16); csrc's mirror. The rounded value is on the FP8 grid, so either encode path
    gives its code exactly."""
    fmax: tl.constexpr = 448.0 if E4M3 else 57344.0
    min_normal_field: tl.constexpr = 121 if E4M3 else 113  # 2^-6, 2^-14
    mantissa_bits: tl.constexpr = 3 if E4M3 else 2
    a = tl.where(tl.abs(v) < fmax, tl.abs(v), fmax)  # NaN becomes fmax here and 0x7F at the end
    step_field = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, min_normal_field) - mantissa_bits
    q = a * ((254 - step_field) << 23).to(tl.float32, bitcast=True)  # a / step, exactly
    lower = q.to(tl.int32).to(tl.float32)
    up = tl.where(random16.to(tl.float32) < (q - lower) * 65536.0, 1.0, 0.0)
    magnitude = ((lower + up) * (step_field << 23).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    # The sign goes on as the bit (a float negation would turn -0 into +0, see encode_e2m1_stochastic).
    signed = (magnitude | ((v.to(tl.int32, bitcast=True) >> 31) << 31)).to(tl.float32, bitcast=True)
    return encode_fp8(tl.where(v != v, v, signed), E4M3, HARDWARE)


# ---- shared arithmetic ------------------------------------------------------------------------------


@triton.jit
def finite_abs(x):
    """|x| in fp32 with NaN and +-Inf replaced by 0 (the input of every amax)."""
    magnitude = tl.abs(x.to(tl.float32))
    return tl.where(magnitude < float("inf"), magnitude, 0.0)


@triton.jit
def max_exponent_within(amax, FMAX_EXPONENT: tl.constexpr, FMAX_MANTISSA: tl.constexpr):
    """The largest integer s with amax * 2^s <= fmax (fmax = 1.m * 2^e given by its fields), from the bits."""
    bits = amax.to(tl.int32, bitcast=True)
    field = bits >> 23
    normalised = (amax * 18446744073709551616.0).to(tl.int32, bitcast=True)  # * 2^64, exact
    p = tl.where(field > 0, field - 127, (normalised >> 23) - 191)
    m = tl.where(field > 0, bits & 0x7FFFFF, normalised & 0x7FFFFF)
    return FMAX_EXPONENT - p - (m > FMAX_MANTISSA).to(tl.int32)


@triton.jit
def power_of_two(exponent):
    """2^exponent as fp32, exactly, for int32 exponents in [-127, 127]."""
    return tl.where(exponent > -127, (exponent + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def store_values(out_ptr, offsets, values, mask):
    """Stores fp32 values into an fp32/bf16/fp16 output, rounded to nearest even, NaN as the
    dtype's canonical NaN ([Note: FP8 NaN]); the bits are computed, then stored bitcast."""
    nan = values != values
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    if out_dtype == tl.float32:
        bits = tl.where(nan, 0x7FC00000, values.to(tl.int32, bitcast=True))
    elif out_dtype == tl.bfloat16:
        # Round to nearest even on the bits (exact, and what the interpreter gets right too).
        u = values.to(tl.int32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        bits = tl.where(nan, 0x7FC0, rounded).to(tl.int16)
    else:
        rounded = values.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(nan, 0x7E00, rounded).to(tl.int16)
    tl.store(out_ptr + offsets, bits.to(out_dtype, bitcast=True), mask=mask)


@triton.jit
def as_bytes(values):
    """The raw bytes (uint8) of one-byte values (FP8 codes or scales, as loaded)."""
    return values.to(tl.uint8, bitcast=True)


@triton.jit
def store_bytes(ptr, offsets, codes, mask):
    """Stores uint8 codes into a one-byte output of any dtype (FP8 data or scales, uint8), bitcast."""
    tl.store(ptr + offsets, codes.to(ptr.dtype.element_ty, bitcast=True), mask=mask)


# ---- E2M1 (NVFP4 elements) and the counter RNG -------------------------------------------------------


@triton.jit
def encode_e2m1(v):
    """4-bit E2M1 codes (int32) of fp32 v: nearest even, saturating at 6, NaN -> 0."""
    a = tl.abs(v)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    negative = (v.to(tl.int32, bitcast=True) < 0) & (v == v)
    return code | tl.where(negative, 8, 0)


@triton.jit
def encode_e2m1_stochastic(v, random24):
    """E2M1 codes with stochastic rounding (random24: uniform integers below 2^24); csrc's mirror."""
    a = tl.abs(v)
    a = tl.where(a < 8.0, a, 8.0)  # |v| >= 6 saturates whatever the draw; NaN becomes 8, then 0
    small = a < 2.0
    middle = a < 4.0
    step = tl.where(small, 0.5, tl.where(middle, 1.0, 2.0))
    inverse_step = tl.where(small, 2.0, tl.where(middle, 1.0, 0.5))
    lower = (a * inverse_step).to(tl.int32).to(tl.float32) * step
    fraction = (a - lower) * inverse_step
    rounded = lower + tl.where(random24.to(tl.float32) < fraction * 16777216.0, step, 0.0)
    rounded = tl.where(v != v, 0.0, tl.minimum(rounded, 6.0))
    # The sign goes on as the code's bit: `-rounded` would lose -0 (Triton 3.6 lowers a float
    # negation to 0 - x, which gives +0), and a rounded-to-zero negative value encodes as 0x8.
    negative = (v.to(tl.int32, bitcast=True) < 0) & (v == v)
    return encode_e2m1(rounded) | tl.where(negative, 8, 0)


def int32_halves(value: int) -> tuple[int, int]:
    """A 64-bit seed (an int in int64 range) as two int32 kernel arguments (high, low). Inductor's
    launcher of a traced kernel types an int argument from the value it compiled with and refuses
    int64 values there; every launcher passes int32 values."""
    low = value & 0xFFFFFFFF
    return value >> 32, low - (1 << 32) if low >= 1 << 31 else low


@triton.jit
def from_int32_halves(high, low):
    """The uint64 whose halves `int32_halves` gave (int32 arguments, or constants under Inductor)."""
    return ((tl.cast(high, tl.int64) << 32) | (tl.cast(low, tl.int64) & 0xFFFFFFFF)).to(tl.uint64, bitcast=True)


@triton.jit
def splitmix64(seed, index):
    """Output `index` (uint64) of the SplitMix64 stream seeded with `seed` ([Note: counter RNG])."""
    z = (index + 1) * 0x9E3779B97F4A7C15 + seed
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def round_to_bfloat16_stochastic(v, random16):
    """bf16 of fp32 v rounded stochastically ([Note: bf16 stochastic rounding]; random16: uint32
    below 2^16), made from the bits: no conversion instruction (the GPU's would give NaN as 0x7FFF),
    integer arithmetic only (exact in the interpreter too)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + random16) >> 16  # no carry past bit 31 for a non-NaN v
    rounded = tl.where(v != v, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@dataclass(frozen=True)
class Tiles:
    """Tile shape and warps of a launch; each kernel module holds its tuned choices as constants."""

    tile_m: int
    """Rows of x (or of the data) per program."""
    tile_k: int
    """Columns per program."""
    num_warps: int
    """Warps per program."""
