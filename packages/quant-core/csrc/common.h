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
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace quant_core {

// Input dtypes, numbered as quant_core._cpp passes them.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
// FP8 formats, numbered as quant_core._cpp passes them.
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bfloat16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline float float16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
    const float magnitude = float(mantissa) * 5.9604644775390625e-08f;
    return bits_to_float(sign | float_to_bits(magnitude));
  }
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // Inf, NaN
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Reads element `index` of an input of the given dtype as fp32 (exact for all three dtypes).
template <DType D>
inline float load(const void* base, int64_t index) {
  if constexpr (D == DType::kFloat32) {
    return static_cast<const float*>(base)[index];
  } else if constexpr (D == DType::kBFloat16) {
    return bfloat16_to_float(static_cast<const uint16_t*>(base)[index]);
  } else {
    return float16_to_float(static_cast<const uint16_t*>(base)[index]);
  }
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

// fp8(v) of DESIGN section 3: saturate to +-max (Inf included), NaN to the canonical 0x7F (the
// sign of a NaN is dropped: torch does not keep it reliably either), round to nearest even. Normal results round on the fp32 bits; subnormal results are
// rounded by the FPU itself: adding 2^14 (E4M3) or 2^7 (E5M2), whose ulp is exactly the format's
// subnormal step, rounds the sum to a multiple of that step with round-to-nearest-even.
inline uint8_t encode_e4m3(float v) {
  const uint32_t u = float_to_bits(v);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7F;               // NaN
  magnitude = std::min(magnitude, 0x43E00000u);          // 448
  if (magnitude >= 0x3C800000u) {                        // >= 2^-6: normal in E4M3
    magnitude += 0x7FFFFu + ((magnitude >> 20) & 1u);    // round to 3 mantissa bits
    return sign | uint8_t((magnitude >> 20) - (120u << 3));
  }
  const float shifted = bits_to_float(magnitude) + 16384.0f;  // ulp(2^14) = 2^-9
  return sign | uint8_t(float_to_bits(shifted) - 0x46800000u);
}

inline uint8_t encode_e5m2(float v) {
  const uint32_t u = float_to_bits(v);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7F;               // NaN
  magnitude = std::min(magnitude, 0x47600000u);          // 57344
  if (magnitude >= 0x38800000u) {                        // >= 2^-14: normal in E5M2
    magnitude += 0xFFFFFu + ((magnitude >> 21) & 1u);    // round to 2 mantissa bits
    return sign | uint8_t((magnitude >> 21) - (112u << 2));
  }
  const float shifted = bits_to_float(magnitude) + 128.0f;  // ulp(2^7) = 2^-16
  return sign | uint8_t(float_to_bits(shifted) - 0x43000000u);
}

template <Fp8Format F>
inline uint8_t encode_fp8(float v) {
  if constexpr (F == Fp8Format::kE4M3) {
    return encode_e4m3(v);
  } else {
    return encode_e5m2(v);
  }
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

}  // namespace quant_core
