// Entry points of quant_core._C. Every one is called with the GIL released; see common.h for
// the argument legend.
#pragma once

#include <cstdint>
#include <vector>

namespace quant_core {

// Writes max |x| over the finite elements of x_MK (0 if there are none) to *amax_out (fp32).
void amax(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
          uintptr_t amax_out, int num_threads);
// amax of many tensors in one call: amax_out[t] (fp32) is the amax of tensor t, the (M, K) view
// x_MKs[t] of dtype dtypes[t] read through (stride_rows[t], stride_cols[t]). Tensors run one after
// another, each split across threads as `amax` splits it.
void amax_many(const std::vector<uintptr_t>& x_MKs, const std::vector<int>& dtypes, const std::vector<int64_t>& Ms,
               const std::vector<int64_t>& Ks, const std::vector<int64_t>& stride_rows,
               const std::vector<int64_t>& stride_cols, uintptr_t amax_out, int num_threads);

// Per-tensor FP8 cast with a given fp32 scale (read from *scale): code = fp8(x * scale).
// Writes rowwise_MK (contiguous, M x K) and/or columnwise_KM (contiguous, K x M, the transpose)
// in one pass over x; a zero pointer skips that output.
void cast_to_fp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row,
                 int64_t stride_col, uintptr_t scale, int fp8_format, uintptr_t rowwise_MK,
                 uintptr_t columnwise_KM, int num_threads);

// Per-tensor FP8 scales (scale.cpp), fp32 throughout. fp8_scale: scale[i] and scale_inv[i] of
// amax[i] for i < n. delayed_fp8_scale: the scale of the history's max (or, with most_recent, its
// entry 0), then the history (`length` entries, newest first) shifts one older and *amax is written
// at index 0.
void fp8_scale(uintptr_t amax, int64_t n, float fmax, int margin, bool power_2_scales, uintptr_t scale,
               uintptr_t scale_inv);
void delayed_fp8_scale(uintptr_t amax_history, int64_t length, uintptr_t amax, float fmax, int margin,
                       bool power_2_scales, bool most_recent, uintptr_t scale, uintptr_t scale_inv);

// Block-scaled quantize (quantize_blocks.cpp): outputs as in [Note: block layouts]; a zero pointer
// skips a usage. Scales: MXFP8 E8M0 bytes, blockwise FP8 fp32 scale_inv, NVFP4 E4M3 bytes.
void quantize_mxfp8(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                    uintptr_t rowwise_data, uintptr_t rowwise_scale, uintptr_t columnwise_data,
                    uintptr_t columnwise_scale, int num_threads);
void quantize_fp8_blockwise(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                            int64_t block_rows, int fp8_format, bool power_2_scales, uintptr_t rowwise_data,
                            uintptr_t rowwise_scale, uintptr_t columnwise_data, uintptr_t columnwise_scale,
                            int num_threads);
// NVFP4: `global_amax` points at the fp32 amax S is computed from (`nvfp4_tensor_scale`),
// `columnwise_amax` at the columnwise usage's,
// `seed` at the int64 stochastic-rounding seed (read as its uint64 bits, and only with
// stochastic_rounding): tensors, so callers never sync. With `hadamard` the 1 x 16 columnwise
// usage is T(x^T) with hadamard_seed's signs (M a multiple of 16; [Note: NVFP4 random Hadamard
// transform] in _nvfp4.py).
void quantize_nvfp4(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                    int64_t block_rows, uintptr_t global_amax, bool stochastic_rounding, uintptr_t seed,
                    uintptr_t columnwise_amax, bool hadamard, uint64_t hadamard_seed, uintptr_t rowwise_data,
                    uintptr_t rowwise_scale, uintptr_t columnwise_data, uintptr_t columnwise_scale, int num_threads);

// Blockwise FP8 chunks ([Note: FP8 chunk rows] in blocks/_chunks.py; chunks.cpp): x holds world_size
// chunks of `chunk` elements, out is (world_size, row bytes) uint8; with stochastic_rounding the
// stream is seed + *counter (counter 0: seed alone); a nonzero `residual` (fp32, x's numel) is added
// to x first and updated in place. The dequantize-and-sum writes `chunk` elements of out_dtype.
void quantize_fp8_chunks(uintptr_t x, int dtype, int64_t world_size, int64_t chunk, int64_t block_size, int fp8_format,
                         bool stochastic_rounding, uint64_t seed, uintptr_t counter, uintptr_t residual, uintptr_t out,
                         int num_threads);
void dequantize_sum_fp8_chunks(uintptr_t received, int64_t world_size, int64_t chunk, int64_t block_size,
                               int fp8_format, bool average, uintptr_t out, int out_dtype, int num_threads);

// Dequantize R x C codes (contiguous; NVFP4 packed two per byte) into an R x C output of out_dtype
// (dequantize.cpp).
void dequantize_fp8(uintptr_t data, int fp8_format, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out,
                    int out_dtype, int num_threads);
void dequantize_mxfp8(uintptr_t data, int64_t R, int64_t C, uintptr_t scale_inv, uintptr_t out, int out_dtype,
                      int num_threads);
void dequantize_fp8_blockwise(uintptr_t data, int fp8_format, int64_t R, int64_t C, int64_t block_rows,
                              uintptr_t scale_inv, uintptr_t out, int out_dtype, int num_threads);
void dequantize_nvfp4(uintptr_t data, int64_t R, int64_t C, int64_t block_rows, uintptr_t scale_inv,
                      uintptr_t global_amax, uintptr_t out, int out_dtype, int num_threads);

// Lossless transposes (transpose.cpp): one-byte codes read through strides into a contiguous C x R
// output, and packed 4-bit codes (R x C codes, R even) into C x R codes packed along R.
void transpose_bytes(uintptr_t src, int64_t R, int64_t C, int64_t stride_row, int64_t stride_col, uintptr_t dst,
                     int num_threads);
void transpose_nvfp4(uintptr_t src, int64_t R, int64_t C, uintptr_t dst, int num_threads);

// 16 x 16 random Hadamard transform along K (a multiple of 16) into a contiguous output of x's dtype
// (hadamard.cpp).
void hadamard_transform_16(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                           uint64_t seed, uintptr_t out_MK, int num_threads);
// amax_out[0] = max |x| and amax_out[1] = max |T(x^T)| over the finite elements (fp32), T the
// transform along M in runs of 16 (a partial last run zero-padded), one read of x.
void hadamard_amaxes(uintptr_t x_MK, int dtype, int64_t M, int64_t K, int64_t stride_row, int64_t stride_col,
                     uint64_t seed, uintptr_t amax_out, int num_threads);

// Whether any element of the contiguous tensors (dtype codes as for amax; numels[t] elements
// each) is NaN or +-Inf. One pass over all of them, split across threads (amax.cpp).
bool has_non_finite(const std::vector<uintptr_t>& tensors, const std::vector<int>& dtypes,
                    const std::vector<int64_t>& numels, int num_threads);

// The fp32 scalars of one Adam step (quant_core._adam.AdamScalars, [Note: Adam numerics]).
struct AdamScalars {
  float decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps,
      step_size;
};

// One Adam step over many tensors (adam.cpp, [Note: Adam numerics]): params[t] (param_dtype: fp32,
// bf16 or fp16; bf16/fp16 updated in fp32 and stored rounded to nearest even, or, with `counters`,
// bf16 rounded stochastically), grads[t] (grad_dtype) and the moments (moment codes: 0 fp32, 1
// bf16, 3 E4M3, 4 E5M2) each hold numels[t] contiguous elements; params and moments are updated
// in place. A nonzero `found_inf` (fp32) that holds a nonzero value skips the step: nothing is
// written but amax_out, which then holds max |p| of the params as they are. Otherwise each
// tensor's scalars are AdamScalars.of (float64, rounded once to fp32) of its step count (the fp32
// at steps[t], incremented by one) and lr: the scalar at `lr` (lr_dtype: a DType code, or 3 for
// float64) when nonzero, else hyperparameters[0]; hyperparameters are (lr, beta1, beta2, eps,
// weight_decay). Non-empty `outs` (out_dtype, contiguous) receive each updated parameter rounded
// to nearest. A nonzero amax_out receives max |p| of each updated parameter (fp32, one per tensor).
// Non-empty `counters` (one int64 per tensor) round the bf16 params stochastically with the
// stream seed + *counters[t], then increment each counter ([Note: Adam stochastic rounding]). FP8
// moments ([Note: fp8 moments in the Adam pass]): row r of `scale_invs` (count pointers per fp8
// moment list, exp_avgs' first) holds 0-d fp32 scale_invs to decode with, then set to 1 / the
// scale of the amax at row r of the (rows, count) fp32 `moment_amaxes`, which the codes are
// encoded with.
void adam_step(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
               const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
               const std::vector<uintptr_t>& steps, const std::vector<uintptr_t>& outs,
               const std::vector<int64_t>& numels, int param_dtype, int grad_dtype, int exp_avg_dtype,
               int exp_avg_sq_dtype, int out_dtype, uintptr_t found_inf, uintptr_t lr, int lr_dtype,
               const std::vector<double>& hyperparameters, bool adam_w_mode, uintptr_t amax_out,
               const std::vector<uintptr_t>& counters, int64_t seed, const std::vector<uintptr_t>& scale_invs,
               uintptr_t moment_amaxes, int num_threads);

// The amaxes of the fp8 moments adam_step would write (adam.cpp), writing nothing: amax_out
// (rows, count) fp32, a row per fp8 moment list (exp_avgs' first). Arguments as for adam_step;
// params (param_dtype) are read only with L2 weight decay.
void adam_moment_amaxes(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                        const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
                        const std::vector<int64_t>& numels, int param_dtype, int grad_dtype, int exp_avg_dtype,
                        int exp_avg_sq_dtype, const AdamScalars& scalars, const std::vector<uintptr_t>& scale_invs,
                        uintptr_t amax_out, int num_threads);

}  // namespace quant_core
