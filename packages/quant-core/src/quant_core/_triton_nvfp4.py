"""Triton kernels of NVFP4 (`_nvfp4.py`): quantize (1 x 16, 16 x 16, stochastic rounding), dequantize,
the lossless nibble transpose and the 16 x 16 random Hadamard transform.

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); a program
quantizes one TILE_M x TILE_K tile (multiples of 16) and writes every usage from that one read
([Note: block layouts] in `_blocks.py`). Codes are 4-bit E2M1 values held as int32 until packed
two per byte along the last dim of their output (even element in the low nibble); `*_MB` holds
one value per 1 x 16 run of a row, `*_BK` per 16 x 1 run of a column, `*_T` per 16 x 16 tile.
Stochastic rounding draws element i's bits from splitmix64(seed, i) with i = m * K + k for
rowwise (and 16 x 16) codes and M * K + k * M + m for 1 x 16 columnwise codes
([Note: counter RNG]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._backend import register_kernel
from quant_core._triton_numerics import (
    EXACT,
    HARDWARE_FP8,
    Tiles,
    as_bytes,
    decode_fp8,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_fp8,
    finite_abs,
    seed_tensor,
    splitmix64,
    store_bytes,
    store_values,
)

# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2).
QUANTIZE_TILES = Tiles(32, 64, 4)
DEQUANTIZE_TILES = Tiles(8, 512, 4)
TRANSPOSE_TILES = Tiles(128, 256, 8)
HADAMARD_TILES = Tiles(16, 128, 4)


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
    tensor_scale_ptr,
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
    S = tl.load(tensor_scale_ptr)
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


@register_kernel("quantize_nvfp4", "triton")
def _quantize_nvfp4(
    x_MK: torch.Tensor,
    block_rows: int,
    tensor_scale: torch.Tensor,
    stochastic_rounding: bool,
    seed: int | torch.Tensor,
    *buffers: torch.Tensor | None,
) -> None:
    rowwise, rowwise_scale, columnwise, columnwise_scale = buffers
    M, K = x_MK.shape
    tiles = QUANTIZE_TILES
    _quantize_nvfp4_kernel[(triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)](
        x_MK,
        M,
        K,
        *x_MK.stride(),
        tensor_scale,
        seed_tensor(seed, x_MK.device) if stochastic_rounding else None,
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
        **EXACT,
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
def _dequantize_nvfp4_kernel(
    data_ptr,
    scale_ptr,
    tensor_scale_ptr,
    out_ptr,
    R,
    C,
    BLOCK_ROWS: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """out = e2m1(q) * (fp32(s) / S) for a TILE_R x TILE_C tile of (R, C) codes packed as (R, C/2).

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
    factor = tl.div_rn(decode_fp8(stored, True, HARDWARE), tl.load(tensor_scale_ptr))
    store_values(out_ptr, (rows * C)[:, None] + cols[None, :], _decode_e2m1(codes) * factor, mask)


@register_kernel("dequantize_nvfp4", "triton")
def _dequantize_nvfp4(
    data_2d: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, tensor_scale: torch.Tensor, out_2d: torch.Tensor
) -> None:
    R, C = out_2d.shape
    tiles = DEQUANTIZE_TILES
    _dequantize_nvfp4_kernel[(triton.cdiv(R, tiles.tile_m) * triton.cdiv(C, tiles.tile_k),)](
        data_2d,
        scale_inv,
        tensor_scale,
        out_2d,
        R,
        C,
        BLOCK_ROWS=block_rows,
        TILE_R=tiles.tile_m,
        TILE_C=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
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


@register_kernel("transpose_nvfp4", "triton")
def _transpose_nvfp4(packed_MK: torch.Tensor, out_KM: torch.Tensor) -> None:
    M, K = packed_MK.shape[0], packed_MK.shape[1] * 2
    tiles = TRANSPOSE_TILES
    _transpose_nvfp4_kernel[(triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)](
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


@triton.jit(do_not_specialize=["seed"])
def _hadamard_kernel(
    x_ptr,
    out_ptr,
    M,
    K,
    stride_m,
    stride_k,
    seed,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """The 16 x 16 random Hadamard transform of one tile (K and TILE_K multiples of 16)."""
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((tl.program_id(0) // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    draws = splitmix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), tl.arange(0, 16).to(tl.uint64))
    signs = tl.where((draws >> 63) != 0, -1.0, 1.0)
    groups = tl.reshape(x_MK.to(tl.float32), (TILE_M * TILE_K // 16, 16)) * signs[None, :]
    groups = _butterfly(_butterfly(_butterfly(_butterfly(groups, 1), 2), 4), 8)
    out_MK = tl.reshape(groups, (TILE_M, TILE_K)) * 0.25
    store_values(out_ptr, (rows * K)[:, None] + cols[None, :], out_MK, mask_MK)


@register_kernel("hadamard_transform_16", "triton")
def _hadamard_transform_16(x_MK: torch.Tensor, seed: int, out_MK: torch.Tensor) -> None:
    M, K = x_MK.shape
    tiles = HADAMARD_TILES
    _hadamard_kernel[(triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)](
        x_MK,
        out_MK,
        M,
        K,
        *x_MK.stride(),
        seed,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
        **EXACT,
    )
