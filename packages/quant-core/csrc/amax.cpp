#include <cmath>

#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// max |x[offset + i * stride]| over the finite elements, i in [begin, end).
template <DType D>
float amax_sequence(const void* x, int64_t offset, int64_t begin, int64_t end, int64_t stride) {
  float result = 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    const float magnitude = std::fabs(load<D>(x, offset + i * stride));
    // NaN fails the comparison and Inf exceeds the bound: both count as 0.
    result = std::max(result, magnitude <= 3.4028234663852886e+38f ? magnitude : 0.0f);
  }
  return result;
}

}  // namespace

void amax(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
          uintptr_t amax_out, int num_threads) {
  const void* x = reinterpret_cast<const void*>(x_MK);
  std::vector<float> partial(size_t(std::max(num_threads, 1)), 0.0f);
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    if (M == 1 || stride_row == K * stride_col) {
      // The rows form one strided sequence (any contiguous tensor): split it by elements.
      parallel_for(M * K, kMinElementsPerThread, num_threads,
                   [&](int64_t chunk, int64_t begin, int64_t end) {
                     partial[size_t(chunk)] = amax_sequence<D>(x, 0, begin, end, stride_col);
                   });
      return;
    }
    const int64_t row_grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(K, 1));
    parallel_for(M, row_grain, num_threads, [&](int64_t chunk, int64_t row_begin, int64_t row_end) {
      float result = 0.0f;
      for (int64_t r = row_begin; r < row_end; ++r) {
        result = std::max(result, amax_sequence<D>(x, r * stride_row, 0, K, stride_col));
      }
      partial[size_t(chunk)] = result;
    });
  });
  float result = 0.0f;
  for (float value : partial) result = std::max(result, value);
  *reinterpret_cast<float*>(amax_out) = result;
}

}  // namespace quant_core
