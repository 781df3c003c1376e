"""Triton kernels of the NVFP4 dequantize (`_dequantize.py`): the "pairs" and "elementwise"
variants, both operands of an emulated GEMM in one launch, and the pass after that GEMM
([Note: NVFP4 GEMM output]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.nvfp4._dequantize import DequantizeNvfp4Args, DequantizeNvfp4PairArgs, Nvfp4GemmOutputArgs
from quant_core.nvfp4._triton_numerics import _block_factor, _decode_e2m1, _decode_nibbles, tensor_scale
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import EXACT, HARDWARE_FP8, Tiles, as_bytes, store_values

# Kernel choices, tuned on an H100 (`python3 benchmarks/sweep_nvfp4.py`, bf16 8192^2,
# docs/benchmarks.md): "pairs" (DEQUANTIZE_PAIRS_TILES) or "elementwise"
# (`_dequantize_nvfp4_kernel`, DEQUANTIZE_TILES).
DEQUANTIZE_VARIANT = "pairs"
DEQUANTIZE_PAIRS_TILES = Tiles(8, 512, 4)
DEQUANTIZE_TILES = Tiles(8, 512, 4)
# nvfp4_gemm_output: an elementwise pass, tile_k elements per program (`sweep_nvfp4.py gemm-output`:
# 1024-8192 elements with 4 or 8 warps all within 1%, ~100% of copy bandwidth).
GEMM_OUTPUT_TILES = Tiles(1, 4096, 8)


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
