// Entry points of quant_core._C. Every one is called with the GIL released; see common.h for
// the argument legend.
#pragma once

#include <cstdint>

namespace quant_core {

// Writes max |x| over the finite elements of x_MK (0 if there are none) to *amax_out (fp32).
void amax(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
          uintptr_t amax_out, int num_threads);

// Per-tensor FP8 cast with a given fp32 scale (read from *scale): code = fp8(x * scale).
// Writes rowwise_MK (contiguous, M x K) and/or columnwise_KM (contiguous, K x M, the transpose)
// in one pass over x; a zero pointer skips that output.
void cast_to_fp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row,
                 int64_t stride_col, uintptr_t scale, int fp8_format, uintptr_t rowwise_MK,
                 uintptr_t columnwise_KM, int num_threads);

}  // namespace quant_core
