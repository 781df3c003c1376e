// Block-scaled formats (MXFP8, blockwise FP8, NVFP4): one tile-based quantizer and one
// dequantizer, specialised by a small policy per format; plus the lossless transposes and the
// 16 x 16 Hadamard transform. The layouts are those of [Note: block layouts] (_blocks.py).
//
// Quantize reads x once, tile by tile (B x B for block size B): a b x b-tiled format computes one
// scale per tile and writes the rowwise codes and their transpose; a 1 x B format computes a
// scale per tile row for rowwise and per tile column for columnwise (the quantization of x^T,
// for NVFP4 optionally of T(x^T), [Note: NVFP4 random Hadamard transform] in _nvfp4.py).
#include <memory>

#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// What a policy computes for one block: the multiplier applied before encoding, the stored
// dequantization scale, and whether every code of the block is forced to 0 (NVFP4's s = 0).
struct BlockScale {
  float multiplier;
  float stored_float;    // blockwise FP8 scale_inv
  uint8_t stored_byte;   // MXFP8 E8M0 byte, NVFP4 E4M3 byte
  bool zero;
};

// The 16 random signs of the Hadamard transform of `seed` ([Note: counter RNG]).
struct HadamardSigns {
  explicit HadamardSigns(uint64_t seed) {
    for (int j = 0; j < 16; ++j) values[j] = (splitmix64(seed, uint64_t(j)) >> 63) ? -1.0f : 1.0f;
  }
  float values[16];
};

// v <- (1/4) H_16 D v in place, in fp32: signs, the 4-stage butterfly (stage h adds and subtracts
// elements h apart), times 1/4; the mirror of _nvfp4.hadamard_transform_16_reference.
inline void hadamard_16(float* v, const float* signs) {
  for (int j = 0; j < 16; ++j) v[j] *= signs[j];
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  for (int j = 0; j < 16; ++j) v[j] *= 0.25f;
}

// Policies: how a block's scale and codes are computed. kTransformsColumns: the policy may ask
// (runtime `transform_columns()`) for each 1 x B columnwise run to go through `transform(run)`
// before its amax and encode (NVFP4's Hadamard transform; B = 16 and whole runs then).
struct Mxfp8Policy {
  static constexpr bool kTransformsColumns = false;
  static constexpr bool kNeedsIndex = false;
  static constexpr int kCodesPerByte = 1;
  static constexpr bool kFloatScale = false;
  BlockScale scale(float amax) const {
    const int e = std::clamp(-max_exponent_within(amax, 448.0f), -127, 127);
    return {power_of_two(-e), 0.0f, uint8_t(e + 127), false};
  }
  uint8_t encode(float v, uint64_t) const { return encode_fp8<Fp8Format::kE4M3>(v); }
};

template <Fp8Format F>
struct BlockwisePolicy {
  static constexpr bool kTransformsColumns = false;
  static constexpr bool kNeedsIndex = false;
  static constexpr int kCodesPerByte = 1;
  static constexpr bool kFloatScale = true;
  bool power_2_scales;
  BlockScale scale(float amax) const {
    constexpr float kFmax = F == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
    float scale = 1.0f;
    if (amax > 0.0f) {
      scale = power_2_scales ? power_of_two(std::min(max_exponent_within(amax, kFmax), 127))
                             : std::min(kFmax / amax, kFloat32Max);
    }
    return {scale, 1.0f / scale, 0, false};
  }
  uint8_t encode(float v, uint64_t) const { return encode_fp8<F>(v); }
};

template <bool kStochastic>
struct Nvfp4Policy {
  static constexpr bool kTransformsColumns = true;
  static constexpr bool kNeedsIndex = kStochastic;
  static constexpr int kCodesPerByte = 2;
  static constexpr bool kFloatScale = false;
  float tensor_scale;  // S (of the usage this policy quantizes)
  uint64_t seed;
  const HadamardSigns* hadamard;  // columnwise runs are T(x^T) when set
  bool transform_columns() const { return hadamard != nullptr; }
  void transform(float* run) const { hadamard_16(run, hadamard->values); }
  BlockScale scale(float amax) const {
    const uint8_t s = encode_fp8<Fp8Format::kE4M3>(amax / 6.0f * tensor_scale);
    const float s_f32 = decode_fp8<Fp8Format::kE4M3>(s);
    // enc = S / s is clamped to the largest fp32 like every scale (S may already be, and s < 1).
    return {s_f32 > 0.0f ? std::min(tensor_scale / s_f32, kFloat32Max) : 0.0f, 0.0f, s, s_f32 == 0.0f};
  }
  uint8_t encode(float v, uint64_t index) const {
    if constexpr (kStochastic) {
      return encode_e2m1_stochastic(v, uint32_t(splitmix64(seed, index) >> 40));
    } else {
      return encode_e2m1(v);
    }
  }
};

struct Outputs {
  uint8_t* rowwise_data;
  void* rowwise_scale;
  uint8_t* columnwise_data;
  void* columnwise_scale;
};

template <class Policy>
inline void store_scale(void* scales, int64_t index, const BlockScale& s) {
  if constexpr (Policy::kFloatScale) {
    static_cast<float*>(scales)[index] = s.stored_float;
  } else {
    static_cast<uint8_t*>(scales)[index] = s.stored_byte;
  }
}

// Writes `count` codes (one per byte in `codes`) to `out`, packing pairs for 4-bit formats.
template <int kCodesPerByte>
inline void write_codes(uint8_t* out, const uint8_t* codes, int64_t count) {
  if constexpr (kCodesPerByte == 1) {
    std::memcpy(out, codes, size_t(count));
  } else {
    for (int64_t i = 0; i < count / 2; ++i) out[i] = uint8_t(codes[2 * i] | (codes[2 * i + 1] << 4));
  }
}

inline float finite_magnitude(float v) {
  const float a = std::fabs(v);
  return a <= kFloat32Max ? a : 0.0f;  // NaN and Inf count as 0
}

// Per-thread scratch for one tile: values and codes in both orientations.
struct TileScratch {
  explicit TileScratch(int64_t B)
      : B(B),
        values(new float[size_t(B * B)]),
        run(new float[size_t(B)]),
        codes(new uint8_t[size_t(B * B)]),
        codes_t(new uint8_t[size_t(B * B)]) {}
  int64_t B;
  std::unique_ptr<float[]> values;     // [row][col]
  std::unique_ptr<float[]> run;        // one transformed column run
  std::unique_ptr<uint8_t[]> codes;    // [row][col]
  std::unique_ptr<uint8_t[]> codes_t;  // [col][row]
};

// codes[j * code_stride] = encode(values[j * value_stride] * multiplier) for j < n; element j's
// counter is first_index + j * index_stride. Unit strides (the rowwise case) vectorize.
template <class Policy>
inline void encode_run(const Policy& policy, const BlockScale& s, const float* values, int64_t value_stride,
                       uint8_t* codes, int64_t code_stride, int64_t n, uint64_t first_index, uint64_t index_stride) {
  if (s.zero) {
    for (int64_t j = 0; j < n; ++j) codes[j * code_stride] = 0;
    return;
  }
  const float multiplier = s.multiplier;
  if (value_stride == 1 && code_stride == 1) {
    for (int64_t j = 0; j < n; ++j) {
      codes[j] = policy.encode(values[j] * multiplier, Policy::kNeedsIndex ? first_index + uint64_t(j) * index_stride : 0);
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    codes[j * code_stride] = policy.encode(values[j * value_stride] * multiplier,
                                           Policy::kNeedsIndex ? first_index + uint64_t(j) * index_stride : 0);
  }
}

// `policy` quantizes rowwise blocks and b x b tiles, `columnwise_policy` the 1 x B columnwise runs.
template <DType D, class Policy>
void quantize_tile(const void* x, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col, int64_t B,
                   bool two_d, const Policy& policy, const Policy& columnwise_policy, const Outputs& out, int64_t r0,
                   int64_t c0, TileScratch& t) {
  constexpr int64_t kCpb = Policy::kCodesPerByte;
  const int64_t h = std::min(B, M - r0), w = std::min(B, K - c0);
  float* values = t.values.get();
  uint8_t* codes = t.codes.get();
  uint8_t* codes_t = t.codes_t.get();
  for (int64_t i = 0; i < h; ++i) {
    const int64_t offset = (r0 + i) * stride_row + c0 * stride_col;
    float* row = values + i * B;
    if (stride_col == 1) {
      for (int64_t j = 0; j < w; ++j) row[j] = load<D>(x, offset + j);
    } else {
      for (int64_t j = 0; j < w; ++j) row[j] = load<D>(x, offset + j * stride_col);
    }
  }
  const int64_t Mb = (M + B - 1) / B, Kb = (K + B - 1) / B;
  if (two_d) {
    float amax = 0.0f;
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < w; ++j) amax = std::max(amax, finite_magnitude(values[i * B + j]));
    const BlockScale s = policy.scale(amax);
    for (int64_t i = 0; i < h; ++i) {
      encode_run(policy, s, values + i * B, 1, codes + i * B, 1, w, uint64_t((r0 + i) * K + c0), 1);
    }
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < w; ++j) codes_t[j * B + i] = codes[i * B + j];
    if (out.rowwise_scale != nullptr) store_scale<Policy>(out.rowwise_scale, (r0 / B) * Kb + c0 / B, s);
    if (out.columnwise_scale != nullptr) store_scale<Policy>(out.columnwise_scale, (c0 / B) * Mb + r0 / B, s);
  } else {
    if (out.rowwise_data != nullptr) {
      for (int64_t i = 0; i < h; ++i) {
        float amax = 0.0f;
        for (int64_t j = 0; j < w; ++j) amax = std::max(amax, finite_magnitude(values[i * B + j]));
        const BlockScale s = policy.scale(amax);
        encode_run(policy, s, values + i * B, 1, codes + i * B, 1, w, uint64_t((r0 + i) * K + c0), 1);
        store_scale<Policy>(out.rowwise_scale, (r0 + i) * Kb + c0 / B, s);
      }
    }
    if (out.columnwise_data != nullptr) {
      for (int64_t j = 0; j < w; ++j) {
        const float* run = values + j;
        int64_t run_stride = B;
        if constexpr (Policy::kTransformsColumns) {
          if (columnwise_policy.transform_columns()) {  // h == B == 16: the caller checked M % 16 == 0
            for (int64_t i = 0; i < h; ++i) t.run[size_t(i)] = values[i * B + j];
            columnwise_policy.transform(t.run.get());
            run = t.run.get();
            run_stride = 1;
          }
        }
        float amax = 0.0f;
        for (int64_t i = 0; i < h; ++i) amax = std::max(amax, finite_magnitude(run[i * run_stride]));
        const BlockScale s = columnwise_policy.scale(amax);
        // Columnwise counters continue after x's M * K elements, in x^T's row-major order.
        encode_run(columnwise_policy, s, run, run_stride, codes_t + j * B, 1, h, uint64_t(M * K + (c0 + j) * M + r0),
                   1);
        store_scale<Policy>(out.columnwise_scale, (c0 + j) * Mb + r0 / B, s);
      }
    }
  }
  if (out.rowwise_data != nullptr) {
    for (int64_t i = 0; i < h; ++i) {
      write_codes<kCpb>(out.rowwise_data + ((r0 + i) * K + c0) / kCpb, codes + i * B, w);
    }
  }
  if (out.columnwise_data != nullptr) {
    for (int64_t j = 0; j < w; ++j) {
      write_codes<kCpb>(out.columnwise_data + ((c0 + j) * M + r0) / kCpb, codes_t + j * B, h);
    }
  }
}

template <class Policy>
void quantize_blocks(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                     int64_t B, bool two_d, const Policy& policy, const Policy& columnwise_policy, const Outputs& out,
                     int num_threads) {
  const void* x = reinterpret_cast<const void*>(x_MK);
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    parallel_for_tiles(M, K, B, B, num_threads, [&](int64_t r0, int64_t c0, int64_t, int64_t) {
      thread_local TileScratch scratch(128);  // per worker thread; fits the largest block size
      quantize_tile<D>(x, M, K, stride_row, stride_col, B, two_d, policy, columnwise_policy, out, r0, c0, scratch);
    });
  });
}

template <class Policy>
void quantize_blocks(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                     int64_t B, bool two_d, const Policy& policy, const Outputs& out, int num_threads) {
  quantize_blocks(x_MK, dtype, M, K, stride_row, stride_col, B, two_d, policy, policy, out, num_threads);
}

Outputs outputs(uintptr_t rowwise_data, uintptr_t rowwise_scale, uintptr_t columnwise_data, uintptr_t columnwise_scale) {
  return {reinterpret_cast<uint8_t*>(rowwise_data), reinterpret_cast<void*>(rowwise_scale),
          reinterpret_cast<uint8_t*>(columnwise_data), reinterpret_cast<void*>(columnwise_scale)};
}

// out[r, c] = decode(row r, column c) * factor(r, block column) for blocks of `block_cols` along
// each row; rows split across threads, one factor per block, the inner loop over one block.
template <class Decode, class Factor>
void dequantize_rows(int64_t R, int64_t C, int64_t block_cols, int out_dtype, uintptr_t out_ptr, int num_threads,
                     Decode decode, Factor factor) {
  void* out = reinterpret_cast<void*>(out_ptr);
  dispatch_dtype(out_dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const int64_t row_grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(C, 1));
    parallel_for(R, row_grain, num_threads, [&](int64_t, int64_t row_begin, int64_t row_end) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        const int64_t row_offset = r * C;
        for (int64_t c0 = 0, block = 0; c0 < C; c0 += block_cols, ++block) {
          const float f = factor(r, block);
          const int64_t c1 = std::min(C, c0 + block_cols);
          for (int64_t c = c0; c < c1; ++c) store<D>(out, row_offset + c, decode(row_offset, c) * f);
        }
      }
    });
  });
}

}  // namespace

void quantize_mxfp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                    uintptr_t rowwise_data, uintptr_t rowwise_scale, uintptr_t columnwise_data,
                    uintptr_t columnwise_scale, int num_threads) {
  quantize_blocks(x_MK, dtype, M, K, stride_row, stride_col, 32, false, Mxfp8Policy{},
                  outputs(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale), num_threads);
}

void quantize_fp8_blockwise(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                            int64_t block_rows, int fp8_format, bool power_2_scales, uintptr_t rowwise_data,
                            uintptr_t rowwise_scale, uintptr_t columnwise_data, uintptr_t columnwise_scale,
                            int num_threads) {
  const Outputs out = outputs(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale);
  dispatch_fp8_format(fp8_format, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    quantize_blocks(x_MK, dtype, M, K, stride_row, stride_col, 128, block_rows > 1, BlockwisePolicy<F>{power_2_scales},
                    out, num_threads);
  });
}

void quantize_nvfp4(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                    int64_t block_rows, uintptr_t global_amax, bool stochastic_rounding, uintptr_t seed,
                    uintptr_t columnwise_amax, bool hadamard, uint64_t hadamard_seed, uintptr_t rowwise_data,
                    uintptr_t rowwise_scale, uintptr_t columnwise_data, uintptr_t columnwise_scale, int num_threads) {
  const float S = nvfp4_tensor_scale(*reinterpret_cast<const float*>(global_amax));
  const float S_columnwise = nvfp4_tensor_scale(*reinterpret_cast<const float*>(columnwise_amax));
  const Outputs out = outputs(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale);
  const HadamardSigns signs(hadamard_seed);
  const HadamardSigns* transform = hadamard ? &signs : nullptr;
  const uint64_t seed_bits = stochastic_rounding ? *reinterpret_cast<const uint64_t*>(seed) : 0;
  auto run = [&](auto stochastic) {
    constexpr bool kStochastic = decltype(stochastic)::value;
    quantize_blocks(x_MK, dtype, M, K, stride_row, stride_col, 16, block_rows > 1,
                    Nvfp4Policy<kStochastic>{S, seed_bits, nullptr},
                    Nvfp4Policy<kStochastic>{S_columnwise, seed_bits, transform}, out, num_threads);
  };
  if (stochastic_rounding) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

void dequantize_fp8(uintptr_t data, int fp8_format, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out,
                    int out_dtype, int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const float factor = *reinterpret_cast<const float*>(scale_inv);
  dispatch_fp8_format(fp8_format, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    dequantize_rows(
        R, C, std::max<int64_t>(C, 1), out_dtype, out, num_threads,
        [&](int64_t row, int64_t c) { return decode_fp8<F>(codes[row + c]); }, [&](int64_t, int64_t) { return factor; });
  });
}

void dequantize_mxfp8(uintptr_t data, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out, int out_dtype,
                      int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const uint8_t*>(scale_inv);
  const int64_t Cb = (C + 31) / 32;
  dequantize_rows(
      R, C, 32, out_dtype, out, num_threads,
      [&](int64_t row, int64_t c) { return decode_fp8<Fp8Format::kE4M3>(codes[row + c]); },
      [&](int64_t r, int64_t block) { return power_of_two(int(scales[r * Cb + block]) - 127); });
}

void dequantize_fp8_blockwise(uintptr_t data, int fp8_format, int64_t R, int64_t C, int64_t block_rows,
                              uintptr_t scale_inv, uintptr_t out, int out_dtype, int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const float*>(scale_inv);
  const int64_t Cb = (C + 127) / 128;
  dispatch_fp8_format(fp8_format, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    dequantize_rows(
        R, C, 128, out_dtype, out, num_threads, [&](int64_t row, int64_t c) { return decode_fp8<F>(codes[row + c]); },
        [&](int64_t r, int64_t block) { return scales[(r / block_rows) * Cb + block]; });
  });
}

void dequantize_nvfp4(uintptr_t data, int64_t R, int64_t C, int64_t block_rows, uintptr_t scale_inv,
                      uintptr_t global_amax, uintptr_t out, int out_dtype, int num_threads) {
  const auto* packed = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const uint8_t*>(scale_inv);
  const float S = nvfp4_tensor_scale(*reinterpret_cast<const float*>(global_amax));
  const int64_t Cb = (C + 15) / 16;
  dequantize_rows(
      R, C, 16, out_dtype, out, num_threads,
      // C is even, so row r starts on a byte: element c is nibble c & 1 of byte (row + c) / 2.
      [&](int64_t row, int64_t c) { return decode_e2m1(uint8_t((packed[(row + c) >> 1] >> ((c & 1) * 4)) & 0xF)); },
      [&](int64_t r, int64_t block) { return decode_fp8<Fp8Format::kE4M3>(scales[(r / block_rows) * Cb + block]) / S; });
}

void transpose_bytes(uintptr_t src, int64_t R, int64_t C, int64_t stride_row, int64_t stride_col, uintptr_t dst,
                     int num_threads) {
  // 64 x 64 tiles: rows copied into L1 (contiguous when stride_col is 1), transposed there, and
  // written out as contiguous rows of the output.
  constexpr int64_t kTile = 64;
  const auto* in = reinterpret_cast<const uint8_t*>(src);
  auto* out = reinterpret_cast<uint8_t*>(dst);
  parallel_for_tiles(R, C, kTile, kTile, num_threads, [&](int64_t r0, int64_t c0, int64_t h, int64_t w) {
    uint8_t tile[kTile][kTile], tile_t[kTile][kTile];
    for (int64_t i = 0; i < h; ++i) {
      const uint8_t* row = in + (r0 + i) * stride_row + c0 * stride_col;
      if (stride_col == 1) {
        std::memcpy(tile[i], row, size_t(w));
      } else {
        for (int64_t j = 0; j < w; ++j) tile[i][j] = row[j * stride_col];
      }
    }
    for (int64_t i = 0; i < kTile; ++i)
      for (int64_t j = 0; j < kTile; ++j) tile_t[j][i] = tile[i][j];
    for (int64_t j = 0; j < w; ++j) std::memcpy(out + (c0 + j) * R + r0, tile_t[j], size_t(h));
  });
}

void transpose_nvfp4(uintptr_t src, int64_t R, int64_t C, uintptr_t dst, int num_threads) {
  // src: R x C codes packed along C (R x C/2 bytes); dst: C x R codes packed along R (R even).
  // 64 x 64-code tiles: unpack into L1, transpose, repack into contiguous output rows.
  constexpr int64_t kTile = 64;
  const auto* in = reinterpret_cast<const uint8_t*>(src);
  auto* out = reinterpret_cast<uint8_t*>(dst);
  parallel_for_tiles(R, C, kTile, kTile, num_threads, [&](int64_t r0, int64_t c0, int64_t h, int64_t w) {
    uint8_t codes_t[kTile][kTile];
    for (int64_t i = 0; i < h; ++i) {
      const uint8_t* row = in + ((r0 + i) * C + c0) / 2;
      for (int64_t j = 0; j < w; j += 2) {
        codes_t[j][i] = row[j / 2] & 0xF;
        codes_t[j + 1][i] = row[j / 2] >> 4;
      }
    }
    for (int64_t j = 0; j < w; ++j) {
      uint8_t* dst_row = out + ((c0 + j) * R + r0) / 2;
      for (int64_t i = 0; i < h; i += 2) dst_row[i / 2] = uint8_t(codes_t[j][i] | (codes_t[j][i + 1] << 4));
    }
  });
}

void hadamard_transform_16(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                           uint64_t seed, uintptr_t out_MK, int num_threads) {
  const HadamardSigns signs(seed);
  const void* x = reinterpret_cast<const void*>(x_MK);
  void* out = reinterpret_cast<void*>(out_MK);
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const int64_t groups = M * (K / 16);
    parallel_for(groups, kMinElementsPerThread / 16, num_threads, [&](int64_t, int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t r = g / (K / 16), c0 = (g % (K / 16)) * 16;
        float v[16];
        for (int j = 0; j < 16; ++j) v[j] = load<D>(x, r * stride_row + (c0 + j) * stride_col);
        hadamard_16(v, signs.values);
        for (int j = 0; j < 16; ++j) store<D>(out, r * K + c0 + j, v[j]);
      }
    });
  });
}

void hadamard_amaxes(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                     uint64_t seed, uintptr_t amax_out, int num_threads) {
  // Runs of 16 rows split across threads; each run is read 64 columns at a time into a 16 x 64
  // tile (rows past M are zeros), whose magnitudes feed amax(x) and whose columns are transformed
  // for amax(T(x^T)). Both maxima are over finite magnitudes (NaN and +-Inf count as 0).
  constexpr int64_t kColumns = 64;
  const HadamardSigns signs(seed);
  const void* x = reinterpret_cast<const void*>(x_MK);
  const int64_t runs = (M + 15) / 16;
  std::vector<float> partial(size_t(2 * std::max(num_threads, 1)), 0.0f);
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(16 * K, 1));
    parallel_for(runs, grain, num_threads, [&](int64_t chunk, int64_t begin, int64_t end) {
      float tile[16][kColumns];
      float column[16];
      float largest = 0.0f, largest_transformed = 0.0f;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t r0 = g * 16, h = std::min<int64_t>(16, M - r0);
        for (int64_t c0 = 0; c0 < K; c0 += kColumns) {
          const int64_t w = std::min(kColumns, K - c0);
          for (int64_t i = 0; i < 16; ++i) {
            for (int64_t j = 0; j < w; ++j) {
              tile[i][j] = i < h ? load<D>(x, (r0 + i) * stride_row + (c0 + j) * stride_col) : 0.0f;
              largest = std::max(largest, finite_magnitude(tile[i][j]));
            }
          }
          for (int64_t j = 0; j < w; ++j) {
            for (int64_t i = 0; i < 16; ++i) column[i] = tile[i][j];
            hadamard_16(column, signs.values);
            for (int64_t i = 0; i < 16; ++i) largest_transformed = std::max(largest_transformed, finite_magnitude(column[i]));
          }
        }
      }
      partial[size_t(2 * chunk)] = largest;
      partial[size_t(2 * chunk + 1)] = largest_transformed;
    });
  });
  float* result = reinterpret_cast<float*>(amax_out);
  result[0] = result[1] = 0.0f;
  for (size_t c = 0; c < partial.size(); c += 2) {
    result[0] = std::max(result[0], partial[c]);
    result[1] = std::max(result[1], partial[c + 1]);
  }
}

}  // namespace quant_core
