// Per-tensor FP8 cast: rowwise and columnwise (transposed) codes in one pass over the input.
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// Tile of the transposing path: 64 rows x 256 columns of codes (16 KiB) stay in L1 while being
// transposed; 256 columns make each input row segment a long contiguous read.
constexpr int64_t kTileRows = 64;
constexpr int64_t kTileCols = 256;

// out[i] = fp8(x[offset + i * stride] * scale) for i in [begin, end). kUnitStride makes the
// stride a compile-time 1, so the contiguous case vectorizes.
template <DType D, Fp8Format F, bool kUnitStride>
QUANT_CORE_CLONES void cast_sequence(const void* __restrict x, int64_t offset, int64_t begin, int64_t end, int64_t stride, float scale,
                   uint8_t* __restrict out) {
  for (int64_t i = begin; i < end; ++i) {
    out[i] = encode_fp8<F>(load<D>(x, offset + (kUnitStride ? i : i * stride)) * scale);
  }
}

template <DType D, Fp8Format F>
void cast_sequence(const void* x, int64_t offset, int64_t begin, int64_t end, int64_t stride, float scale,
                   uint8_t* out) {
  if (stride == 1) {
    cast_sequence<D, F, true>(x, offset, begin, end, 1, scale, out);
  } else {
    cast_sequence<D, F, false>(x, offset, begin, end, stride, scale, out);
  }
}

// Casts rows [r0, r1) x cols [c0, c1): each row segment is encoded into a small buffer (the
// vectorized loop), copied to the rowwise output, and scattered into a transposed tile whose
// rows are then written to the columnwise output in contiguous runs.
template <DType D, Fp8Format F>
QUANT_CORE_CLONES void cast_tile(const void* x, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col, float scale, int64_t r0,
               int64_t r1, int64_t c0, int64_t c1, uint8_t* rowwise_MK, uint8_t* columnwise_KM) {
  uint8_t tile_KM[kTileCols][kTileRows];
  uint8_t row_codes[kTileCols];
  const int64_t width = c1 - c0;
  for (int64_t r = r0; r < r1; ++r) {
    cast_sequence<D, F>(x, r * stride_row + c0 * stride_col, 0, width, stride_col, scale, row_codes);
    if (rowwise_MK != nullptr) std::memcpy(rowwise_MK + r * K + c0, row_codes, size_t(width));
    for (int64_t c = 0; c < width; ++c) tile_KM[c][r - r0] = row_codes[c];
  }
  for (int64_t c = 0; c < width; ++c) {
    std::memcpy(columnwise_KM + (c0 + c) * M + r0, tile_KM[c], size_t(r1 - r0));
  }
}

}  // namespace

void cast_to_fp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                 uintptr_t scale_ptr, int fp8_format, uintptr_t rowwise_MK, uintptr_t columnwise_KM,
                 int num_threads) {
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
          // The rows form one strided sequence (any contiguous tensor): split it by elements.
          parallel_for(M * K, kMinElementsPerThread, num_threads, [&](int64_t, int64_t begin, int64_t end) {
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
      parallel_for_tiles(M, K, kTileRows, kTileCols, num_threads, [&](int64_t r0, int64_t c0, int64_t h, int64_t w) {
        cast_tile<D, F>(x, M, K, stride_row, stride_col, scale, r0, r0 + h, c0, c0 + w, rowwise, columnwise);
      });
    });
  });
}

}  // namespace quant_core
