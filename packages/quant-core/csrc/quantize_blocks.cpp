// Block-scaled quantize (MXFP8, blockwise FP8, NVFP4): one tile-based quantizer, specialised by a
// small policy per format. The layouts are those of [Note: block layouts] (blocks/_layout.py).
//
// Quantize reads x once, tile by tile (B rows x 128 columns for block size B): a b x b-tiled
// format computes one scale per B x B block of the tile and writes the rowwise codes and their
// transpose; a 1 x B format computes a scale per block of each tile row for rowwise and one per
// tile column for columnwise (the quantization of x^T, for NVFP4 optionally of T(x^T), [Note:
// NVFP4 random Hadamard transform] in nvfp4/_nvfp4.py).
#include <memory>

#include "common.h"
#include "hadamard.h"
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

// Policies: how a block's scale and codes are computed. kTransformsColumns: the policy may ask
// (runtime `transform_columns()`) for the 1 x B columnwise runs of a tile (its columns) to go
// through `transform_columns(tile, row_stride, w)` before their amax and encode (NVFP4's
// Hadamard transform; B = 16 and whole runs then).
struct Mxfp8Policy {
  static constexpr bool kTransformsColumns = false;
  static constexpr bool kNeedsIndex = false;
  static constexpr int kCodesPerByte = 1;
  static constexpr bool kFloatScale = false;
  QUANT_CORE_INLINE BlockScale scale(float amax) const {
    const int e = std::clamp(-max_exponent_within(amax, 448.0f), -127, 127);
    return {power_of_two(-e), 0.0f, uint8_t(e + 127), false};
  }
  QUANT_CORE_INLINE uint8_t encode(float v, uint64_t) const { return encode_fp8<Fp8Format::kE4M3>(v); }
};

template <Fp8Format F>
struct BlockwisePolicy {
  static constexpr bool kTransformsColumns = false;
  static constexpr bool kNeedsIndex = false;
  static constexpr int kCodesPerByte = 1;
  static constexpr bool kFloatScale = true;
  bool power_2_scales;
  QUANT_CORE_INLINE BlockScale scale(float amax) const {
    constexpr float kFmax = F == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
    float scale = 1.0f;
    if (amax > 0.0f) {
      scale = power_2_scales ? power_of_two(std::min(max_exponent_within(amax, kFmax), 127))
                             : std::min(kFmax / amax, kFloat32Max);
    }
    return {scale, 1.0f / scale, 0, false};
  }
  QUANT_CORE_INLINE uint8_t encode(float v, uint64_t) const { return encode_fp8<F>(v); }
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
  void transform_columns(float* tile, int64_t row_stride, int64_t w) const {
    hadamard_16_columns(tile, row_stride, w, hadamard->values);
  }
  QUANT_CORE_INLINE BlockScale scale(float amax) const {
    const uint8_t s = encode_fp8<Fp8Format::kE4M3>(amax / 6.0f * tensor_scale);
    const float s_f32 = decode_fp8<Fp8Format::kE4M3>(s);
    // enc = S / s is clamped to the largest fp32 like every scale (S may already be, and s < 1).
    return {s_f32 > 0.0f ? std::min(tensor_scale / s_f32, kFloat32Max) : 0.0f, 0.0f, s, s_f32 == 0.0f};
  }
  QUANT_CORE_INLINE uint8_t encode(float v, uint64_t index) const {
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
QUANT_CORE_INLINE void write_codes(uint8_t* __restrict out, const uint8_t* __restrict codes, int64_t count) {
  if constexpr (kCodesPerByte == 1) {
    std::memcpy(out, codes, size_t(count));
  } else {
    for (int64_t i = 0; i < count / 2; ++i) out[i] = uint8_t(codes[2 * i] | (codes[2 * i + 1] << 4));
  }
}

// Tiles are B rows (a columnwise run) by kTileCols columns (whole rowwise blocks of every block
// size), so that the loops along a row are long enough to vectorize.
constexpr int64_t kMaxBlock = 128;
constexpr int64_t kTileCols = 128;
// Rows of a tile whose columns are transformed: the Hadamard transform runs over 16-row runs only.
constexpr int64_t kTransformedRows = 16;

// Per-thread scratch for one tile, row-major with rows kTileCols apart unless said otherwise.
struct TileScratch {
  TileScratch()
      : values(new float[size_t(kMaxBlock * kTileCols)]),
        transformed(new float[size_t(kTransformedRows * kTileCols)]),
        codes(new uint8_t[size_t(kMaxBlock * kTileCols)]),
        column_codes(new uint8_t[size_t(kMaxBlock * kTileCols)]),
        codes_t(new uint8_t[size_t(kTileCols * kMaxBlock)]) {}
  std::unique_ptr<float[]> values;           // x's tile as fp32
  std::unique_ptr<float[]> transformed;      // a 16-row tile with its columns transformed
  std::unique_ptr<uint8_t[]> codes;          // rowwise codes (b x b tiles: the tile's codes)
  std::unique_ptr<uint8_t[]> column_codes;   // columnwise codes, still [row][col]
  std::unique_ptr<uint8_t[]> codes_t;        // columnwise codes [col][row], rows kMaxBlock apart
  int32_t keys[kTileCols];                   // per column: magnitude key of its run
  float multipliers[kTileCols];              // per column: its run's BlockScale::multiplier
  uint8_t zero[kTileCols];                   // per column: BlockScale::zero
};

// codes[j] = encode(values[j] * multipliers[j]) for j < n (0 where zero[j]), element j's counter
// first_index + j * index_stride. Whole tile rows at once, with a multiplier per element: a loop
// over one block of 16 or 32 codes is shorter than a vector of codes and would not vectorize.
template <class Policy>
QUANT_CORE_INLINE void encode_row(const Policy& policy, const float* __restrict values,
                                  const float* __restrict multipliers, const uint8_t* __restrict zero,
                                  uint8_t* __restrict codes, int64_t n, uint64_t first_index, uint64_t index_stride) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t code = policy.encode(values[j] * multipliers[j], first_index + uint64_t(j) * index_stride);
    codes[j] = zero[j] ? uint8_t(0) : code;
  }
}

// Sets columns [j0, j0 + n) of the tile's per-column multipliers and zero flags to those of s.
QUANT_CORE_INLINE void set_block_scale(TileScratch& t, int64_t j0, int64_t n, const BlockScale& s) {
  for (int64_t j = j0; j < j0 + n; ++j) {
    t.multipliers[j] = s.multiplier;
    t.zero[j] = s.zero;
  }
}

// codes_t[j * kMaxBlock + i] = codes[i * kTileCols + j] for i < h, j < w.
QUANT_CORE_INLINE void transpose_tile_codes(const uint8_t* __restrict codes, uint8_t* __restrict codes_t, int64_t h,
                                            int64_t w) {
  for (int64_t j = 0; j < w; ++j)
    for (int64_t i = 0; i < h; ++i) codes_t[j * kMaxBlock + i] = codes[i * kTileCols + j];
}

// Quantizes the tile of rows [r0, r0 + B) x cols [c0, c0 + kTileCols) (clipped to x): `policy`
// the rowwise blocks and b x b tiles, `columnwise_policy` the 1 x B columnwise runs.
template <DType D, class Policy>
QUANT_CORE_CLONES void quantize_tile(const void* x, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                                     int64_t B, bool two_d, const Policy& policy, const Policy& columnwise_policy,
                                     const Outputs& out, int64_t r0, int64_t c0, TileScratch& t) {
  constexpr int64_t kCpb = Policy::kCodesPerByte;
  const int64_t h = std::min(B, M - r0), w = std::min(kTileCols, K - c0);
  const int64_t Mb = (M + B - 1) / B, Kb = (K + B - 1) / B;
  float* __restrict values = t.values.get();
  uint8_t* __restrict codes = t.codes.get();
  uint8_t* __restrict codes_t = t.codes_t.get();
  for (int64_t i = 0; i < h; ++i) {
    const int64_t offset = (r0 + i) * stride_row + c0 * stride_col;
    float* __restrict row = values + i * kTileCols;
    if (stride_col == 1) {
      for (int64_t j = 0; j < w; ++j) row[j] = load<D>(x, offset + j);
    } else {
      for (int64_t j = 0; j < w; ++j) row[j] = load<D>(x, offset + j * stride_col);
    }
  }
  if (two_d) {
    for (int64_t j0 = 0; j0 < w; j0 += B) {
      const int64_t block_w = std::min(B, w - j0);
      const BlockScale s = policy.scale(bits_to_float(uint32_t(max_key_of_rows(values + j0, kTileCols, h, block_w))));
      set_block_scale(t, j0, block_w, s);
      const int64_t block = (c0 + j0) / B;
      if (out.rowwise_scale != nullptr) store_scale<Policy>(out.rowwise_scale, (r0 / B) * Kb + block, s);
      if (out.columnwise_scale != nullptr) store_scale<Policy>(out.columnwise_scale, block * Mb + r0 / B, s);
    }
    for (int64_t i = 0; i < h; ++i) {
      encode_row(policy, values + i * kTileCols, t.multipliers, t.zero, codes + i * kTileCols, w,
                 uint64_t((r0 + i) * K + c0), 1);
    }
    if (out.columnwise_data != nullptr) transpose_tile_codes(codes, codes_t, h, w);
  } else {
    if (out.rowwise_data != nullptr) {
      for (int64_t i = 0; i < h; ++i) {
        const float* row = values + i * kTileCols;
        for (int64_t j0 = 0; j0 < w; j0 += B) {
          const int64_t block_w = std::min(B, w - j0);
          const BlockScale s = policy.scale(bits_to_float(uint32_t(max_key_of_rows(row + j0, kTileCols, 1, block_w))));
          set_block_scale(t, j0, block_w, s);
          store_scale<Policy>(out.rowwise_scale, (r0 + i) * Kb + (c0 + j0) / B, s);
        }
        encode_row(policy, row, t.multipliers, t.zero, codes + i * kTileCols, w, uint64_t((r0 + i) * K + c0), 1);
      }
    }
    if (out.columnwise_data != nullptr) {
      const float* __restrict runs = values;
      if constexpr (Policy::kTransformsColumns) {
        if (columnwise_policy.transform_columns()) {  // h == B == 16 rows: the caller checked M % 16 == 0
          float* transformed = t.transformed.get();
          std::memcpy(transformed, values, size_t(h * kTileCols) * sizeof(float));
          columnwise_policy.transform_columns(transformed, kTileCols, w);
          runs = transformed;
        }
      }
      for (int64_t j = 0; j < w; ++j) t.keys[j] = 0;
      for (int64_t i = 0; i < h; ++i) {
        for (int64_t j = 0; j < w; ++j) {
          const int32_t k = magnitude_key(runs[i * kTileCols + j]);
          t.keys[j] = k > t.keys[j] ? k : t.keys[j];
        }
      }
      for (int64_t j = 0; j < w; ++j) {
        const BlockScale s = columnwise_policy.scale(bits_to_float(uint32_t(t.keys[j])));
        set_block_scale(t, j, 1, s);
        store_scale<Policy>(out.columnwise_scale, (c0 + j) * Mb + r0 / B, s);
      }
      // Columnwise counters continue after x's M * K elements, in x^T's row-major order.
      uint8_t* column_codes = t.column_codes.get();
      for (int64_t i = 0; i < h; ++i) {
        encode_row(columnwise_policy, runs + i * kTileCols, t.multipliers, t.zero, column_codes + i * kTileCols, w,
                   uint64_t(M * K + c0 * M + r0 + i), uint64_t(M));
      }
      transpose_tile_codes(column_codes, codes_t, h, w);
    }
  }
  if (out.rowwise_data != nullptr) {
    for (int64_t i = 0; i < h; ++i) {
      write_codes<kCpb>(out.rowwise_data + ((r0 + i) * K + c0) / kCpb, codes + i * kTileCols, w);
    }
  }
  if (out.columnwise_data != nullptr) {
    for (int64_t j = 0; j < w; ++j) {
      write_codes<kCpb>(out.columnwise_data + ((c0 + j) * M + r0) / kCpb, codes_t + j * kMaxBlock, h);
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
    parallel_for_tiles(M, K, B, kTileCols, num_threads, [&](int64_t r0, int64_t c0, int64_t, int64_t) {
      thread_local TileScratch scratch;  // per worker thread
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

}  // namespace quant_core
