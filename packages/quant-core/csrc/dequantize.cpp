// Dequantize of per-tensor FP8, MXFP8, blockwise FP8 and NVFP4: one row dequantizer, given each
// format's decode and per-block factor. The layouts are those of [Note: block layouts]
// (blocks/_layout.py).
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// Rows [row_begin, row_end) of out (R x C, dtype D) = decode(code) * factor(r, block) for blocks
// of `block_cols` codes along each row; `codes` holds R x C codes, kCodesPerByte to a byte (4-bit
// codes low nibble first; C even then, so each row starts on a byte). A row goes in chunks of
// kChunk codes with a factor per code, so that the loops are long enough to vectorize.
template <DType D, int kCodesPerByte, class Decode, class Factor>
QUANT_CORE_CLONES void dequantize_row_range(const uint8_t* __restrict codes, int64_t C, int64_t block_cols,
                                            void* __restrict out, int64_t row_begin, int64_t row_end,
                                            const Decode& decode, const Factor& factor) {
  using Out = std::conditional_t<D == DType::kFloat32, float, uint16_t>;
  constexpr int64_t kChunk = 256;  // a multiple of every block size
  float factors[kChunk];
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
      const int64_t n = std::min(kChunk, C - c0);
      for (int64_t j0 = 0; j0 < n; j0 += block_cols) {
        const float f = factor(r, (c0 + j0) / block_cols);
        for (int64_t j = j0; j < std::min(n, j0 + block_cols); ++j) factors[j] = f;
      }
      const uint8_t* __restrict in = codes + (r * C + c0) / kCodesPerByte;
      Out* __restrict dst = static_cast<Out*>(out) + r * C + c0;
      if constexpr (kCodesPerByte == 1) {
        for (int64_t c = 0; c < n; ++c) store<D>(dst, c, decode(in[c]) * factors[c]);
      } else {
        for (int64_t b = 0; b < n / 2; ++b) {
          store<D>(dst, 2 * b, decode(uint8_t(in[b] & 0xF)) * factors[2 * b]);
          store<D>(dst, 2 * b + 1, decode(uint8_t(in[b] >> 4)) * factors[2 * b + 1]);
        }
      }
    }
  }
}

// Dequantizes all R rows with dequantize_row_range, rows split across threads.
template <int kCodesPerByte, class Decode, class Factor>
void dequantize_rows(const uint8_t* codes, int64_t R, int64_t C, int64_t block_cols, int out_dtype, uintptr_t out_ptr,
                     int num_threads, Decode decode, Factor factor) {
  void* out = reinterpret_cast<void*>(out_ptr);
  dispatch_dtype(out_dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const int64_t row_grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(C, 1));
    parallel_for(R, row_grain, num_threads, [&](int64_t, int64_t row_begin, int64_t row_end) {
      dequantize_row_range<D, kCodesPerByte>(codes, C, block_cols, out, row_begin, row_end, decode, factor);
    });
  });
}

}  // namespace

void dequantize_fp8(uintptr_t data, int fp8_format, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out,
                    int out_dtype, int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const float factor = *reinterpret_cast<const float*>(scale_inv);
  dispatch_fp8_format(fp8_format, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    dequantize_rows<1>(
        codes, R, C, std::max<int64_t>(C, 1), out_dtype, out, num_threads,
        [](uint8_t code) { return decode_fp8<F>(code); }, [factor](int64_t, int64_t) { return factor; });
  });
}

void dequantize_mxfp8(uintptr_t data, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out, int out_dtype,
                      int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const uint8_t*>(scale_inv);
  const int64_t Cb = (C + 31) / 32;
  dequantize_rows<1>(
      codes, R, C, 32, out_dtype, out, num_threads, [](uint8_t code) { return decode_fp8<Fp8Format::kE4M3>(code); },
      [scales, Cb](int64_t r, int64_t block) { return power_of_two(int(scales[r * Cb + block]) - 127); });
}

void dequantize_fp8_blockwise(uintptr_t data, int fp8_format, int64_t R, int64_t C, int64_t block_rows,
                              uintptr_t scale_inv, uintptr_t out, int out_dtype, int num_threads) {
  const auto* codes = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const float*>(scale_inv);
  const int64_t Cb = (C + 127) / 128;
  dispatch_fp8_format(fp8_format, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    dequantize_rows<1>(
        codes, R, C, 128, out_dtype, out, num_threads, [](uint8_t code) { return decode_fp8<F>(code); },
        [scales, Cb, block_rows](int64_t r, int64_t block) { return scales[(r / block_rows) * Cb + block]; });
  });
}

void dequantize_nvfp4(uintptr_t data, int64_t R, int64_t C, int64_t block_rows, uintptr_t scale_inv,
                      uintptr_t global_amax, uintptr_t out, int out_dtype, int num_threads) {
  const auto* packed = reinterpret_cast<const uint8_t*>(data);
  const auto* scales = reinterpret_cast<const uint8_t*>(scale_inv);
  const float S = nvfp4_tensor_scale(*reinterpret_cast<const float*>(global_amax));
  const int64_t Cb = (C + 15) / 16;
  dequantize_rows<2>(
      packed, R, C, 16, out_dtype, out, num_threads, [](uint8_t code) { return decode_e2m1(code); },
      [scales, Cb, block_rows, S](int64_t r, int64_t block) {
        return decode_fp8<Fp8Format::kE4M3>(scales[(r / block_rows) * Cb + block]) / S;
      });
}

}  // namespace quant_core
