// Shared pieces of quant-core's CPU kernels: element loads, FP8 encoding, threading.
//
// Legend for kernel argument names: M = rows of the 2-D view (product of the leading dims),
// K = last dim; `x_MK` is the input read through (stride_row, stride_col); `rowwise_MK` and
// `columnwise_KM` are contiguous outputs. Every pointer arrives from Python as an integer.
//
// [Note: exact numerics] These kernels must equal the plain-torch references bit for bit, so:
// no -ffast-math and no FMA contraction (CMakeLists sets -ffp-contract=off), every product is a
// single IEEE fp32 multiply rounded to nearest even, and FP8 rounding is done on the bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

// Element helpers are forced inline: an out-of-line copy (GCC's choice in large translation units)
// turns a vectorizable loop into a call per element.
#define QUANT_CORE_INLINE inline __attribute__((always_inline))
// A kernel's hot loop, out of line so that it is vectorized on its own; on x86-64 compiled for
// AVX-512, AVX2 and the baseline ISA, the best one picked when the library loads (GCC function
// multiversioning).
#if defined(__x86_64__)
#define QUANT_CORE_CLONES __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QUANT_CORE_CLONES __attribute__((noinline))
#endif
// A hot loop that does not vectorize (e.g. table lookups): one copy, out of line.
#define QUANT_CORE_SCALAR_LOOP __attribute__((noinline))

namespace quant_core {

// Input dtypes, numbered as quant_core._cpp passes them.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
// FP8 formats, numbered as quant_core._cpp passes them.
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

QUANT_CORE_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

QUANT_CORE_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

QUANT_CORE_INLINE float bfloat16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Exact fp16 -> fp32, written with selects rather than branches so loops over it vectorize.
QUANT_CORE_INLINE float float16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  const uint32_t normal = ((exponent + 112) << 23) | (mantissa << 13);
  const uint32_t inf_nan = 0x7F800000u | (mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
  const uint32_t subnormal = float_to_bits(float(int32_t(mantissa)) * 5.9604644775390625e-08f);
  const uint32_t magnitude = exponent == 0 ? subnormal : (exponent == 0x1F ? inf_nan : normal);
  return bits_to_float(sign | magnitude);
}

// Reads element `index` of an input of the given dtype as fp32 (exact for all three dtypes).
template <DType D>
QUANT_CORE_INLINE float load(const void* base, int64_t index) {
  if constexpr (D == DType::kFloat32) {
    return static_cast<const float*>(base)[index];
  } else if constexpr (D == DType::kBFloat16) {
    return bfloat16_to_float(static_cast<const uint16_t*>(base)[index]);
  } else {
    return float16_to_float(static_cast<const uint16_t*>(base)[index]);
  }
}

// [Note: magnitude keys] For amax, each dtype's |x| is compared as an integer in its own width:
// the bits of a non-negative float order like its value, so max over (bits & ~sign) is the max
// magnitude, and a key at or above the dtype's Inf pattern is non-finite. Integer max reductions
// vectorize (16-bit ones even on baseline SSE2), where a float max with NaN semantics does not.
template <DType D>
struct MagnitudeKey {
  // Signed: keys are below the sign bit, and SSE2 has a signed 16-bit max but no unsigned one.
  using Bits = std::conditional_t<D == DType::kFloat32, int32_t, int16_t>;
  using RawBits = std::conditional_t<D == DType::kFloat32, uint32_t, uint16_t>;
  static constexpr Bits kAbsMask = D == DType::kFloat32 ? Bits(0x7FFFFFFF) : Bits(0x7FFF);
  static constexpr Bits kInf = D == DType::kFloat32 ? Bits(0x7F800000)
                               : D == DType::kBFloat16 ? Bits(0x7F80)
                                                       : Bits(0x7C00);
  // The key of a finite magnitude, 0 for NaN and +-Inf.
  static QUANT_CORE_INLINE Bits of(RawBits raw) {
    const Bits magnitude = Bits(raw & RawBits(kAbsMask));
    return magnitude < kInf ? magnitude : Bits(0);
  }
  static float to_float(Bits key) {
    if constexpr (D == DType::kFloat32) {
      return bits_to_float(uint32_t(key));
    } else if constexpr (D == DType::kBFloat16) {
      return bfloat16_to_float(uint16_t(key));
    } else {
      return float16_to_float(uint16_t(key));
    }
  }
};

// The magnitude key of an fp32 value ([Note: magnitude keys]): max over keys is the amax over
// finite magnitudes (NaN and +-Inf count as 0), as an integer reduction that vectorizes.
QUANT_CORE_INLINE int32_t magnitude_key(float v) { return MagnitudeKey<DType::kFloat32>::of(float_to_bits(v)); }

// The largest magnitude key of rows x cols values, rows row_stride apart.
QUANT_CORE_INLINE int32_t max_key_of_rows(const float* __restrict values, int64_t row_stride, int64_t rows,
                                          int64_t cols) {
  int32_t key = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int32_t k = magnitude_key(values[i * row_stride + j]);
      key = k > key ? k : key;
    }
  }
  return key;
}

// Calls fn(DType-constant) for a runtime dtype code, so kernels are written once as templates.
template <class Fn>
inline void dispatch_dtype(int dtype, Fn&& fn) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: fn(std::integral_constant<DType, DType::kFloat32>{}); break;
    case DType::kBFloat16: fn(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: fn(std::integral_constant<DType, DType::kFloat16>{}); break;
  }
}

// fp8(v) of docs/design.md, 'Numerics': saturate to +-max (Inf included), NaN to the canonical 0x7F (the
// sign of a NaN is dropped: torch does not keep it reliably either), round to nearest even.
// Normal results round on the fp32 bits; subnormal results are rounded by the FPU itself: adding
// 2^14 (E4M3) or 2^7 (E5M2), whose ulp is exactly the format's subnormal step, rounds the sum to
// a multiple of that step with round-to-nearest-even. Both results are computed and one is
// selected, so loops over this function vectorize.
template <Fp8Format F>
QUANT_CORE_INLINE uint8_t encode_fp8(float v) {
  constexpr bool kE4M3 = F == Fp8Format::kE4M3;
  constexpr int32_t kMaxBits = kE4M3 ? 0x43E00000 : 0x47600000;        // 448, 57344
  constexpr int32_t kMinNormalBits = kE4M3 ? 0x3C800000 : 0x38800000;  // 2^-6, 2^-14
  constexpr int kShift = kE4M3 ? 20 : 21;                              // 23 - mantissa bits
  constexpr int32_t kRebias = kE4M3 ? (120 << 3) : (112 << 2);         // (127 - bias) << mantissa bits
  constexpr float kSubnormalMagic = kE4M3 ? 16384.0f : 128.0f;         // ulp = 2^-9, 2^-16
  constexpr int32_t kSubnormalMagicBits = kE4M3 ? 0x46800000 : 0x43000000;

  const uint32_t u = float_to_bits(v);
  const int32_t sign = int32_t((u >> 24) & 0x80);
  const int32_t raw_magnitude = int32_t(u & 0x7FFFFFFFu);
  const int32_t magnitude = std::min(raw_magnitude, kMaxBits);
  const int32_t normal =
      ((magnitude + ((1 << (kShift - 1)) - 1) + ((magnitude >> kShift) & 1)) >> kShift) - kRebias;
  const int32_t subnormal =
      int32_t(float_to_bits(bits_to_float(uint32_t(magnitude)) + kSubnormalMagic)) - kSubnormalMagicBits;
  const int32_t code = sign | (magnitude >= kMinNormalBits ? normal : subnormal);
  return uint8_t(raw_magnitude > 0x7F800000 ? 0x7F : code);
}

template <class Fn>
inline void dispatch_fp8_format(int format, Fn&& fn) {
  switch (static_cast<Fp8Format>(format)) {
    case Fp8Format::kE4M3: fn(std::integral_constant<Fp8Format, Fp8Format::kE4M3>{}); break;
    case Fp8Format::kE5M2: fn(std::integral_constant<Fp8Format, Fp8Format::kE5M2>{}); break;
  }
}

// Splits [0, n) into contiguous chunks of at least `grain` items, at most `num_threads` of them,
// and runs fn(chunk_index, begin, end) for each, the calling thread taking chunk 0. Called with
// the GIL released. Threads are started per call: every caller hands over >= ~64K elements per
// chunk, so the ~20 us start-up is noise next to the work.
template <class Fn>
inline void parallel_for(int64_t n, int64_t grain, int num_threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t max_chunks = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(num_threads, max_chunks));
  const int64_t per_chunk = (n + chunks - 1) / chunks;
  std::vector<std::thread> workers;
  workers.reserve(size_t(chunks - 1));
  for (int64_t chunk = 1; chunk < chunks; ++chunk) {
    const int64_t begin = chunk * per_chunk;
    const int64_t end = std::min(n, begin + per_chunk);
    if (begin < end) workers.emplace_back([&fn, chunk, begin, end] { fn(chunk, begin, end); });
  }
  fn(int64_t(0), int64_t(0), std::min(n, per_chunk));
  for (auto& worker : workers) worker.join();
}

// Elements per thread chunk below which extra threads cost more than they save.
constexpr int64_t kMinElementsPerThread = 1 << 16;

// Covers an R x C index space with tile_rows x tile_cols tiles (edge tiles partial), split across
// threads, and runs fn(r0, c0, h, w) for each tile: rows [r0, r0 + h), cols [c0, c0 + w).
template <class Fn>
inline void parallel_for_tiles(int64_t R, int64_t C, int64_t tile_rows, int64_t tile_cols, int num_threads, Fn&& fn) {
  const int64_t row_tiles = (R + tile_rows - 1) / tile_rows, col_tiles = (C + tile_cols - 1) / tile_cols;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / (tile_rows * tile_cols));
  parallel_for(row_tiles * col_tiles, grain, num_threads, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t / col_tiles) * tile_rows, c0 = (t % col_tiles) * tile_cols;
      fn(r0, c0, std::min(tile_rows, R - r0), std::min(tile_cols, C - c0));
    }
  });
}

}  // namespace quant_core

namespace quant_core {

// ---- more of docs/design.md, 'Numerics', shared by the block formats --------------------------

constexpr float kFloat32Max = 3.4028234663852886e+38f;

// docs/design.md, 'Numerics'; the mirror of _fp8_scale.fp8_scale_reference: scale = fmax / amax / 2^margin
// (1 unless amax > 0; a NaN amax gives 1), each division one IEEE fp32 division; clamped to the
// largest finite fp32 (NaN would pass, but none can arise); with power_2_scales only the exponent
// bits are kept. `divisor` is 2^margin, exact for margin in [-126, 127].
inline void scale_of(float amax, float fmax, float divisor, bool power_2_scales, float* scale, float* scale_inv) {
  const float quotient = (fmax / amax) / divisor;
  float s = amax > 0.0f ? quotient : 1.0f;
  s = s > kFloat32Max ? kFloat32Max : s;
  if (power_2_scales) s = bits_to_float(float_to_bits(s) & 0x7F800000u);
  *scale = s;
  *scale_inv = 1.0f / s;
}

// NVFP4's tensor scale S = 448 * 6 / amax (1 unless amax > 0), clamped: the mirror of
// _nvfp4.nvfp4_tensor_scale; the kernels compute it from the amax the caller passes.
inline float nvfp4_tensor_scale(float amax) {
  float scale, scale_inv;
  scale_of(amax, 448.0f * 6.0f, 1.0f, false, &scale, &scale_inv);
  return scale;
}

// The largest integer s with amax * 2^s <= fmax, exactly, from the fp32 bits (amax >= 0); the
// mirror of _numerics.max_exponent_within. A subnormal amax is normalised by an exact 2^64.
QUANT_CORE_INLINE int max_exponent_within(float amax, float fmax) {
  const uint32_t fmax_bits = float_to_bits(fmax);
  const int q = int(fmax_bits >> 23) - 127;
  const uint32_t fmax_mantissa = fmax_bits & 0x7FFFFFu;
  uint32_t bits = float_to_bits(amax);
  int p = int(bits >> 23) - 127;
  if ((bits >> 23) == 0) {
    bits = float_to_bits(amax * 18446744073709551616.0f);
    p = int(bits >> 23) - 127 - 64;
  }
  return q - p - ((bits & 0x7FFFFFu) > fmax_mantissa ? 1 : 0);
}

// 2^e as fp32, exactly, for e in [-127, 127] (2^-127 is subnormal).
QUANT_CORE_INLINE float power_of_two(int e) { return bits_to_float(e > -127 ? uint32_t(e + 127) << 23 : 0x00400000u); }

// fp32 value of an FP8 code, from its bits with selects (loops over it vectorize; a table lookup
// does not): a normal code is the fp32 with the code's exponent rebiased and its mantissa bits
// shifted up, a subnormal one m * 2^-9 (E4M3) or m * 2^-16 (E5M2), exactly. Every NaN code gives
// the quiet NaN 0x7FC00000; E5M2's 0x7C / 0xFC give +-Inf.
template <Fp8Format F>
QUANT_CORE_INLINE float decode_fp8(uint8_t code) {
  constexpr bool kE4M3 = F == Fp8Format::kE4M3;
  constexpr int kShift = kE4M3 ? 20 : 21;                           // 23 - mantissa bits
  constexpr uint32_t kRebias = kE4M3 ? (120u << 23) : (112u << 23);  // (127 - bias) << 23
  constexpr uint32_t kMantissaMask = kE4M3 ? 0x7u : 0x3u;
  constexpr float kSubnormalStep = kE4M3 ? 0.001953125f : 1.52587890625e-05f;  // 2^-9, 2^-16
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const uint32_t normal = (magnitude << kShift) + kRebias;
  const uint32_t subnormal = float_to_bits(float(int32_t(magnitude & kMantissaMask)) * kSubnormalStep);
  const bool is_subnormal = (magnitude >> (23 - kShift)) == 0;
  uint32_t bits = sign | (is_subnormal ? subnormal : normal);
  if constexpr (kE4M3) {
    bits = magnitude == 0x7Fu ? 0x7FC00000u : bits;
  } else {
    bits = magnitude > 0x7Cu ? 0x7FC00000u : (magnitude == 0x7Cu ? (sign | 0x7F800000u) : bits);
  }
  return bits_to_float(bits);
}

// [Note: FP8 stochastic rounding] in _numerics.py: fp8(v) rounded up or down to a neighbour, up
// iff random16 < (|v| - lo) / step * 2^16; every quantity exact in fp32 (step a power of two).
template <Fp8Format F>
QUANT_CORE_INLINE uint8_t encode_fp8_stochastic(float v, uint32_t random16) {
  constexpr bool kE4M3 = F == Fp8Format::kE4M3;
  constexpr float kFmax = kE4M3 ? 448.0f : 57344.0f;
  constexpr int32_t kMinNormalField = kE4M3 ? 121 : 113;  // 2^-6, 2^-14
  constexpr int32_t kMantissaBits = kE4M3 ? 3 : 2;
  const float a = std::fabs(v) < kFmax ? std::fabs(v) : kFmax;  // NaN too: it encodes as 0x7F below
  const int32_t field = int32_t(float_to_bits(a) >> 23);
  const int32_t step_field = (field > kMinNormalField ? field : kMinNormalField) - kMantissaBits;
  const float q = a * bits_to_float(uint32_t(254 - step_field) << 23);  // a / step, exactly
  const float lower = float(int32_t(q));
  const float up = float(random16) < (q - lower) * 65536.0f ? 1.0f : 0.0f;
  const uint32_t magnitude = float_to_bits((lower + up) * bits_to_float(uint32_t(step_field) << 23));
  const uint8_t code = encode_fp8<F>(bits_to_float(magnitude | (float_to_bits(v) & 0x80000000u)));
  return v != v ? uint8_t(0x7F) : code;
}

// E2M1 (NVFP4 elements): the mirror of _numerics.encode_e2m1. The magnitude code counts the
// rounding thresholds below |v|; a tie goes to the even code. NaN -> 0; saturates at 6.
QUANT_CORE_INLINE uint8_t encode_e2m1(float v) {
  const float a = std::fabs(v);
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  const bool negative = std::signbit(v) && !std::isnan(v);
  return uint8_t(code | (negative ? 0x8 : 0));
}

// Stochastic E2M1: the mirror of _numerics.encode_e2m1_stochastic (random24 is uniform in [0, 2^24)).
QUANT_CORE_INLINE uint8_t encode_e2m1_stochastic(float v, uint32_t random24) {
  // |v| >= 6 saturates whatever the draw, so clamping at 8 first changes no result and keeps the
  // integer truncation below exact and in range (NaN becomes 8 here and 0 at the end). The steps
  // are powers of two, so multiplying by their reciprocals is exact: no division, no floor call.
  const float a = std::fabs(v) < 8.0f ? std::fabs(v) : 8.0f;
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float inverse_step = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float lower = float(int32_t(a * inverse_step)) * step;
  const float fraction = (a - lower) * inverse_step;
  float rounded = lower + (float(random24) < fraction * 16777216.0f ? step : 0.0f);
  rounded = std::isnan(v) ? 0.0f : std::min(rounded, 6.0f);
  return encode_e2m1(std::signbit(v) && !std::isnan(v) ? -rounded : rounded);
}

QUANT_CORE_INLINE float decode_e2m1(uint8_t code) {
  // Magnitude codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}: from code 2 on, exponent code / 2 - 1
  // and the mantissa's top bit code & 1; selects rather than a table so that loops vectorize.
  const uint32_t magnitude = code & 0x7u;
  const uint32_t normal = (((magnitude >> 1) + 126u) << 23) | ((magnitude & 1u) << 22);
  const uint32_t bits = magnitude == 0 ? 0u : (magnitude == 1 ? 0x3F000000u : normal);
  return bits_to_float(bits | (uint32_t(code & 0x8u) << 28));
}

// [Note: counter RNG] in _numerics.py: output `index` of the SplitMix64 stream seeded with `seed`.
QUANT_CORE_INLINE uint64_t splitmix64(uint64_t seed, uint64_t index) {
  uint64_t z = (index + 1) * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// [Note: bf16 stochastic rounding] in _numerics.py: the bf16 bits of fp32 f with random16 (below
// 2^16) added to its bits and the sum truncated; every NaN gives the canonical 0x7FC0.
QUANT_CORE_INLINE uint16_t float_to_bfloat16_stochastic(float f, uint32_t random16) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((u + random16) >> 16);  // no carry past bit 31: u <= 0xFF800000
}

// ---- stores of dequantized values, round to nearest even, canonical NaN ([Note: FP8 NaN]) ----

QUANT_CORE_INLINE uint16_t float_to_bfloat16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t rounded = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : rounded;
}

// fp32 -> fp16 with round to nearest even, overflow to Inf and subnormal results, done with
// exact fp32 arithmetic (M. Maratyszcza's FP16 method, as torch's c10 uses).
QUANT_CORE_INLINE uint16_t float_to_float16(float f) {
  const uint32_t w = float_to_bits(f);
  const float scale_to_inf = 5.192296858534828e+33f;   // 2^112
  const float scale_to_zero = 7.703719777548943e-34f;  // 2^-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t result_bits = float_to_bits(base);
  const uint32_t exponent_bits = (result_bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = result_bits & 0x00000FFFu;
  const uint16_t result = uint16_t((sign >> 16) | (exponent_bits + mantissa_bits));
  return (w & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7E00) : result;
}

// Writes fp32 `value` as element `index` of an output of dtype D (canonical NaN for fp32 too).
template <DType D>
QUANT_CORE_INLINE void store(void* base, int64_t index, float value) {
  if constexpr (D == DType::kFloat32) {
    static_cast<float*>(base)[index] = std::isnan(value) ? std::numeric_limits<float>::quiet_NaN() : value;
  } else if constexpr (D == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[index] = float_to_bfloat16(value);
  } else {
    static_cast<uint16_t*>(base)[index] = float_to_float16(value);
  }
}

}  // namespace quant_core
