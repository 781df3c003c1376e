"""Triton kernels of NVFP4 (`_nvfp4.py`): quantize (1 x 16, 16 x 16, stochastic rounding), dequantize,
the lossless nibble transpose and the 16 x 16 random Hadamard transform.

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); a program
quantizes one TILE_M x TILE_K tile (multiples of 16) and writes every usage from that one read
([Note: block layouts] in `blocks/_layout.py`). Codes are 4-bit E2M1 values held as int32 until packed
two per byte along the last dim of their output (even element in the low nibble); `*_MB` holds
one value per 1 x 16 run of a row, `*_BK` per 16 x 1 run of a column, `*_T` per 16 x 16 tile.
The register-blocks kernel holds its tile as `*_TGHK` (T, G, H, TILE_K): element (t, g, h, k) is
row 16 g + T h + t and column k of the tile ([Note: NVFP4 register blocks]).
Stochastic rounding draws element i's bits from splitmix64(seed, i) with i = m * K + k for
rowwise (and 16 x 16) codes and M * K + k * M + m for 1 x 16 columnwise codes
([Note: counter RNG]). With the Hadamard transform ([Note: NVFP4 random Hadamard transform] in
`_nvfp4.py`) the columnwise runs are taken out of the tile as `*_NP` (N = TILE_K * G runs of
P = 16 positions along M: run (k, g) holds rows 16 g .. 16 g + 15 of column k), transformed,
then scaled and packed like rowwise blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._layout import quantize_buffers
from quant_core.fp8._triton_scale import scale_of
from quant_core.nvfp4._hadamard import HadamardArgs
from quant_core.nvfp4._nvfp4 import (
    DequantizeNvfp4Args,
    DequantizeNvfp4PairArgs,
    Nvfp4GemmOutputArgs,
    QuantizeNvfp4Args,
    TransposeNvfp4Args,
)
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
    EXACT,
    HARDWARE_FP8,
    Tiles,
    as_bytes,
    decode_fp8,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_fp8,
    finite_abs,
    from_int32_halves,
    int32_halves,
    seed_tensor,
    splitmix64,
    store_bytes,
    store_values,
)


@dataclass(frozen=True)
class BlockTiles:
    """Tile of `_quantize_nvfp4_register_blocks_kernel` ([Note: NVFP4 register blocks])."""

    tile_m: int
    """Rows of x per program (a multiple of 16)."""
    tile_k: int
    """Columns per program (a multiple of 16)."""
    num_warps: int
    """Warps per program."""
    rows_per_thread: int
    """T: the rows of each 16-row run that one thread holds (2, 4, 8 or 16)."""


# Kernel choices, tuned on an H100: `python3 scripts/sweep_nvfp4.py` times every variant and tile
# at bf16 8192^2 (docs/benchmarks.md). Quantize: "register_blocks" (the tiles below) or
# "original" (`_quantize_nvfp4_kernel`, QUANTIZE_TILES); dequantize: "pairs"
# (DEQUANTIZE_PAIRS_TILES) or "elementwise" (`_dequantize_nvfp4_kernel`, DEQUANTIZE_TILES).
QUANTIZE_VARIANT = "register_blocks"
QUANTIZE_1X16_TILES = BlockTiles(64, 64, 4, 4)  # 1 x 16 with columnwise
QUANTIZE_ROWWISE_TILES = BlockTiles(64, 128, 4, 8)  # 1 x 16 rowwise only
QUANTIZE_16X16_TILES = BlockTiles(64, 64, 4, 4)
QUANTIZE_STOCHASTIC_TILES = BlockTiles(32, 64, 2, 4)
# With the Hadamard transform the columnwise runs hold more live values (179 registers at 64 x 64):
# 291.9 vs 367.4 us at 8192^2 (`scripts/sweep_nvfp4.py 1x16-both-rht`). Stochastic rounding with
# the transform keeps QUANTIZE_STOCHASTIC_TILES (not swept).
QUANTIZE_HADAMARD_TILES = BlockTiles(32, 128, 4, 4)
QUANTIZE_TILES = Tiles(32, 64, 4)
DEQUANTIZE_VARIANT = "pairs"
DEQUANTIZE_PAIRS_TILES = Tiles(8, 512, 4)
DEQUANTIZE_TILES = Tiles(8, 512, 4)
# nvfp4_gemm_output: an elementwise pass, tile_k elements per program (`sweep_nvfp4.py gemm-output`:
# 1024-8192 elements with 4 or 8 warps all within 1%, ~100% of copy bandwidth).
GEMM_OUTPUT_TILES = Tiles(1, 4096, 8)
TRANSPOSE_TILES = Tiles(128, 256, 8)
HADAMARD_TILES = Tiles(16, 128, 4)
# The amaxes of x and of T(x^T): swept, no tile more than 2% faster (93.8-100.4 us at 8192^2).
HADAMARD_AMAXES_TILES = Tiles(64, 64, 4)


@triton.jit
def tensor_scale(amax_ptr):
    """S = `nvfp4_tensor_scale` of the fp32 amax at amax_ptr: 448 * 6 / amax (1 unless amax > 0),
    clamped to the largest fp32; each program computes it rather than the caller (no launches)."""
    S, _ = scale_of(tl.load(amax_ptr), 2688.0, 1.0, False)
    return S


@triton.jit
def _nvfp4_scale(amax, S, HARDWARE: tl.constexpr):
    """(enc, s) of blocks: s = e4m3(amax / 6 * S) as a uint8 code, enc = S / fp32(s) (0 where s is 0)."""
    s = encode_fp8(tl.div_rn(amax, 6.0) * S, True, HARDWARE)
    s_f32 = decode_fp8(s, True, HARDWARE)
    enc = tl.where(s_f32 > 0, tl.minimum(tl.div_rn(S, s_f32), 3.4028234663852886e38), 0.0)
    return enc, s


@triton.jit
def _encode(v, enc, index, seed, STOCHASTIC: tl.constexpr):
    """E2M1 codes of v = x * enc (all-zero where enc is 0, i.e. the block's s is 0)."""
    codes = encode_e2m1_stochastic(v, (splitmix64(seed, index) >> 40).to(tl.int32)) if STOCHASTIC else encode_e2m1(v)
    return tl.where(enc == 0, 0, codes)


@triton.jit
def _pack_pairs(codes):
    """(R, C) 4-bit codes -> (R, C/2) bytes, the even element in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1] // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    seed_ptr,
    rowwise_ptr,
    rowwise_scale_ptr,
    columnwise_ptr,
    columnwise_scale_ptr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    TWO_D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """One tile of x: packed codes and E4M3 scales in every usage asked for (runtime flags)."""
    col_tiles = tl.cdiv(K, TILE_K)
    tile_m = tl.program_id(0) // col_tiles
    tile_k = tl.program_id(0) % col_tiles
    rows = (tile_m * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    x_MK = x_MK.to(tl.float32)
    magnitude_MK = finite_abs(x_MK)
    S = tensor_scale(amax_ptr)
    seed = tl.load(seed_ptr).to(tl.uint64, bitcast=True) if STOCHASTIC else 0
    Mb = tl.cdiv(M, 16)
    Kb = tl.cdiv(K, 16)
    # Packed pairs of the tile in either layout, and the masks of their stores.
    pair_cols = tile_k * (TILE_K // 2) + tl.arange(0, TILE_K // 2)
    pair_rows = tile_m * (TILE_M // 2) + tl.arange(0, TILE_M // 2)
    rowwise_offsets = (rows * (K // 2))[:, None] + pair_cols[None, :]
    rowwise_mask = (rows < M)[:, None] & (pair_cols < K // 2)[None, :]
    columnwise_offsets = (cols * (M // 2))[:, None] + pair_rows[None, :]
    columnwise_mask = (cols < K)[:, None] & (pair_rows < M // 2)[None, :]
    block_rows = tile_m * (TILE_M // 16) + tl.arange(0, TILE_M // 16)
    block_cols = tile_k * (TILE_K // 16) + tl.arange(0, TILE_K // 16)
    rowwise_index_MK = ((rows * K)[:, None] + cols[None, :]).to(tl.uint64)
    if TWO_D:
        tiles = tl.reshape(magnitude_MK, (TILE_M // 16, 16, TILE_K // 16, 16))
        amax_T = tl.max(tl.max(tiles, axis=3), axis=1)
        enc_T, s_T = _nvfp4_scale(amax_T, S, HARDWARE)
        enc_MK = tl.reshape(
            tl.broadcast_to(enc_T[:, None, :, None], (TILE_M // 16, 16, TILE_K // 16, 16)), (TILE_M, TILE_K)
        )
        codes_MK = _encode(x_MK * enc_MK, enc_MK, rowwise_index_MK, seed, STOCHASTIC)
        scale_mask_T = (block_rows < Mb)[:, None] & (block_cols < Kb)[None, :]
        if ROWWISE:
            tl.store(rowwise_ptr + rowwise_offsets, _pack_pairs(codes_MK), mask=rowwise_mask)
            store_bytes(rowwise_scale_ptr, (block_rows * Kb)[:, None] + block_cols[None, :], s_T, scale_mask_T)
        if COLUMNWISE:
            tl.store(columnwise_ptr + columnwise_offsets, _pack_pairs(tl.trans(codes_MK)), mask=columnwise_mask)
            scale_offsets_T = block_rows[:, None] + (block_cols * Mb)[None, :]
            store_bytes(columnwise_scale_ptr, scale_offsets_T, s_T, scale_mask_T)
    else:
        if ROWWISE:
            amax_MB = tl.max(tl.reshape(magnitude_MK, (TILE_M, TILE_K // 16, 16)), axis=2)
            enc_MB, s_MB = _nvfp4_scale(amax_MB, S, HARDWARE)
            enc_MK = tl.reshape(tl.broadcast_to(enc_MB[:, :, None], (TILE_M, TILE_K // 16, 16)), (TILE_M, TILE_K))
            codes_MK = _encode(x_MK * enc_MK, enc_MK, rowwise_index_MK, seed, STOCHASTIC)
            tl.store(rowwise_ptr + rowwise_offsets, _pack_pairs(codes_MK), mask=rowwise_mask)
            scale_mask_MB = (rows < M)[:, None] & (block_cols < Kb)[None, :]
            store_bytes(rowwise_scale_ptr, (rows * Kb)[:, None] + block_cols[None, :], s_MB, scale_mask_MB)
        if COLUMNWISE:
            amax_BK = tl.max(tl.reshape(magnitude_MK, (TILE_M // 16, 16, TILE_K)), axis=1)
            enc_BK, s_BK = _nvfp4_scale(amax_BK, S, HARDWARE)
            enc_MK = tl.reshape(tl.broadcast_to(enc_BK[:, None, :], (TILE_M // 16, 16, TILE_K)), (TILE_M, TILE_K))
            # Columnwise counters continue after x's M * K elements, in x^T's row-major order.
            # (rows * 0 + M) * K: M * K in int64 whether or not M was specialized to a constant.
            index_MK = (((rows * 0 + M) * K + rows)[:, None] + (cols * M)[None, :]).to(tl.uint64)
            codes_MK = _encode(x_MK * enc_MK, enc_MK, index_MK, seed, STOCHASTIC)
            tl.store(columnwise_ptr + columnwise_offsets, _pack_pairs(tl.trans(codes_MK)), mask=columnwise_mask)
            scale_mask_BK = (block_rows < Mb)[:, None] & (cols < K)[None, :]
            store_bytes(columnwise_scale_ptr, block_rows[:, None] + (cols * Mb)[None, :], s_BK, scale_mask_BK)


# [Note: NVFP4 register blocks] `_quantize_nvfp4_kernel` reshapes its tile into blocks and packs
# pairs with reshape + split: the compiler moves much of the tile through shared memory, and each
# 16 x 1 block, reduced across threads, is scaled and encoded again on every thread holding a copy.
# This kernel loads its tile as 4-D (T, G, H, TILE_K), element (t, g, h, k) at row 16 g + T h + t:
# Triton's default layout gives the contiguous k the 16-byte vectors and the first lanes, then H,
# then G the other lanes and the warps, and leaves T in each thread's registers once
# TILE_K / vector * H * G covers the program's threads. A thread then holds T rows of a 16-row
# run (16 x 1 blocks reduce in registers plus log2(H) shuffles; the columnwise pairs are in its
# registers) and half of each 1 x 16 block (one shuffle). E2M1 is encoded by a magic addition
# ([Note: E2M1 by magic addition]), stochastic rounding by a floor and one integer compare.
# Instructions per element in sm_90 SASS (Triton 3.9, division slow paths not counted), this
# kernel at 128 x 64, T = 8 (stochastic: 64 x 64, T = 4) against the original at 32 x 64:
# 1 x 16 both usages 45 / 127 (128 / 96 registers), 1 x 16 rowwise 25 / 50, 16 x 16 rowwise
# 22 / 52, 16 x 16 both 24, stochastic 1 x 16 both 120 / 215. The original ran at 17% of copy
# bandwidth on the H100 (1 x 16 both, 408 us at bf16 8192^2).


@triton.jit
def _sign_bits(v):
    """The top four bits of fp32 v (the sign as bit 3), NaN read as +inf (IEEE minNum)."""
    return tl.minimum(v, float("inf")).to(tl.int32, bitcast=True) >> 28


@triton.jit
def _encode_scaled(v, sign_mask):
    """E2M1 codes (int32) of fp32 v = x * enc, exactly `encode_e2m1`'s, with the sign kept where
    `sign_mask` is 8 (0 where the block's s is 0: its codes are all 0).

    [Note: E2M1 by magic addition] a + 2^22 rounds a = |v| to a multiple of 0.5 (the spacing of
    fp32 in [2^22, 2^23)), to nearest even, in one IEEE addition, so the low bits of the sum count
    halves: codes 0-4 for a < 2. Likewise + 2^23 counts units for 2 <= a < 4 (codes 2 + count) and
    + 2^24 counts twos above (codes 4 + count). a is clamped to 6 first (saturation), so the magic
    number is 2^(22 + a's exponent), at least 2^22, and 2 * (its exponent field - 149) is the code
    offset. Ties go to the even count, which is the even code, as `encode_e2m1`'s thresholds
    (> 0.25, >= 0.75, ...) do. IEEE maxNum/minNum drop a NaN: max(|v|, 0) is 0 and min(v, inf) is
    +inf, so NaN encodes as 0; -0 keeps its sign (code 0x8).
    """
    a = tl.minimum(tl.maximum(tl.abs(v), 0.0), 6.0)
    magic = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + (22 << 23), 0x4A800000)
    code = (a + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic - 298 + (magic >> 22)
    return code | (_sign_bits(v) & sign_mask)


@triton.jit
def _encode_stochastic(v, random24, sign_mask):
    """`encode_e2m1_stochastic(v, random24)` with `_encode_scaled`'s sign mask, in fewer steps: with
    the step 0.5, 1 or 2 of |v|'s range, |v| / step is exact, its floor counts the steps of the
    lower neighbour (code = count + 0, 2 or 4) and the fraction above decides the rounding up."""
    a = tl.minimum(tl.maximum(tl.abs(v), 0.0), 8.0)  # NaN -> 0; from 6 up every draw saturates
    small = a < 2.0
    middle = a < 4.0
    steps = a * tl.where(small, 2.0, tl.where(middle, 1.0, 0.5))
    lower = tl.floor(steps)
    # random24 < fraction * 2^24, compared as integers (random24 < ceil(...)): no 64-bit conversion.
    up = (random24 < tl.math.ceil((steps - lower) * 16777216.0).to(tl.int32)).to(tl.int32)
    code = tl.minimum(lower.to(tl.int32) + tl.where(small, 0, tl.where(middle, 2, 4)) + up, 7)
    return code | (_sign_bits(v) & sign_mask)


@triton.jit
def _rng_state(first_index, index_step, seed):
    """splitmix64's first state (i + 1) * golden + seed of i = first_index + index_step, summed
    from the broadcast operands' products (one per row, one per column)."""
    golden: tl.constexpr = 0x9E3779B97F4A7C15
    return ((first_index + 1).to(tl.uint64) * golden + seed) + index_step.to(tl.uint64) * golden


@triton.jit
def _random24(state):
    """The top 24 bits of splitmix64 from its first state ([Note: counter RNG]); the final
    xor-shift by 31 leaves bits 40-63 as they are, so it is skipped."""
    z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return (z >> 40).to(tl.int32)


@triton.jit
def _codes(x, enc, rng_state, STOCHASTIC: tl.constexpr):
    """int32 E2M1 codes of x * enc, 0 where enc is 0 (the block's s is 0)."""
    sign_mask = tl.where(enc > 0, 8, 0)
    if STOCHASTIC:
        codes = _encode_stochastic(x * enc, _random24(rng_state), sign_mask)
    else:
        codes = _encode_scaled(x * enc, sign_mask)
    return codes


@triton.jit
def _store_rowwise(data_ptr, codes_TGHK, rows, tile_k, M, K):
    """Stores one tile's codes, packed in pairs along K, into the rowwise (M, K/2) bytes."""
    T: tl.constexpr = codes_TGHK.shape[0]
    G: tl.constexpr = codes_TGHK.shape[1]
    H: tl.constexpr = codes_TGHK.shape[2]
    PAIRS: tl.constexpr = codes_TGHK.shape[3] // 2
    even, odd = tl.split(tl.reshape(codes_TGHK, (T, G, H, PAIRS, 2)))
    pair_cols = (tile_k * PAIRS + tl.arange(0, PAIRS))[None, None, None, :]
    mask = (rows < M) & (pair_cols < K // 2)
    tl.store(data_ptr + rows * (K // 2) + pair_cols, (even | (odd << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _store_columnwise(data_ptr, codes_TGHK, cols, tile_m, M, K):
    """Stores one tile's codes, packed in pairs along M (rows t and t + 1 of a thread's T rows),
    into the columnwise (K, M/2) bytes."""
    T: tl.constexpr = codes_TGHK.shape[0]
    G: tl.constexpr = codes_TGHK.shape[1]
    H: tl.constexpr = codes_TGHK.shape[2]
    TILE_K: tl.constexpr = codes_TGHK.shape[3]
    even, odd = tl.split(tl.permute(tl.reshape(codes_TGHK, (T // 2, 2, G, H, TILE_K)), (0, 2, 3, 4, 1)))
    pair_in_run = tl.arange(0, T // 2)[:, None, None, None] + (T // 2) * tl.arange(0, H)[None, None, :, None]
    pair_rows = tile_m * (8 * G) + 8 * tl.arange(0, G)[None, :, None, None] + pair_in_run
    mask = (pair_rows < M // 2) & (cols < K)
    tl.store(data_ptr + cols * (M // 2) + pair_rows, (even | (odd << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _store_transformed_columnwise(
    data_ptr, scale_ptr, x, columnwise_amax_ptr, hadamard_seed_hi, hadamard_seed_lo, seed, tile_m, tile_k, M, K,
    STOCHASTIC: tl.constexpr, HARDWARE: tl.constexpr,
):  # fmt: skip
    """The columnwise usage of T(x^T) for one tile x (T, G, H, TILE_K) ([Note: NVFP4 random Hadamard
    transform]): each 16-row run of a column is transformed in fp32, scaled by its own amax and
    S_c, encoded and packed along M into the (K, M/2) bytes; its scale goes to (K, M/16)."""
    G: tl.constexpr = x.shape[1]
    TILE_K: tl.constexpr = x.shape[3]
    # (k, g, h, t) -> run (k, g), position h T + t = the row's place in its run of 16.
    runs_NP = tl.reshape(tl.permute(x, (3, 1, 2, 0)), (TILE_K * G, 16))
    runs_NP = _hadamard_runs(runs_NP, hadamard_seed_hi, hadamard_seed_lo)
    amax_N = tl.max(finite_abs(runs_NP), axis=1)
    enc_N, s_N = _nvfp4_scale(amax_N, tensor_scale(columnwise_amax_ptr), HARDWARE)
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)[:, None, None]  # (K, 1, 1)
    if STOCHASTIC:
        # Counters as without the transform: M * K + k * M + m, m = 16 (tile_m G + g) + position.
        rows = 16 * (tile_m * G + tl.arange(0, G))[None, :, None] + tl.arange(0, 16)[None, None, :]  # (1, G, 16)
        state = tl.reshape(_rng_state(tl.cast(M, tl.int64) * K + cols * M, rows, seed), (TILE_K * G, 16))
    else:
        state = 0
    codes_NP = _codes(runs_NP, enc_N[:, None], state, STOCHASTIC)
    even, odd = tl.split(tl.reshape(codes_NP, (TILE_K * G, 8, 2)))
    packed = tl.reshape((even | (odd << 4)).to(tl.uint8), (TILE_K, G, 8))
    pair_rows = 8 * (tile_m * G + tl.arange(0, G))[None, :, None] + tl.arange(0, 8)[None, None, :]  # (1, G, 8)
    tl.store(data_ptr + cols * (M // 2) + pair_rows, packed, mask=(cols < K) & (pair_rows < M // 2))
    block_rows = (tile_m * G + tl.arange(0, G))[None, :]  # (1, G)
    cols_K = tl.reshape(cols, (TILE_K, 1))
    Mb = tl.cdiv(M, 16)
    store_bytes(scale_ptr, cols_K * Mb + block_rows, tl.reshape(s_N, (TILE_K, G)), (cols_K < K) & (block_rows < Mb))


@triton.jit(do_not_specialize=["hadamard_seed_hi", "hadamard_seed_lo"])
def _quantize_nvfp4_register_blocks_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    seed_ptr,
    columnwise_amax_ptr,
    hadamard_seed_hi,
    hadamard_seed_lo,
    rowwise_ptr,
    rowwise_scale_ptr,
    columnwise_ptr,
    columnwise_scale_ptr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    TWO_D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HADAMARD: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    ROWS_PER_THREAD: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """`_quantize_nvfp4_kernel`'s contract, the tile held as (T, G, H, TILE_K) ([Note: NVFP4 register blocks])."""
    T: tl.constexpr = ROWS_PER_THREAD
    H: tl.constexpr = 16 // ROWS_PER_THREAD
    G: tl.constexpr = TILE_M // 16
    B: tl.constexpr = TILE_K // 16
    col_tiles = tl.cdiv(K, TILE_K)
    tile_m = tl.program_id(0) // col_tiles
    tile_k = tl.program_id(0) % col_tiles
    run_starts = 16 * tl.arange(0, G)[None, :, None, None] + T * tl.arange(0, H)[None, None, :, None]
    rows = (tile_m * TILE_M + run_starts + tl.arange(0, T)[:, None, None, None]).to(tl.int64)  # (T, G, H, 1)
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)[None, None, None, :]  # (1, 1, 1, K)
    x = tl.load(x_ptr + rows * stride_m + cols * stride_k, mask=(rows < M) & (cols < K), other=0.0)
    x = x.to(tl.float32)
    magnitude = finite_abs(x)
    S = tensor_scale(amax_ptr)
    seed = tl.load(seed_ptr).to(tl.uint64, bitcast=True) if STOCHASTIC else 0
    Mb = tl.cdiv(M, 16)
    Kb = tl.cdiv(K, 16)
    block_rows = tile_m * G + tl.arange(0, G)[:, None]  # (G, 1)
    block_cols = tile_k * B + tl.arange(0, B)[None, :]  # (1, B)
    rowwise_state = tl.reshape(_rng_state(rows * K, cols, seed), (T, G, H, B, 16)) if STOCHASTIC else 0
    if TWO_D:
        amax_T = tl.max(tl.max(tl.max(tl.reshape(magnitude, (T, G, H, B, 16)), axis=4), axis=0), axis=1)  # (G, B)
        enc_T, s_T = _nvfp4_scale(amax_T, S, HARDWARE)
        enc = tl.broadcast_to(enc_T[None, :, None, :], (T, G, H, B))[:, :, :, :, None]
        codes = tl.reshape(_codes(tl.reshape(x, (T, G, H, B, 16)), enc, rowwise_state, STOCHASTIC), (T, G, H, TILE_K))
        scale_mask_T = (block_rows < Mb) & (block_cols < Kb)
        if ROWWISE:
            _store_rowwise(rowwise_ptr, codes, rows, tile_k, M, K)
            store_bytes(rowwise_scale_ptr, block_rows * Kb + block_cols, s_T, scale_mask_T)
        if COLUMNWISE:
            # Columnwise 16 x 16 is the transpose of rowwise, codes and scales.
            _store_columnwise(columnwise_ptr, codes, cols, tile_m, M, K)
            store_bytes(columnwise_scale_ptr, block_rows + block_cols * Mb, s_T, scale_mask_T)
    else:
        # Both amaxes before any code, so the magnitudes die early (registers).
        if ROWWISE:
            amax_rows = tl.max(tl.reshape(magnitude, (T, G, H, B, 16)), axis=4)  # (T, G, H, B)
        if COLUMNWISE and not HADAMARD:
            amax_cols = tl.max(tl.max(magnitude, axis=0), axis=1)  # (G, K)
        if ROWWISE:
            enc_rows, s_rows = _nvfp4_scale(amax_rows, S, HARDWARE)
            codes = _codes(tl.reshape(x, (T, G, H, B, 16)), enc_rows[:, :, :, :, None], rowwise_state, STOCHASTIC)
            _store_rowwise(rowwise_ptr, tl.reshape(codes, (T, G, H, TILE_K)), rows, tile_k, M, K)
            blocks_K = block_cols[None, :, :]
            store_bytes(rowwise_scale_ptr, rows * Kb + blocks_K, s_rows, (rows < M) & (blocks_K < Kb))
        if COLUMNWISE and HADAMARD:
            _store_transformed_columnwise(
                columnwise_ptr, columnwise_scale_ptr, x, columnwise_amax_ptr, hadamard_seed_hi,
                hadamard_seed_lo, seed, tile_m, tile_k, M, K, STOCHASTIC, HARDWARE,
            )  # fmt: skip
        if COLUMNWISE and not HADAMARD:
            enc_cols, s_cols = _nvfp4_scale(amax_cols, S, HARDWARE)
            # Columnwise counters continue after x's M * K elements, in x^T's row-major order.
            state = _rng_state(tl.cast(M, tl.int64) * K + cols * M, rows, seed) if STOCHASTIC else 0
            codes = _codes(x, enc_cols[None, :, None, :], state, STOCHASTIC)
            _store_columnwise(columnwise_ptr, codes, cols, tile_m, M, K)
            cols_K = tl.reshape(cols, (1, TILE_K))
            store_bytes(columnwise_scale_ptr, cols_K * Mb + block_rows, s_cols, (block_rows < Mb) & (cols_K < K))


def quantize_tiles(block_rows: int, stochastic_rounding: bool, columnwise: bool, hadamard: bool = False) -> BlockTiles:
    """The register-blocks kernel's tile for one quantization (the module constants)."""
    if stochastic_rounding:
        return QUANTIZE_STOCHASTIC_TILES
    if hadamard:
        return QUANTIZE_HADAMARD_TILES
    if block_rows > 1:
        return QUANTIZE_16X16_TILES
    return QUANTIZE_1X16_TILES if columnwise else QUANTIZE_ROWWISE_TILES


def launch_quantize(
    x_MK: torch.Tensor,
    block_rows: int,
    global_amax: torch.Tensor,
    stochastic_rounding: bool,
    seed: int | torch.Tensor,
    buffers: tuple[torch.Tensor | None, ...],
    variant: str,
    tiles: BlockTiles | Tiles,
    columnwise_amax: torch.Tensor | None = None,
    hadamard_seed: int | None = None,
) -> None:
    """Runs quantize kernel `variant`: "register_blocks" (BlockTiles) or "original" (Tiles; without
    the Hadamard transform). columnwise_amax defaults to global_amax; hadamard_seed: the
    columnwise usage is T(x^T) ([Note: NVFP4 random Hadamard transform])."""
    rowwise, rowwise_scale, columnwise, columnwise_scale = buffers
    M, K = x_MK.shape
    hadamard = hadamard_seed is not None and columnwise is not None
    scales: tuple[object, ...] = (global_amax, seed_tensor(seed, x_MK.device) if stochastic_rounding else None)
    if variant == "register_blocks":
        assert isinstance(tiles, BlockTiles), tiles
        kernel = _quantize_nvfp4_register_blocks_kernel
        columnwise_amax_of = global_amax if columnwise_amax is None else columnwise_amax
        scales += (columnwise_amax_of, *int32_halves(hadamard_seed if hadamard else 0))
        extra = {"ROWS_PER_THREAD": tiles.rows_per_thread, "HADAMARD": hadamard}
    else:
        assert variant == "original", variant
        assert isinstance(tiles, Tiles), tiles
        assert not hadamard, "the original NVFP4 quantize kernel has no Hadamard transform"
        kernel, extra = _quantize_nvfp4_kernel, {}
    launch(
        kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        M,
        K,
        *x_MK.stride(),
        *scales,
        rowwise,
        rowwise_scale,
        columnwise,
        columnwise_scale,
        ROWWISE=rowwise is not None,
        COLUMNWISE=columnwise is not None,
        TWO_D=block_rows > 1,
        STOCHASTIC=stochastic_rounding,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **extra,
        **EXACT,
    )


@register_kernel("quantize_nvfp4", "triton", traceable=True)
def _quantize_nvfp4(args: QuantizeNvfp4Args) -> None:
    block_rows, stochastic_rounding, hadamard_seed = args.block_rows, args.stochastic_rounding, args.hadamard_seed
    columnwise = args.columnwise_data is not None
    # The transform is built into the register-blocks kernel only.
    variant = "register_blocks" if hadamard_seed is not None and columnwise else QUANTIZE_VARIANT
    if variant == "original":
        tiles: BlockTiles | Tiles = QUANTIZE_TILES
    else:
        tiles = quantize_tiles(block_rows, stochastic_rounding, columnwise, hadamard_seed is not None and columnwise)
    launch_quantize(
        args.x_MK,
        block_rows,
        args.global_amax,
        stochastic_rounding,
        args.seed,
        quantize_buffers(args),
        variant,
        tiles,
        args.columnwise_amax,
        hadamard_seed,
    )


@triton.jit
def _decode_e2m1(codes):
    """fp32 values of 4-bit E2M1 codes: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (exact)."""
    exponent = (codes >> 1) & 0x3
    mantissa = (codes & 0x1).to(tl.float32)
    step = tl.where(exponent == 1, 0.5, tl.where(exponent == 2, 1.0, 2.0))  # 2^(exponent - 2)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (2.0 + mantissa) * step)
    # Times -1 rather than `-magnitude`: Triton 3.6 negates floats as 0 - x, which turns -0 into +0.
    return tl.where((codes & 0x8) != 0, magnitude * -1.0, magnitude)


@triton.jit
def _block_factor(stored, amax_ptr, TENSOR_SCALE: tl.constexpr, HARDWARE: tl.constexpr):
    """fp32(s) / S for E4M3 block-scale bytes `stored`, or fp32(s) alone without TENSOR_SCALE."""
    s = decode_fp8(stored, True, HARDWARE)
    if TENSOR_SCALE:
        s = tl.div_rn(s, tensor_scale(amax_ptr))
    return s


@triton.jit
def _dequantize_nvfp4_kernel(
    data_ptr,
    scale_ptr,
    amax_ptr,
    out_ptr,
    R,
    C,
    BLOCK_ROWS: tl.constexpr,
    TENSOR_SCALE: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """out = e2m1(q) * (fp32(s) / S) for a TILE_R x TILE_C tile of (R, C) codes packed as (R, C/2)
    (without TENSOR_SCALE: e2m1(q) * fp32(s), and amax_ptr is not read).

    Element-wise: each element reads its byte (nibble c & 1) and its block's scale; neighbours
    share them, so the repeated reads hit the cache, and no tile is reshaped or joined."""
    col_tiles = tl.cdiv(C, TILE_C)
    rows = ((tl.program_id(0) // col_tiles) * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_C + tl.arange(0, TILE_C)).to(tl.int64)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    packed = tl.load(data_ptr + (rows * (C // 2))[:, None] + (cols // 2)[None, :], mask=mask, other=0)
    codes = (packed.to(tl.int32) >> ((cols & 1) * 4).to(tl.int32)[None, :]) & 0xF
    scale_offsets = ((rows // BLOCK_ROWS) * tl.cdiv(C, 16))[:, None] + (cols // 16)[None, :]
    stored = as_bytes(tl.load(scale_ptr + scale_offsets, mask=mask))
    factor = _block_factor(stored, amax_ptr, TENSOR_SCALE, HARDWARE)
    store_values(out_ptr, (rows * C)[:, None] + cols[None, :], _decode_e2m1(codes) * factor, mask)


@triton.jit
def _decode_nibbles(codes):
    """fp32 values of the E2M1 codes in the low nibbles of int32 `codes`: the magnitude bits m
    shifted to bit 22 read as fp32 are the value times 2^-126 (m = 1: the subnormal 2^-127;
    m >= 2: (1 + (m & 1) / 2) * 2^(m // 2 - 127)), so one exact product with 2^126 decodes them."""
    bits = ((codes & 0x7) << 22) | ((codes & 0x8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _dequantize_nvfp4_pairs_tile(
    tile,
    data_ptr,
    scale_ptr,
    amax_ptr,
    out_ptr,
    R,
    C,
    BLOCK_ROWS: tl.constexpr,
    TENSOR_SCALE: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """`_dequantize_nvfp4_kernel`'s contract for tile `tile`, each byte read once: the tile's bytes
    are loaded as (TILE_R, TILE_C / 8, 4), so a thread's 4 bytes decode to 8 consecutive outputs
    (one 16-byte bf16 store, no layout conversion), with the scale of their half block; the values
    of the low and high nibbles are joined into the (TILE_R, TILE_C) output."""
    G: tl.constexpr = TILE_C // 8
    col_tiles = tl.cdiv(C, TILE_C)
    tile_r = tile // col_tiles
    tile_c = tile % col_tiles
    rows = (tile_r * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)[:, None, None]
    groups = tile_c * G + tl.arange(0, G)[None, :, None]
    byte_cols = 4 * groups + tl.arange(0, 4)[None, None, :]
    packed = tl.load(data_ptr + rows * (C // 2) + byte_cols, mask=(rows < R) & (byte_cols < C // 2), other=0)
    Cb = tl.cdiv(C, 16)
    blocks = groups // 2
    stored = as_bytes(tl.load(scale_ptr + (rows // BLOCK_ROWS) * Cb + blocks, mask=(rows < R) & (blocks < Cb)))
    factor = _block_factor(stored, amax_ptr, TENSOR_SCALE, HARDWARE)
    codes = packed.to(tl.int32)
    values = tl.join(_decode_nibbles(codes) * factor, _decode_nibbles(codes >> 4) * factor)
    rows_R = tl.reshape(rows, (TILE_R, 1))
    cols = tile_c * TILE_C + tl.arange(0, TILE_C)[None, :]
    store_values(out_ptr, rows_R * C + cols, tl.reshape(values, (TILE_R, TILE_C)), (rows_R < R) & (cols < C))


@triton.jit
def _dequantize_nvfp4_pairs_kernel(
    data_ptr,
    scale_ptr,
    amax_ptr,
    out_ptr,
    R,
    C,
    BLOCK_ROWS: tl.constexpr,
    TENSOR_SCALE: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """One program per tile of `_dequantize_nvfp4_pairs_tile`."""
    _dequantize_nvfp4_pairs_tile(
        tl.program_id(0),
        data_ptr,
        scale_ptr,
        amax_ptr,
        out_ptr,
        R,
        C,
        BLOCK_ROWS,
        TENSOR_SCALE,
        TILE_R,
        TILE_C,
        HARDWARE,
    )


@triton.jit
def _dequantize_nvfp4_operand_pair_kernel(
    a_data_ptr,
    a_scale_ptr,
    a_amax_ptr,
    a_out_ptr,
    a_R,
    a_C,
    b_data_ptr,
    b_scale_ptr,
    b_amax_ptr,
    b_out_ptr,
    b_R,
    b_C,
    A_BLOCK_ROWS: tl.constexpr,
    B_BLOCK_ROWS: tl.constexpr,
    A_TENSOR_SCALE: tl.constexpr,
    B_TENSOR_SCALE: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """A's tiles, then B's ([Note: dequantizing two operands] in quant_core.blocks._layout)."""
    a_tiles = tl.cdiv(a_R, TILE_R) * tl.cdiv(a_C, TILE_C)
    tile = tl.program_id(0)
    if tile < a_tiles:
        _dequantize_nvfp4_pairs_tile(
            tile,
            a_data_ptr,
            a_scale_ptr,
            a_amax_ptr,
            a_out_ptr,
            a_R,
            a_C,
            A_BLOCK_ROWS,
            A_TENSOR_SCALE,
            TILE_R,
            TILE_C,
            HARDWARE,
        )
    else:
        _dequantize_nvfp4_pairs_tile(
            tile - a_tiles,
            b_data_ptr,
            b_scale_ptr,
            b_amax_ptr,
            b_out_ptr,
            b_R,
            b_C,
            B_BLOCK_ROWS,
            B_TENSOR_SCALE,
            TILE_R,
            TILE_C,
            HARDWARE,
        )


def launch_dequantize(
    data_2d: torch.Tensor,
    scale_inv: torch.Tensor,
    block_rows: int,
    global_amax: torch.Tensor | None,
    out_2d: torch.Tensor,
    variant: str,
    tiles: Tiles,
) -> None:
    """Runs dequantize kernel `variant`: "pairs" or "elementwise"; global_amax None: S = 1."""
    assert variant in ("pairs", "elementwise"), variant
    R, C = out_2d.shape
    kernel = _dequantize_nvfp4_pairs_kernel if variant == "pairs" else _dequantize_nvfp4_kernel
    launch(
        kernel,
        (cdiv(R, tiles.tile_m) * cdiv(C, tiles.tile_k),),
        data_2d,
        scale_inv,
        scale_inv if global_amax is None else global_amax,  # not read without TENSOR_SCALE
        out_2d,
        R,
        C,
        BLOCK_ROWS=block_rows,
        TENSOR_SCALE=global_amax is not None,
        TILE_R=tiles.tile_m,
        TILE_C=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@register_kernel("dequantize_nvfp4", "triton", traceable=True)
def _dequantize_nvfp4(args: DequantizeNvfp4Args, out_2d: torch.Tensor) -> None:
    tiles = DEQUANTIZE_PAIRS_TILES if DEQUANTIZE_VARIANT == "pairs" else DEQUANTIZE_TILES
    launch_dequantize(
        args.data_2d, args.scale_inv, args.block_rows, args.global_amax, out_2d, DEQUANTIZE_VARIANT, tiles
    )


@register_kernel("dequantize_nvfp4_pair", "triton", traceable=True)
def _dequantize_nvfp4_pair(args: DequantizeNvfp4PairArgs, a_out_2d: torch.Tensor, b_out_2d: torch.Tensor) -> None:
    """Both operands in one launch of the "pairs" kernel's tiles (DEQUANTIZE_PAIRS_TILES)."""
    tiles = DEQUANTIZE_PAIRS_TILES
    (a_R, a_C), (b_R, b_C) = a_out_2d.shape, b_out_2d.shape
    a_global_amax, b_global_amax = args.a_global_amax, args.b_global_amax
    launch(
        _dequantize_nvfp4_operand_pair_kernel,
        (cdiv(a_R, tiles.tile_m) * cdiv(a_C, tiles.tile_k) + cdiv(b_R, tiles.tile_m) * cdiv(b_C, tiles.tile_k),),
        args.a_data_2d,
        args.a_scale_inv,
        args.a_scale_inv if a_global_amax is None else a_global_amax,  # not read without A_TENSOR_SCALE
        a_out_2d,
        a_R,
        a_C,
        args.b_data_2d,
        args.b_scale_inv,
        args.b_scale_inv if b_global_amax is None else b_global_amax,
        b_out_2d,
        b_R,
        b_C,
        A_BLOCK_ROWS=args.a_block_rows,
        B_BLOCK_ROWS=args.b_block_rows,
        A_TENSOR_SCALE=a_global_amax is not None,
        B_TENSOR_SCALE=b_global_amax is not None,
        TILE_R=tiles.tile_m,
        TILE_C=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@triton.jit
def _nvfp4_gemm_output_kernel(
    product_ptr, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr, numel, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """[Note: NVFP4 GEMM output] for BLOCK consecutive elements of the contiguous (numel / N, N) product."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    factor = tl.div_rn(1.0, tensor_scale(a_amax_ptr)) * tl.div_rn(1.0, tensor_scale(b_amax_ptr))
    values = tl.load(product_ptr + offsets, mask=mask, other=0.0) * factor
    if HAS_BIAS:
        values = values + tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    store_values(out_ptr, offsets, values, mask)


@register_kernel("nvfp4_gemm_output", "triton", traceable=True)
def _nvfp4_gemm_output(args: Nvfp4GemmOutputArgs, out: torch.Tensor) -> None:
    product, bias = args.product, args.bias
    numel, N = product.numel(), product.shape[1]
    launch(
        _nvfp4_gemm_output_kernel,
        (cdiv(numel, GEMM_OUTPUT_TILES.tile_k),),
        product,
        args.a_global_amax,
        args.b_global_amax,
        product if bias is None else bias.contiguous(),  # not read without HAS_BIAS
        out,
        numel,
        N,
        HAS_BIAS=bias is not None,
        BLOCK=GEMM_OUTPUT_TILES.tile_k,
        num_warps=GEMM_OUTPUT_TILES.num_warps,
        **EXACT,
    )


@triton.jit
def _transpose_nvfp4_kernel(packed_ptr, out_ptr, M, K, stride_m, stride_k, TILE_M: tl.constexpr, TILE_K: tl.constexpr):
    """One TILE_M x TILE_K tile of (M, K) codes packed along K, written transposed and packed along M.

    Byte (r, c) of the output pair row (2c + p) packs codes (2r, 2c + p) and (2r + 1, 2c + p): nibble
    p of bytes (2r, c) and (2r + 1, c) of the input, so even and odd input rows are loaded apart
    (`even_RC`, `odd_RC`: TILE_M/2 x TILE_K/2 bytes) and combined byte-wise, then transposed."""
    col_tiles = tl.cdiv(K, TILE_K)
    pair_rows = ((tl.program_id(0) // col_tiles) * (TILE_M // 2) + tl.arange(0, TILE_M // 2)).to(tl.int64)
    byte_cols = ((tl.program_id(0) % col_tiles) * (TILE_K // 2) + tl.arange(0, TILE_K // 2)).to(tl.int64)
    mask_RC = (pair_rows < M // 2)[:, None] & (byte_cols < K // 2)[None, :]
    even_offsets_RC = (2 * pair_rows * stride_m)[:, None] + (byte_cols * stride_k)[None, :]
    even_RC = tl.load(packed_ptr + even_offsets_RC, mask=mask_RC, other=0).to(tl.int32)
    odd_RC = tl.load(packed_ptr + even_offsets_RC + stride_m, mask=mask_RC, other=0).to(tl.int32)
    low_nibbles_RC = ((even_RC & 0xF) | ((odd_RC & 0xF) << 4)).to(tl.uint8)  # output rows 2c
    high_nibbles_RC = ((even_RC >> 4) | (odd_RC & 0xF0)).to(tl.uint8)  # output rows 2c + 1
    offsets_CR = (2 * byte_cols * (M // 2))[:, None] + pair_rows[None, :]
    tl.store(out_ptr + offsets_CR, tl.trans(low_nibbles_RC), mask=tl.trans(mask_RC))
    tl.store(out_ptr + offsets_CR + M // 2, tl.trans(high_nibbles_RC), mask=tl.trans(mask_RC))


@register_kernel("transpose_nvfp4", "triton", traceable=True)
def _transpose_nvfp4(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    packed_MK = args.packed_MK
    M, K = packed_MK.shape[0], packed_MK.shape[1] * 2
    tiles = TRANSPOSE_TILES
    launch(
        _transpose_nvfp4_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        packed_MK,
        out_KM,
        M,
        K,
        *packed_MK.stride(),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )


@triton.jit
def _butterfly(groups, H: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform on (N, 16) groups: elements H apart become
    (first + second, first - second)."""
    N: tl.constexpr = groups.shape[0]
    pairs = tl.permute(tl.reshape(groups, (N, 16 // (2 * H), 2, H)), (0, 1, 3, 2))
    first, second = tl.split(pairs)
    pairs = tl.permute(tl.join(first + second, first - second), (0, 1, 3, 2))
    return tl.reshape(pairs, (N, 16))


@triton.jit
def _hadamard_runs(runs, seed_hi, seed_lo):
    """(1/4) H_16 D of every run of an (N, 16) fp32 tensor, D the signs of the seed (`int32_halves`):
    the reference's signs, 4-stage butterfly and 1/4, in that order."""
    draws = splitmix64(from_int32_halves(seed_hi, seed_lo), tl.arange(0, 16).to(tl.uint64))
    signs = tl.where((draws >> 63) != 0, -1.0, 1.0)
    runs = _butterfly(_butterfly(_butterfly(_butterfly(runs * signs[None, :], 1), 2), 4), 8)
    return runs * 0.25


@triton.jit(do_not_specialize=["seed_hi", "seed_lo"])
def _hadamard_amaxes_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k, seed_hi, seed_lo, TILE_M: tl.constexpr, TILE_K: tl.constexpr
):  # fmt: skip
    """amax(x) and amax(T(x^T)) of one TILE_M x TILE_K tile (TILE_M a multiple of 16; rows past M
    read as 0, which pads a partial last run): one atomic max per program into amax_ptr[0] and [1]."""
    rows = ((tl.program_id(0) // tl.cdiv(K, TILE_K)) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % tl.cdiv(K, TILE_K)) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    x_MK = x_MK.to(tl.float32)
    runs_NP = _hadamard_runs(tl.reshape(tl.trans(x_MK), (TILE_K * TILE_M // 16, 16)), seed_hi, seed_lo)
    tl.atomic_max(amax_ptr, tl.max(finite_abs(x_MK)))
    tl.atomic_max(amax_ptr + 1, tl.max(finite_abs(runs_NP)))


@register_kernel("hadamard_amaxes", "triton", traceable=True)
def _hadamard_amaxes(args: HadamardArgs, out: torch.Tensor) -> None:
    x_MK = args.x_MK
    M, K = x_MK.shape
    tiles = HADAMARD_AMAXES_TILES
    launch(
        _hadamard_amaxes_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        out,
        M,
        K,
        *x_MK.stride(),
        *int32_halves(args.seed),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@triton.jit(do_not_specialize=["seed_hi", "seed_lo"])
def _hadamard_kernel(
    x_ptr,
    out_ptr,
    M,
    K,
    stride_m,
    stride_k,
    seed_hi,
    seed_lo,
    INVERSE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """The 16 x 16 random Hadamard transform of one tile (K and TILE_K multiples of 16), or with
    INVERSE its inverse: the signs applied after the butterfly instead of before."""
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((tl.program_id(0) // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    draws = splitmix64(from_int32_halves(seed_hi, seed_lo), tl.arange(0, 16).to(tl.uint64))
    signs = tl.where((draws >> 63) != 0, -1.0, 1.0)
    groups = tl.reshape(x_MK.to(tl.float32), (TILE_M * TILE_K // 16, 16))
    if not INVERSE:
        groups = groups * signs[None, :]
    groups = _butterfly(_butterfly(_butterfly(_butterfly(groups, 1), 2), 4), 8) * 0.25
    if INVERSE:
        groups = groups * signs[None, :]
    out_MK = tl.reshape(groups, (TILE_M, TILE_K))
    store_values(out_ptr, (rows * K)[:, None] + cols[None, :], out_MK, mask_MK)


@register_kernel("hadamard_transform_16", "triton", traceable=True)
def _hadamard_transform_16(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    _launch_hadamard(args.x_MK, args.seed, out_MK, inverse=False)


@register_kernel("hadamard_inverse_16", "triton", traceable=True)
def _hadamard_inverse_16(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    _launch_hadamard(args.x_MK, args.seed, out_MK, inverse=True)


def _launch_hadamard(x_MK: torch.Tensor, seed: int, out_MK: torch.Tensor, *, inverse: bool) -> None:
    M, K = x_MK.shape
    tiles = HADAMARD_TILES
    launch(
        _hadamard_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        out_MK,
        M,
        K,
        *x_MK.stride(),
        *int32_halves(seed),
        INVERSE=inverse,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
        **EXACT,
    )
