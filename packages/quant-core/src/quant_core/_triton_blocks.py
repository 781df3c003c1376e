"""Triton kernels of the FP8 block formats: blockwise FP8 (1 x 128, 128 x 128) and MXFP8 (1 x 32).

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); a program
quantizes one TILE_M x TILE_K tile (both multiples of the block) and writes every usage from
that one read ([Note: block layouts] in `_blocks.py`): rowwise codes `rowwise_MK` with one
scale per 1 x BLOCK run (`*_MB`: TILE_M x TILE_K/BLOCK), columnwise codes (x^T, `columnwise_KM`)
with one scale per BLOCK x 1 run (`*_BK`: TILE_M/BLOCK x TILE_K), transposed through shared
memory; a 128 x 128 tile has one scale for both. Scales are stored as the reference stores them:
fp32 `scale_inv` (blockwise), E8M0 bytes (MXFP8).
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
    encode_fp8,
    finite_abs,
    max_exponent_within,
    power_of_two,
    store_bytes,
    store_values,
)

# Scale rules (constexpr SCALE_RULE): MXFP8's E8M0, blockwise power-of-two, blockwise fmax / amax.
_MXFP8, _POWER_OF_TWO, _FMAX_OVER_AMAX = 0, 1, 2
# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2): 1 x b blocks with a columnwise
# output (tile_m a multiple of the block), rowwise only, 128 x 128 tiles, dequantize.
BLOCKWISE_TILES = Tiles(128, 128, 8)
BLOCKWISE_ROWWISE_TILES = Tiles(16, 128, 4)
MXFP8_TILES = Tiles(64, 64, 4)
MXFP8_ROWWISE_TILES = Tiles(32, 256, 8)
TWO_D_TILES = Tiles(128, 128, 8)
DEQUANTIZE_TILES = Tiles(16, 256, 4)


@triton.jit
def _block_scale(amax, SCALE_RULE: tl.constexpr, E4M3: tl.constexpr):
    """(multiplier applied before encoding, stored dequantization scale) of blocks with this amax."""
    if SCALE_RULE == 0:
        # MXFP8: e = smallest integer with amax <= 448 * 2^e, in [-127, 127]; stored e + 127.
        exponent = tl.minimum(tl.maximum(-max_exponent_within(amax, 8, 0x600000), -127), 127)
        multiplier = power_of_two(-exponent)
        stored = (exponent + 127).to(tl.uint8)
    else:
        if SCALE_RULE == 1:
            fmax_exponent: tl.constexpr = 8 if E4M3 else 15  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
            exponent = tl.where(amax > 0, tl.minimum(max_exponent_within(amax, fmax_exponent, 0x600000), 127), 0)
            multiplier = power_of_two(exponent)
        else:
            fmax: tl.constexpr = 448.0 if E4M3 else 57344.0
            multiplier = tl.where(amax > 0, tl.minimum(tl.div_rn(fmax, amax), 3.4028234663852886e38), 1.0)
        stored = tl.div_rn(1.0, multiplier)
    return multiplier, stored


@triton.jit
def _store_scales(ptr, offsets, stored, mask):
    """Stores block scales: fp32 scale_inv as they are, E8M0 bytes through store_bytes."""
    if ptr.dtype.element_ty == tl.float32:
        tl.store(ptr + offsets, stored, mask=mask)
    else:
        store_bytes(ptr, offsets, stored, mask)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    rowwise_ptr,
    rowwise_scale_ptr,
    columnwise_ptr,
    columnwise_scale_ptr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO_D: tl.constexpr,
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """One tile of x: its codes and scales in every usage asked for (2-D tiles, reshaped into blocks)."""
    col_tiles = tl.cdiv(K, TILE_K)
    tile_m = tl.program_id(0) // col_tiles
    tile_k = tl.program_id(0) % col_tiles
    rows = (tile_m * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    x_MK = x_MK.to(tl.float32)
    Mb = tl.cdiv(M, BLOCK)
    Kb = tl.cdiv(K, BLOCK)
    rowwise_offsets_MK = (rows * K)[:, None] + cols[None, :]
    columnwise_offsets_KM = (cols * M)[:, None] + rows[None, :]
    if TWO_D:
        multiplier, stored = _block_scale(tl.max(finite_abs(x_MK)), SCALE_RULE, E4M3)
        codes_MK = encode_fp8(x_MK * multiplier, E4M3, HARDWARE)
        if ROWWISE:
            store_bytes(rowwise_ptr, rowwise_offsets_MK, codes_MK, mask_MK)
            tl.store(rowwise_scale_ptr + tile_m * Kb + tile_k, stored)
        if COLUMNWISE:
            store_bytes(columnwise_ptr, columnwise_offsets_KM, tl.trans(codes_MK), tl.trans(mask_MK))
            tl.store(columnwise_scale_ptr + tile_k * Mb + tile_m, stored)
    else:
        if ROWWISE:
            blocks = tl.reshape(x_MK, (TILE_M, TILE_K // BLOCK, BLOCK))
            multiplier_MB, stored_MB = _block_scale(tl.max(finite_abs(blocks), axis=2), SCALE_RULE, E4M3)
            codes_MK = tl.reshape(encode_fp8(blocks * multiplier_MB[:, :, None], E4M3, HARDWARE), (TILE_M, TILE_K))
            store_bytes(rowwise_ptr, rowwise_offsets_MK, codes_MK, mask_MK)
            block_cols = tile_k * (TILE_K // BLOCK) + tl.arange(0, TILE_K // BLOCK)
            scale_mask_MB = (rows < M)[:, None] & (block_cols < Kb)[None, :]
            _store_scales(rowwise_scale_ptr, (rows * Kb)[:, None] + block_cols[None, :], stored_MB, scale_mask_MB)
        if COLUMNWISE:
            blocks = tl.reshape(x_MK, (TILE_M // BLOCK, BLOCK, TILE_K))
            multiplier_BK, stored_BK = _block_scale(tl.max(finite_abs(blocks), axis=1), SCALE_RULE, E4M3)
            codes_MK = tl.reshape(encode_fp8(blocks * multiplier_BK[:, None, :], E4M3, HARDWARE), (TILE_M, TILE_K))
            store_bytes(columnwise_ptr, columnwise_offsets_KM, tl.trans(codes_MK), tl.trans(mask_MK))
            # Columnwise scales are (K, Mb): entry (k, block row).
            block_rows = tile_m * (TILE_M // BLOCK) + tl.arange(0, TILE_M // BLOCK)
            scale_mask_BK = (block_rows < Mb)[:, None] & (cols < K)[None, :]
            _store_scales(columnwise_scale_ptr, block_rows[:, None] + (cols * Mb)[None, :], stored_BK, scale_mask_BK)


def _launch_quantize(
    x_MK: torch.Tensor,
    buffers: tuple[torch.Tensor | None, ...],
    *,
    block: int,
    two_d: bool,
    scale_rule: int,
    fp8_dtype: torch.dtype,
    tiles: Tiles,
) -> None:
    rowwise, rowwise_scale, columnwise, columnwise_scale = buffers
    M, K = x_MK.shape
    grid = (triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)
    _quantize_blocks_kernel[grid](
        x_MK,
        M,
        K,
        *x_MK.stride(),
        rowwise,
        rowwise_scale,
        columnwise,
        columnwise_scale,
        ROWWISE=rowwise is not None,
        COLUMNWISE=columnwise is not None,
        BLOCK=block,
        SCALE_RULE=scale_rule,
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        TWO_D=two_d,
        **EXACT,
    )


@register_kernel("quantize_fp8_blockwise", "triton")
def _quantize_fp8_blockwise(
    x_MK: torch.Tensor, block_rows: int, fp8_dtype: torch.dtype, power_2_scales: bool, *buffers: torch.Tensor | None
) -> None:
    two_d = block_rows > 1
    tiles = TWO_D_TILES if two_d else BLOCKWISE_ROWWISE_TILES if buffers[2] is None else BLOCKWISE_TILES
    rule = _POWER_OF_TWO if power_2_scales else _FMAX_OVER_AMAX
    _launch_quantize(x_MK, buffers, block=128, two_d=two_d, scale_rule=rule, fp8_dtype=fp8_dtype, tiles=tiles)


@register_kernel("quantize_mxfp8", "triton")
def _quantize_mxfp8(x_MK: torch.Tensor, *buffers: torch.Tensor | None) -> None:
    tiles = MXFP8_ROWWISE_TILES if buffers[2] is None else MXFP8_TILES
    _launch_quantize(
        x_MK, buffers, block=32, two_d=False, scale_rule=_MXFP8, fp8_dtype=torch.float8_e4m3fn, tiles=tiles
    )


@triton.jit
def _dequantize_blocks_kernel(
    data_ptr,
    scale_ptr,
    out_ptr,
    R,
    C,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    E4M3: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """out = fp32(code) * factor of its block, for one tile of contiguous (R, C) data read as
    (TILE_R, TILE_C/BLOCK, BLOCK): one factor per (row, block column)."""
    col_tiles = tl.cdiv(C, TILE_C)
    rows = ((tl.program_id(0) // col_tiles) * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)
    block_cols = (tl.program_id(0) % col_tiles) * (TILE_C // BLOCK) + tl.arange(0, TILE_C // BLOCK)
    cols_3 = (block_cols[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]).to(tl.int64)
    mask_3 = (rows[:, None, None] < R) & (cols_3 < C)
    offsets_3 = rows[:, None, None] * C + cols_3
    codes = as_bytes(tl.load(data_ptr + offsets_3, mask=mask_3))
    Cb = tl.cdiv(C, BLOCK)
    scale_mask = (rows < R)[:, None] & (block_cols < Cb)[None, :]
    stored = tl.load(scale_ptr + ((rows // BLOCK_ROWS) * Cb)[:, None] + block_cols[None, :], mask=scale_mask, other=0)
    # fp32 scale_inv as stored, or E8M0 bytes: 2^(byte - 127).
    factor = stored if scale_ptr.dtype.element_ty == tl.float32 else power_of_two(stored.to(tl.int32) - 127)
    store_values(out_ptr, offsets_3, decode_fp8(codes, E4M3, HARDWARE) * factor[:, :, None], mask_3)


def _launch_dequantize(
    data_2d: torch.Tensor, scale_inv: torch.Tensor, out_2d: torch.Tensor, *, block_rows: int, block: int
) -> None:
    R, C = data_2d.shape
    tiles = DEQUANTIZE_TILES
    _dequantize_blocks_kernel[(triton.cdiv(R, tiles.tile_m) * triton.cdiv(C, tiles.tile_k),)](
        data_2d,
        scale_inv,
        out_2d,
        R,
        C,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        E4M3=data_2d.dtype == torch.float8_e4m3fn,
        TILE_R=tiles.tile_m,
        TILE_C=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@register_kernel("dequantize_fp8_blockwise", "triton")
def _dequantize_fp8_blockwise(
    data_2d: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, out_2d: torch.Tensor
) -> None:
    _launch_dequantize(data_2d, scale_inv, out_2d, block_rows=block_rows, block=128)


@register_kernel("dequantize_mxfp8", "triton")
def _dequantize_mxfp8(data_2d: torch.Tensor, scale_inv: torch.Tensor, out_2d: torch.Tensor) -> None:
    _launch_dequantize(data_2d, scale_inv, out_2d, block_rows=1, block=32)
