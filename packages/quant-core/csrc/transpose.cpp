// The lossless transposes: one-byte codes (FP8) and packed 4-bit codes (NVFP4).
#include "common.h"
#include "kernels.h"

namespace quant_core {

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

}  // namespace quant_core
