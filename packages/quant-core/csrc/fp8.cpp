// Per-tensor FP8 cast: rowwise and columnwise (transposed) codes in one pass over the input.
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// Square tile for the transposing path: 64 x 64 codes (4 KiB) stay in L1 while being transposed.
constexpr int64_t kTile = 64;

// out[i] = fp8(x[offset + i * stride] * scale) for i in [begin, end).
template <DType D, Fp8Format F>
void cast_sequence(const void* x, int64_t offset, int64_t begin, int64_t end, int64_t stride,
                   float scale, uint8_t* out) {
  for (int64_t i = begin; i < end; ++i) {
    out[i] = encode_fp8<F>(load<D>(x, offset + i * stride) * scale);
  }
}

// Casts rows [r0, r1) x cols [c0, c1); writes rowwise codes directly and columnwise codes through
// a transposed tile so both outputs are written in contiguous runs.
template <DType D, Fp8Format F>
void cast_tile(const void* x, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
               float scale, int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint8_t* rowwise_MK,
               uint8_t* columnwise_KM) {
  uint8_t tile_KM[kTile][kTile];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row_offset = r * stride_row;
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t code = encode_fp8<F>(load<D>(x, row_offset + c * stride_col) * scale);
      if (rowwise_MK != nullptr) rowwise_MK[r * K + c] = code;
      tile_KM[c - c0][r - r0] = code;
    }
  }
  for (int64_t c = c0; c < c1; ++c) {
    std::memcpy(columnwise_KM + c * M + r0, tile_KM[c - c0], size_t(r1 - r0));
  }
}

}  // namespace

void cast_to_fp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row,
                 int64_t stride_col, uintptr_t scale_ptr, int fp8_format, uintptr_t rowwise_MK,
                 uintptr_t columnwise_KM, int num_threads) {
  const void* x = reinterpret_cast<const void*>(x_MK);
  const float scale = *reinterpret_cast<const float*>(scale_ptr);
  auto* rowwise = reinterpret_cast<uint8_t*>(rowwise_MK);
  auto* columnwise = reinterpret_cast<uint8_t*>(columnwise_KM);
  dispatch_dtype(dtype, [&](auto d) {
    dispatch_fp8_format(fp8_format, [&](auto f) {
      constexpr DType D = decltype(d)::value;
      constexpr Fp8Format F = decltype(f)::value;
      if (columnwise == nullptr) {
        if (M == 1 || stride_row == K * stride_col) {
          parallel_for(M * K, kMinElementsPerThread, num_threads,
                       [&](int64_t, int64_t begin, int64_t end) {
                         cast_sequence<D, F>(x, 0, begin, end, stride_col, scale, rowwise);
                       });
          return;
        }
        const int64_t row_grain = std::max<int64_t>(1, kMinElementsPerThread / K);
        parallel_for(M, row_grain, num_threads, [&](int64_t, int64_t row_begin, int64_t row_end) {
          for (int64_t r = row_begin; r < row_end; ++r) {
            cast_sequence<D, F>(x, r * stride_row, 0, K, stride_col, scale, rowwise + r * K);
          }
        });
        return;
      }
      const int64_t row_tiles = (M + kTile - 1) / kTile;
      const int64_t col_tiles = (K + kTile - 1) / kTile;
      const int64_t tile_grain = std::max<int64_t>(1, kMinElementsPerThread / (kTile * kTile));
      parallel_for(row_tiles * col_tiles, tile_grain, num_threads,
                   [&](int64_t, int64_t tile_begin, int64_t tile_end) {
                     for (int64_t t = tile_begin; t < tile_end; ++t) {
                       const int64_t r0 = (t / col_tiles) * kTile;
                       const int64_t c0 = (t % col_tiles) * kTile;
                       cast_tile<D, F>(x, M, K, stride_row, stride_col, scale, r0,
                                       std::min(M, r0 + kTile), c0, std::min(K, c0 + kTile),
                                       rowwise, columnwise);
                     }
                   });
    });
  });
}

}  // namespace quant_core
