"""Triton kernels of the NVFP4 quantize (`_nvfp4.py`): 1 x 16 and 16 x 16 blocks, stochastic
rounding, the Hadamard-transformed columnwise usage; the register-blocks kernel and the original
one, kept as a sweep variant.

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
from quant_core.nvfp4._nvfp4 import QuantizeNvfp4Args
from quant_core.nvfp4._triton_hadamard import _hadamard_runs
from quant_core.nvfp4._triton_numerics import _codes, _nvfp4_scale, _rng_state, tensor_scale
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
    EXACT,
    HARDWARE_FP8,
    Tiles,
    encode_e2m1,
    encode_e2m1_stochastic,
    finite_abs,
    int32_halves,
    seed_tensor,
    splitmix64,
    store_bytes,
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


# Kernel choices, tuned on an H100: `python3 benchmarks/sweep_nvfp4.py` times every variant and tile
# at bf16 8192^2 (docs/benchmarks.md): "register_blocks" (the tiles below) or "original"
# (`_quantize_nvfp4_kernel`, QUANTIZE_TILES).
QUANTIZE_VARIANT = "register_blocks"
QUANTIZE_1X16_TILES = BlockTiles(64, 64, 4, 4)  # 1 x 16 with columnwise
QUANTIZE_ROWWISE_TILES = BlockTiles(64, 128, 4, 8)  # 1 x 16 rowwise only
QUANTIZE_16X16_TILES = BlockTiles(64, 64, 4, 4)
QUANTIZE_STOCHASTIC_TILES = BlockTiles(32, 64, 2, 4)
# With the Hadamard transform the columnwise runs hold more live values (179 registers at 64 x 64):
# 291.9 vs 367.4 us at 8192^2 (`benchmarks/sweep_nvfp4.py 1x16-both-rht`). Stochastic rounding with
# the transform keeps QUANTIZE_STOCHASTIC_TILES (not swept).
QUANTIZE_HADAMARD_TILES = BlockTiles(32, 128, 4, 4)
QUANTIZE_TILES = Tiles(32, 64, 4)


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
