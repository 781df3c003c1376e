// Blockwise FP8 chunks of a quantized reduce-scatter ([Note: FP8 chunk rows] in blocks/_chunks.py):
// the quantize of world_size equal chunks into byte rows (codes, then fp32 scale_invs), with
// optional stochastic rounding and error feedback, and the dequantize-and-sum of received rows.
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

constexpr int64_t kMaxChunkBlock = 128;

// Blocks [block_begin, block_end) of every row (blocks_per_row each): y = x (+ residual), the
// block's power-of-two scale, its codes and scale_inv into the row, the residual updated.
template <DType D, Fp8Format F, bool kStochastic, bool kResidual>
QUANT_CORE_CLONES void quantize_chunk_blocks(const void* x, int64_t chunk, int64_t block_size, int64_t blocks_per_row,
                                             int64_t row_bytes, uint64_t stream, float* residual, uint8_t* out,
                                             int64_t block_begin, int64_t block_end) {
  constexpr float kFmax = F == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
  const int64_t padded = blocks_per_row * block_size;
  float values[kMaxChunkBlock];
  uint8_t codes[kMaxChunkBlock];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t row = b / blocks_per_row, first = (b % blocks_per_row) * block_size;
    const int64_t n = std::min(block_size, chunk - first);  // the rest of the block is padding
    const int64_t base = row * chunk + first;               // x's index of the block's first element
    for (int64_t j = 0; j < n; ++j) {
      float y = load<D>(x, base + j);
      if constexpr (kResidual) y = y + residual[base + j];
      values[j] = y;
    }
    for (int64_t j = n; j < block_size; ++j) values[j] = 0.0f;
    const float amax = bits_to_float(uint32_t(max_key_of_rows(values, 0, 1, block_size)));
    const float scale = amax > 0.0f ? power_of_two(std::min(max_exponent_within(amax, kFmax), 127)) : 1.0f;
    const float scale_inv = 1.0f / scale;
    for (int64_t j = 0; j < block_size; ++j) {
      if constexpr (kStochastic) {
        codes[j] = encode_fp8_stochastic<F>(values[j] * scale, uint32_t(splitmix64(stream, uint64_t(base + j)) >> 48));
      } else {
        codes[j] = encode_fp8<F>(values[j] * scale);
      }
    }
    if constexpr (kResidual) {
      for (int64_t j = 0; j < n; ++j) {
        const float y = values[j];
        const float left = y - decode_fp8<F>(codes[j]) * scale_inv;
        residual[base + j] = std::fabs(y) <= kFloat32Max ? left : 0.0f;  // 0 for NaN and +-Inf
      }
    }
    uint8_t* row_out = out + row * row_bytes;
    std::memcpy(row_out + first, codes, size_t(block_size));
    std::memcpy(row_out + padded + 4 * (b % blocks_per_row), &scale_inv, 4);
  }
}

}  // namespace

void quantize_fp8_chunks(uintptr_t x, int dtype, int64_t world_size, int64_t chunk, int64_t block_size, int fp8_format,
                         bool stochastic_rounding, uint64_t seed, uintptr_t counter, uintptr_t residual, uintptr_t out,
                         int num_threads) {
  const int64_t blocks_per_row = (chunk + block_size - 1) / block_size;
  const int64_t row_bytes = blocks_per_row * (block_size + 4);
  const uint64_t stream = seed + (counter != 0 ? *reinterpret_cast<const uint64_t*>(counter) : 0);
  const void* input = reinterpret_cast<const void*>(x);
  float* residual_ptr = reinterpret_cast<float*>(residual);
  uint8_t* out_ptr = reinterpret_cast<uint8_t*>(out);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / block_size);
  dispatch_dtype(dtype, [&](auto d) {
    dispatch_fp8_format(fp8_format, [&](auto f) {
      constexpr DType D = decltype(d)::value;
      constexpr Fp8Format F = decltype(f)::value;
      auto run = [&](auto stochastic, auto with_residual) {
        constexpr bool kStochastic = decltype(stochastic)::value;
        constexpr bool kResidual = decltype(with_residual)::value;
        parallel_for(world_size * blocks_per_row, grain, num_threads, [&](int64_t, int64_t begin, int64_t end) {
          quantize_chunk_blocks<D, F, kStochastic, kResidual>(input, chunk, block_size, blocks_per_row, row_bytes,
                                                              stream, residual_ptr, out_ptr, begin, end);
        });
      };
      if (stochastic_rounding) {
        residual_ptr != nullptr ? run(std::true_type{}, std::true_type{}) : run(std::true_type{}, std::false_type{});
      } else {
        residual_ptr != nullptr ? run(std::false_type{}, std::true_type{}) : run(std::false_type{}, std::false_type{});
      }
    });
  });
}

namespace {

// Elements [begin, end) of the output: the fp32 sum over rows, in row order, of decode(code) *
// scale_inv of the element's block, divided by world_size with `average`, stored as D.
template <DType D, Fp8Format F>
QUANT_CORE_CLONES void dequantize_sum_range(const uint8_t* received, int64_t world_size, int64_t row_bytes,
                                            int64_t padded, int64_t block_size, bool average, void* out, int64_t begin,
                                            int64_t end) {
  constexpr int64_t kTile = 256;  // a multiple of every block size
  float total[kTile];
  float factors[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t r = 0; r < world_size; ++r) {
      const uint8_t* row = received + r * row_bytes;
      for (int64_t j = 0; j < n; ++j) {
        float scale_inv;
        std::memcpy(&scale_inv, row + padded + 4 * ((t0 + j) / block_size), 4);
        factors[j] = scale_inv;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float v = decode_fp8<F>(row[t0 + j]) * factors[j];
        total[j] = r == 0 ? v : total[j] + v;
      }
    }
    if (average) {
      const float divisor = float(world_size);
      for (int64_t j = 0; j < n; ++j) total[j] = total[j] / divisor;
    }
    for (int64_t j = 0; j < n; ++j) store<D>(out, t0 + j, total[j]);
  }
}

}  // namespace

void dequantize_sum_fp8_chunks(uintptr_t received, int64_t world_size, int64_t chunk, int64_t block_size,
                               int fp8_format, bool average, uintptr_t out, int out_dtype, int num_threads) {
  const int64_t padded = (chunk + block_size - 1) / block_size * block_size;
  const int64_t row_bytes = padded + 4 * (padded / block_size);
  const auto* rows = reinterpret_cast<const uint8_t*>(received);
  void* output = reinterpret_cast<void*>(out);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(world_size, 1));
  dispatch_dtype(out_dtype, [&](auto d) {
    dispatch_fp8_format(fp8_format, [&](auto f) {
      constexpr DType D = decltype(d)::value;
      constexpr Fp8Format F = decltype(f)::value;
      parallel_for(chunk, grain, num_threads, [&](int64_t, int64_t begin, int64_t end) {
        dequantize_sum_range<D, F>(rows, world_size, row_bytes, padded, block_size, average, output, begin, end);
      });
    });
  });
}

}  // namespace quant_core
