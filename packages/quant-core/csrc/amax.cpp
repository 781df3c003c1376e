#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// Largest magnitude key (see [Note: magnitude keys]) of x[offset + i * stride], i in [begin, end).
// kUnitStride makes the stride a compile-time 1, so the contiguous case vectorizes.
// Kept out of line so the loop is vectorized on its own rather than inside a thread's lambda.
template <DType D, bool kUnitStride>
__attribute__((noinline)) typename MagnitudeKey<D>::Bits max_key(const void* x, int64_t offset, int64_t begin,
                                                                  int64_t end, int64_t stride) {
  using Key = MagnitudeKey<D>;
  const auto* bits = static_cast<const typename Key::RawBits*>(x) + offset;
  typename Key::Bits result = 0;
  for (int64_t i = begin; i < end; ++i) {
    const typename Key::Bits key = Key::of(bits[kUnitStride ? i : i * stride]);
    result = key > result ? key : result;
  }
  return result;
}

template <DType D>
typename MagnitudeKey<D>::Bits max_key(const void* x, int64_t offset, int64_t begin, int64_t end, int64_t stride) {
  return stride == 1 ? max_key<D, true>(x, offset, begin, end, 1) : max_key<D, false>(x, offset, begin, end, stride);
}

}  // namespace

void amax(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
          uintptr_t amax_out, int num_threads) {
  const void* x = reinterpret_cast<const void*>(x_MK);
  float result = 0.0f;
  dispatch_dtype(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    using Key = MagnitudeKey<D>;
    std::vector<typename Key::Bits> partial(size_t(std::max(num_threads, 1)), 0);
    if (M == 1 || stride_row == K * stride_col) {
      // The rows form one strided sequence (any contiguous tensor): split it by elements.
      parallel_for(M * K, kMinElementsPerThread, num_threads, [&](int64_t chunk, int64_t begin, int64_t end) {
        partial[size_t(chunk)] = max_key<D>(x, 0, begin, end, stride_col);
      });
    } else {
      const int64_t row_grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(K, 1));
      parallel_for(M, row_grain, num_threads, [&](int64_t chunk, int64_t row_begin, int64_t row_end) {
        typename Key::Bits key = 0;
        for (int64_t r = row_begin; r < row_end; ++r) {
          key = std::max(key, max_key<D>(x, r * stride_row, 0, K, stride_col));
        }
        partial[size_t(chunk)] = key;
      });
    }
    result = Key::to_float(*std::max_element(partial.begin(), partial.end()));
  });
  *reinterpret_cast<float*>(amax_out) = result;
}

void amax_many(const std::vector<uintptr_t>& x_MKs, const std::vector<int>& dtypes, const std::vector<int64_t>& Ms,
               const std::vector<int64_t>& Ks, const std::vector<int64_t>& stride_rows,
               const std::vector<int64_t>& stride_cols, uintptr_t amax_out, int num_threads) {
  for (size_t t = 0; t < x_MKs.size(); ++t) {
    amax(x_MKs[t], dtypes[t], Ms[t], Ks[t], stride_rows[t], stride_cols[t], amax_out + t * sizeof(float),
         num_threads);
  }
}

}  // namespace quant_core

namespace quant_core {
namespace {

// Whether any of x[begin, end) is NaN or +-Inf: its magnitude bits reach the dtype's Inf pattern.
template <DType D>
__attribute__((noinline)) bool any_non_finite(const void* x, int64_t begin, int64_t end) {
  using Key = MagnitudeKey<D>;
  const auto* bits = static_cast<const typename Key::RawBits*>(x);
  typename Key::Bits largest = 0;
  for (int64_t i = begin; i < end; ++i) {
    const typename Key::Bits magnitude = typename Key::Bits(bits[i] & typename Key::RawBits(Key::kAbsMask));
    largest = magnitude > largest ? magnitude : largest;
  }
  return largest >= Key::kInf;
}

}  // namespace

bool has_non_finite(const std::vector<uintptr_t>& tensors, const std::vector<int>& dtypes,
                    const std::vector<int64_t>& numels, int num_threads) {
  const size_t count = numels.size();
  std::vector<int64_t> offsets(count + 1, 0);
  for (size_t t = 0; t < count; ++t) offsets[t + 1] = offsets[t] + numels[t];
  std::vector<char> found(size_t(std::max(num_threads, 1)), 0);
  parallel_for(offsets[count], kMinElementsPerThread, num_threads, [&](int64_t chunk, int64_t begin, int64_t end) {
    size_t t = size_t(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
    for (; t < count && offsets[t] < end && !found[size_t(chunk)]; ++t) {
      const int64_t lo = std::max(begin, offsets[t]) - offsets[t], hi = std::min(end, offsets[t + 1]) - offsets[t];
      dispatch_dtype(dtypes[t], [&](auto d) {
        found[size_t(chunk)] = lo < hi && any_non_finite<decltype(d)::value>(reinterpret_cast<const void*>(tensors[t]), lo, hi);
      });
    }
  });
  return std::any_of(found.begin(), found.end(), [](char f) { return f != 0; });
}

}  // namespace quant_core
