// The 16 x 16 random Hadamard transform in fp32 ([Note: NVFP4 random Hadamard transform] in
// nvfp4/_nvfp4.py): hadamard.cpp's kernels and NVFP4's transformed columnwise usage
// (quantize_blocks.cpp). An unnamed namespace, as for each file's own helpers: every kernel file
// inlines its own copies.
#pragma once

#include "common.h"

namespace quant_core {
namespace {

// The 16 random signs of the Hadamard transform of `seed` ([Note: counter RNG]).
struct HadamardSigns {
  explicit HadamardSigns(uint64_t seed) {
    for (int j = 0; j < 16; ++j) values[j] = (splitmix64(seed, uint64_t(j)) >> 63) ? -1.0f : 1.0f;
  }
  float values[16];
};

// v <- (1/4) H_16 D v in place, in fp32: signs, the 4-stage butterfly (stage h adds and subtracts
// elements h apart), times 1/4; the mirror of nvfp4/_hadamard.py's hadamard_transform_16_reference.
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

// hadamard_16 of every column j < w of a 16-row tile (row i at tile + i * row_stride), in place:
// the same operations on each element in the same order, with the loops over columns innermost
// so that they vectorize.
inline void hadamard_16_columns(float* __restrict tile, int64_t row_stride, int64_t w, const float* signs) {
  for (int i = 0; i < 16; ++i)
    for (int64_t j = 0; j < w; ++j) tile[i * row_stride + j] *= signs[i];
  for (int h = 1; h < 16; h *= 2) {
    for (int i0 = 0; i0 < 16; i0 += 2 * h) {
      for (int i = i0; i < i0 + h; ++i) {
        float* __restrict upper = tile + i * row_stride;
        float* __restrict lower = tile + (i + h) * row_stride;
        for (int64_t j = 0; j < w; ++j) {
          const float a = upper[j], b = lower[j];
          upper[j] = a + b;
          lower[j] = a - b;
        }
      }
    }
  }
  for (int i = 0; i < 16; ++i)
    for (int64_t j = 0; j < w; ++j) tile[i * row_stride + j] *= 0.25f;
}

}  // namespace
}  // namespace quant_core
