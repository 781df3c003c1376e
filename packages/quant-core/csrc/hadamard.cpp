// The 16 x 16 random Hadamard transform along K, and the amaxes of x and of its transform along M
// in one read ([Note: NVFP4 random Hadamard transform] in nvfp4/_nvfp4.py).
#include "common.h"
#include "hadamard.h"
#include "kernels.h"

namespace quant_core {

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

namespace {

// Rows [r0, r0 + h) x cols [c0, c0 + w) of x into a 16 x kHadamardColumns fp32 tile, rows past h
// zeros; returns the largest magnitude key of the values read.
constexpr int64_t kHadamardColumns = 64;
template <DType D>
QUANT_CORE_CLONES int32_t load_tile_rows(const void* x, int64_t stride_row, int64_t stride_col, int64_t r0, int64_t c0,
                                         int64_t h, int64_t w, float* __restrict tile) {
  int32_t key = 0;
  for (int64_t i = 0; i < 16; ++i) {
    float* __restrict row = tile + i * kHadamardColumns;
    for (int64_t j = 0; j < w; ++j) {
      row[j] = i < h ? load<D>(x, (r0 + i) * stride_row + (c0 + j) * stride_col) : 0.0f;
      const int32_t k = magnitude_key(row[j]);
      key = k > key ? k : key;
    }
  }
  return key;
}

// The largest magnitude key of the tile's first w columns after hadamard_16 of each (in place).
QUANT_CORE_CLONES int32_t transformed_columns_key(float* __restrict tile, int64_t w, const float* signs) {
  hadamard_16_columns(tile, kHadamardColumns, w, signs);
  return max_key_of_rows(tile, kHadamardColumns, 16, w);
}

}  // namespace

void hadamard_amaxes(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                     uint64_t seed, uintptr_t amax_out, int num_threads) {
  // Runs of 16 rows split across threads; each run is read 64 columns at a time into a 16 x 64
  // tile (rows past M are zeros), whose magnitudes feed amax(x) and whose columns are transformed
  // for amax(T(x^T)). Both maxima are over finite magnitudes (NaN and +-Inf count as 0).
  constexpr int64_t kColumns = kHadamardColumns;
  const HadamardSigns signs(seed);
  const void* x = reinterpret_cast<const void*>(x_MK);
  const int64_t runs = (M + 15) / 16;
  std::vector<float> partial(size_t(2 * std::max(num_threads, 1)), 0.0f);
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(16 * K, 1));
    parallel_for(runs, grain, num_threads, [&](int64_t chunk, int64_t begin, int64_t end) {
      float tile[16][kColumns];
      int32_t largest = 0, largest_transformed = 0;  // magnitude keys
      for (int64_t g = begin; g < end; ++g) {
        const int64_t r0 = g * 16, h = std::min<int64_t>(16, M - r0);
        for (int64_t c0 = 0; c0 < K; c0 += kColumns) {
          const int64_t w = std::min(kColumns, K - c0);
          largest = std::max(largest, load_tile_rows<D>(x, stride_row, stride_col, r0, c0, h, w, &tile[0][0]));
          largest_transformed = std::max(largest_transformed, transformed_columns_key(&tile[0][0], w, signs.values));
        }
      }
      partial[size_t(2 * chunk)] = bits_to_float(uint32_t(largest));
      partial[size_t(2 * chunk + 1)] = bits_to_float(uint32_t(largest_transformed));
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
