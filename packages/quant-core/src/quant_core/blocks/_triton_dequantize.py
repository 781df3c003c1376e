"""Triton kernels of the FP8 block-format dequantize, blockwise FP8 and MXFP8: one operand, or both
operands of an emulated GEMM in one launch ([Note: dequantizing two operands] in
quant_core.blocks._layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._blockwise import DequantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import DequantizeMxfp8Args, DequantizeMxfp8PairArgs
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
    EXACT,
    HARDWARE_FP8,
    Tiles,
    as_bytes,
    decode_fp8,
    power_of_two,
    store_values,
)

# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2).
DEQUANTIZE_TILES = Tiles(16, 256, 4)


@triton.jit
def _dequantize_blocks_tile(
    tile,
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
    """out = fp32(code) * factor of its block, for tile `tile` of contiguous (R, C) data read as
    (TILE_R, TILE_C/BLOCK, BLOCK): one factor per (row, block column)."""
    col_tiles = tl.cdiv(C, TILE_C)
    rows = ((tile // col_tiles) * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)
    block_cols = (tile % col_tiles) * (TILE_C // BLOCK) + tl.arange(0, TILE_C // BLOCK)
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
    """One program per tile of `_dequantize_blocks_tile`."""
    _dequantize_blocks_tile(
        tl.program_id(0), data_ptr, scale_ptr, out_ptr, R, C, BLOCK_ROWS, BLOCK, E4M3, TILE_R, TILE_C, HARDWARE
    )


@triton.jit
def _dequantize_blocks_pair_kernel(
    a_data_ptr,
    a_scale_ptr,
    a_out_ptr,
    a_R,
    a_C,
    b_data_ptr,
    b_scale_ptr,
    b_out_ptr,
    b_R,
    b_C,
    A_BLOCK_ROWS: tl.constexpr,
    B_BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    A_E4M3: tl.constexpr,
    B_E4M3: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """A's tiles, then B's ([Note: dequantizing two operands] in quant_core.blocks._layout)."""
    a_tiles = tl.cdiv(a_R, TILE_R) * tl.cdiv(a_C, TILE_C)
    tile = tl.program_id(0)
    if tile < a_tiles:
        _dequantize_blocks_tile(
            tile, a_data_ptr, a_scale_ptr, a_out_ptr, a_R, a_C, A_BLOCK_ROWS, BLOCK, A_E4M3, TILE_R, TILE_C, HARDWARE
        )
    else:
        _dequantize_blocks_tile(
            tile - a_tiles,
            b_data_ptr,
            b_scale_ptr,
            b_out_ptr,
            b_R,
            b_C,
            B_BLOCK_ROWS,
            BLOCK,
            B_E4M3,
            TILE_R,
            TILE_C,
            HARDWARE,
        )


def _launch_dequantize(
    data_2d: torch.Tensor, scale_inv: torch.Tensor, out_2d: torch.Tensor, *, block_rows: int, block: int
) -> None:
    R, C = data_2d.shape
    tiles = DEQUANTIZE_TILES
    launch(
        _dequantize_blocks_kernel,
        (cdiv(R, tiles.tile_m) * cdiv(C, tiles.tile_k),),
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


def _launch_dequantize_pair(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    block_rows: tuple[int, int],
    block: int,
) -> None:
    """(data_2d, scale_inv, out_2d) of A and of B in one launch, DEQUANTIZE_TILES each."""
    tiles = DEQUANTIZE_TILES
    (a_R, a_C), (b_R, b_C) = a[0].shape, b[0].shape
    launch(
        _dequantize_blocks_pair_kernel,
        (cdiv(a_R, tiles.tile_m) * cdiv(a_C, tiles.tile_k) + cdiv(b_R, tiles.tile_m) * cdiv(b_C, tiles.tile_k),),
        *a,
        a_R,
        a_C,
        *b,
        b_R,
        b_C,
        A_BLOCK_ROWS=block_rows[0],
        B_BLOCK_ROWS=block_rows[1],
        BLOCK=block,
        A_E4M3=a[0].dtype == torch.float8_e4m3fn,
        B_E4M3=b[0].dtype == torch.float8_e4m3fn,
        TILE_R=tiles.tile_m,
        TILE_C=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@register_kernel("dequantize_fp8_blockwise", "triton", traceable=True)
def _dequantize_fp8_blockwise(args: DequantizeFp8BlockwiseArgs, out_2d: torch.Tensor) -> None:
    _launch_dequantize(args.data_2d, args.scale_inv, out_2d, block_rows=args.block_rows, block=128)


@register_kernel("dequantize_mxfp8", "triton", traceable=True)
def _dequantize_mxfp8(args: DequantizeMxfp8Args, out_2d: torch.Tensor) -> None:
    _launch_dequantize(args.data_2d, args.scale_inv, out_2d, block_rows=1, block=32)


@register_kernel("dequantize_mxfp8_pair", "triton", traceable=True)
def _dequantize_mxfp8_pair(args: DequantizeMxfp8PairArgs, a_out_2d: torch.Tensor, b_out_2d: torch.Tensor) -> None:
    a, b = (args.a_data_2d, args.a_scale_inv, a_out_2d), (args.b_data_2d, args.b_scale_inv, b_out_2d)
    _launch_dequantize_pair(a, b, block_rows=(1, 1), block=32)
