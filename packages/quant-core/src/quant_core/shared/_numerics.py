"""Reference numerics shared by every format (docs/design.md, 'Numerics'), in plain torch.

These are the spec in code: the C++ and Triton kernels reproduce them bit for bit.
"""

from __future__ import annotations

import struct

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
E2M1_MAX = 6.0

# [Note: FP8 NaN] Every NaN encodes to 0x7F (a NaN in both E4M3 and E5M2), whatever its sign:
# torch's own conversions do not keep a NaN's sign reliably (its scalar fp16 -> fp32 path turns
# -NaN into +NaN), so a signed NaN code could not be reproduced bit for bit across backends.
# For the same reason dequantized outputs carry the canonical NaN of their dtype.
FP8_NAN_CODE = 0x7F


def divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator as one correctly rounded fp32 division.

    torch evaluates `python_float / tensor` as reciprocal(tensor) * python_float, two roundings
    that differ from IEEE division in the last bit (448 / 3: 0x4315 5556 vs 0x4315 5555). The
    numerator is filled on the denominator's device (`new_tensor` would copy it from the host: a
    sync, and refused while a CUDA graph is captured).
    """
    return torch.full_like(denominator, numerator) / denominator


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN and +-Inf replaced by 0, the input of every amax."""
    magnitude = x.float().abs()
    return torch.where(torch.isfinite(magnitude), magnitude, 0.0)


def encode_fp8(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(v): clamp to +-fmax (so +-Inf saturates), round to nearest even; NaN -> 0x7F."""
    fmax = torch.finfo(fp8_dtype).max
    codes = v.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
    return torch.where(torch.isnan(v), FP8_NAN_CODE, codes).view(fp8_dtype)


# [Note: FP8 stochastic rounding] fp32 v is rounded to one of its FP8 neighbours lo <= |v| < hi
# (the format's grid: steps 2^(e - mantissa bits) in v's binade e, 2^-9 (E4M3) or 2^-16 (E5M2)
# among subnormals) with a uniform 16-bit integer r: the magnitude goes up iff r < (|v| - lo) /
# (hi - lo) * 2^16, so up with the distance from lo to within 2^-16 of a step. |v|, lo and the
# step make every quantity exact in fp32: q = |v| / step (a power of two) is below 2^(mantissa
# bits + 1), lo / step = trunc(q), the fraction q - trunc(q). |v| at or above fmax (+-Inf
# included) saturates to fmax, as rounding to nearest does; the sign is put back as the bit (-0
# stays -0); NaN -> 0x7F ([Note: FP8 NaN]).
def encode_fp8_stochastic(v: torch.Tensor, fp8_dtype: torch.dtype, random16: torch.Tensor) -> torch.Tensor:
    """fp8(v) rounded stochastically ([Note: FP8 stochastic rounding]); `random16` int64 of v's shape, below 2^16."""
    e4m3 = fp8_dtype == torch.float8_e4m3fn
    min_normal_field, mantissa_bits = (121, 3) if e4m3 else (113, 2)  # 2^-6, 2^-14
    a = v.abs().clamp(max=torch.finfo(fp8_dtype).max)
    step_field = torch.clamp(a.view(torch.int32) >> 23, min=min_normal_field) - mantissa_bits
    step = (step_field << 23).view(torch.float32)
    q = a * ((254 - step_field) << 23).view(torch.float32)  # a / step, exactly
    lower = torch.trunc(q)
    up = (random16.float() < (q - lower) * 65536.0).float()
    magnitude = ((lower + up) * step).view(torch.int32)
    signed = (magnitude | (v.view(torch.int32) & torch.iinfo(torch.int32).min)).view(torch.float32)
    return encode_fp8(torch.where(torch.isnan(v), v, signed), fp8_dtype)


# Inputs a fused kernel reads exactly ([Note: kernels Inductor fuses] in quant_core._library): fp32,
# which Inductor computes in anyway, and bf16, re-rounded by `bf16_rounded`; an fp16 input keeps
# quant-core's kernels (its elided rounding is not redone).
FUSABLE_INPUT_DTYPES = (torch.float32, torch.bfloat16)


def bf16_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as fp32; a bf16 x rounded to bf16 again in integer arithmetic on its fp32 bits (nearest
    even; NaNs kept as they are, since a NaN's carry could reach the sign bit). On a bf16 tensor
    this changes nothing, except under torch.compile: Inductor elides the rounding of a bf16
    intermediate between the ops it fuses, so a fused consumer may see the producer's unrounded
    fp32 value, but it keeps integer ops ([Note: kernels Inductor fuses] in quant_core._library)."""
    values = x.float()
    if x.dtype != torch.bfloat16:
        return values
    bits = values.view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).view(torch.float32)
    return torch.where(torch.isnan(values), values, rounded)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32, exactly, for int32 exponents in [-127, 127] (2^-127 is subnormal)."""
    exponent = exponent.to(torch.int32)
    bits = torch.where(exponent > -127, (exponent + 127) << 23, 0x00400000)
    return bits.view(torch.float32)


def max_exponent_within(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The largest integer s with amax * 2^s <= fmax, exactly, for fp32 amax > 0 (int32).

    With amax = m * 2^p (m in [1, 2)) and fmax = f * 2^q (f in [1, 2)): s = q - p if m <= f,
    else q - p - 1. Read off the fp32 bits, so no rounded division decides a boundary case.
    Subnormal amax gives a large s; callers clamp it to what their scale format can hold.
    """
    fmax_bits = struct.unpack("<i", struct.pack("<f", fmax))[0]
    q, f_mantissa = (fmax_bits >> 23) - 127, fmax_bits & 0x7FFFFF
    bits = amax.float().view(torch.int32)
    exponent_field, mantissa = bits >> 23, bits & 0x7FFFFF
    # A subnormal amax (exponent field 0) is m * 2^-126 with m < 1: normalise it to get p.
    normalised = (amax.float() * 2.0**64).view(torch.int32)
    p = torch.where(exponent_field > 0, exponent_field - 127, (normalised >> 23) - 127 - 64)
    m = torch.where(exponent_field > 0, mantissa, normalised & 0x7FFFFF)
    return (q - p - (m > f_mantissa).to(torch.int32)).to(torch.int32)


def to_output_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds fp32 `values` to `dtype` (nearest even), with the dtype's canonical NaN (see Note)."""
    out = values.to(dtype)
    if dtype == torch.float32:
        return torch.where(torch.isnan(out), float("nan"), out)
    return torch.where(torch.isnan(out), torch.tensor(float("nan"), dtype=dtype), out)


# ---- E2M1 (NVFP4 elements) ----------------------------------------------------------------------

# The 8 magnitudes of E2M1, indexed by the 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, one per element) of fp32 v: nearest even, saturating at 6, NaN -> 0.

    The magnitude code counts the rounding thresholds below |v|. A tie goes to the even code, so
    thresholds whose lower neighbour has an even code count only when exceeded (>) and those whose
    lower neighbour is odd count when reached (>=).
    """
    a = v.abs()
    code = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    negative = torch.signbit(v) & ~torch.isnan(v)
    return (code | (negative.to(torch.uint8) << 3)).to(torch.uint8)


def encode_e2m1_stochastic(v: torch.Tensor, random24: torch.Tensor) -> torch.Tensor:
    """E2M1 codes with stochastic rounding: up with probability equal to the distance from below.

    `random24` holds one uniform 24-bit integer per element. Between neighbours lo < |v| < hi
    (steps 0.5, 1 and 2 are powers of two, so the fraction is exact), the magnitude rounds up iff
    random24 < (|v| - lo) / (hi - lo) * 2^24. Saturates at 6; NaN -> 0.
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    lower = torch.floor(a / step) * step  # exact: step is a power of two
    fraction = (a - lower) / step
    rounded = lower + torch.where(random24.float() < fraction * 2.0**24, step, 0.0)
    rounded = torch.where(torch.isnan(a), 0.0, torch.clamp(rounded, max=E2M1_MAX))
    return encode_e2m1(torch.where(torch.signbit(v) & ~torch.isnan(v), -rounded, rounded))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) 4-bit codes -> (R, C/2) bytes; the even element goes in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) bytes -> (R, C) 4-bit codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


# ---- counter-based random numbers -------------------------------------------------------------

# [Note: counter RNG] Stochastic rounding and Hadamard signs draw element `index` of the SplitMix64
# stream started at `seed` (state seed + (index + 1) * golden, then the SplitMix64 finalizer): a
# pure function of (seed, element index), so every backend and every shard draws the same bits.
# uint64 arithmetic is done on int64 tensors, whose multiplication wraps modulo 2^64; right
# shifts are made logical by masking. A seed is a Python int (any of its 64 low bits) or, for
# stochastic rounding, a 0-d int64 tensor holding the uint64 bits: callers keep their per-step
# counter as a tensor, which neither syncs the host nor specializes a torch.compile graph.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def signed64(value: int) -> int:
    """The int64 holding the low 64 bits of `value` (what an int64 tensor or schema int can carry)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seed_tensor(seed: int | torch.Tensor) -> torch.Tensor:
    """A seed as the 0-d int64 tensor the stochastic-rounding kernels read ([Note: counter RNG])."""
    if not isinstance(seed, torch.Tensor):
        return torch.tensor(signed64(int(seed)), dtype=torch.int64)
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(
            f"seed must be an int or a 0-d int64 tensor, got a {seed.dtype} tensor of shape {tuple(seed.shape)} "
            "(keep the counter as torch.zeros((), dtype=torch.int64) and add to it in place)"
        )
    return seed


def splitmix64(seed: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Output `index` of the SplitMix64 stream seeded with `seed`, as int64 holding the uint64 bits."""
    seed = seed.to(index.device) if isinstance(seed, torch.Tensor) else signed64(seed)
    x = (index.to(torch.int64) + 1) * signed64(_GOLDEN) + seed
    x = (x ^ _logical_shift_right(x, 30)) * signed64(_MIX1)
    x = (x ^ _logical_shift_right(x, 27)) * signed64(_MIX2)
    return x ^ _logical_shift_right(x, 31)


def random24(seed: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A uniform 24-bit integer per index: the top 24 bits of splitmix64(seed, index)."""
    return _logical_shift_right(splitmix64(seed, index), 40)


def random16(seed: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A uniform 16-bit integer per index (int64): the top 16 bits of splitmix64(seed, index)."""
    return _logical_shift_right(splitmix64(seed, index), 48)


# ---- bf16 stochastic rounding ---------------------------------------------------------------------

# [Note: bf16 stochastic rounding] fp32 v is rounded to bf16 by adding a uniform 16-bit integer r
# to its bit pattern and truncating: `bits = float_as_uint32(v) + r; bf16 = bits >> 16`. A bf16
# value (low 16 bits zero) stays as it is; any other v rounds its magnitude up (away from zero)
# with probability low16(v) / 2^16 and down otherwise, so the result's mean is v: the fp32 values
# between bf16 neighbours lo < hi are lo + k * (hi - lo) / 2^16 with k = low16(v). The edges are
# what the rule gives: +-0 keep their sign; fp32 subnormals round the same way among bf16
# subnormals (no flush to zero); +-Inf stay +-Inf (low bits zero); a finite v beyond the largest
# finite bf16 (0x7F7F0000, ~3.39e38) rounds to +-Inf with probability low16(v) / 2^16 (the carry
# reaches the exponent, never the sign: 0x7F7FFFFF + 0xFFFF < 0x80000000). NaN is the one exception
# to the rule (which could carry it into the sign or truncate it to Inf): every NaN becomes the
# canonical bf16 NaN 0x7FC0, as round-to-nearest conversions give ([Note: FP8 NaN]).
BF16_CANONICAL_NAN = 0x7FC0


def round_to_bfloat16_stochastic(v: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 `v` rounded stochastically with one uniform 16-bit integer per element
    ([Note: bf16 stochastic rounding]); `random16` int64 of v's shape."""
    bits = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + random16) >> 16  # below 2^16 for every non-NaN v: no carry into bit 32
    rounded = torch.where(torch.isnan(v), BF16_CANONICAL_NAN, rounded)
    return torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16).view(torch.bfloat16)
