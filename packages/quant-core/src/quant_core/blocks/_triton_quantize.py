"""Triton kernels of the FP8 block-format quantize, blockwise FP8 (1 x 128, 128 x 128) and MXFP8
(1 x 32): their launch choices and launches.

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); a program
quantizes one TILE_M x TILE_K tile (both multiples of the block) and writes every usage from
that one read ([Note: block layouts] in `blocks/_layout.py`): rowwise codes `rowwise_MK` with one
scale per 1 x BLOCK run (`*_MB`: TILE_M x TILE_K/BLOCK), columnwise codes (x^T, `columnwise_KM`)
with one scale per BLOCK x 1 run (`*_BK`: TILE_M/BLOCK x TILE_K), transposed through shared
memory; a 128 x 128 tile has one scale for both. Scales are stored as the reference stores them:
fp32 `scale_inv` (blockwise), E8M0 bytes (MXFP8).
1 x b blocks can also take the two-pass kernel (`_triton_two_pass`, [Note: two-pass block
quantize]); the block scales of every rule are in `_triton_scales`.
Each kernel maps its program to a tile and runs a tile body (`_quantize_tile`,
`_quantize_two_pass_tile`) that the multi-tensor kernels share ([Note: multi-tensor block
quantize] in `blocks._triton_many`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._layout import quantize_buffers
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.blocks._triton_scales import _FMAX_OVER_AMAX, _MXFP8, _POWER_OF_TWO, _block_scale, _store_scales
from quant_core.blocks._triton_two_pass import TwoPassTiles, _quantize_two_pass_kernel
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import EXACT, HARDWARE_FP8, Tiles, encode_fp8, finite_abs, store_bytes

# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2): 1 x b blocks with a columnwise
# output (tile_m a multiple of the block; or the two-pass kernel's choice), rowwise only, 128 x 128
# tiles. benchmarks/sweep_blocks.py times the candidates.
BLOCKWISE_TILES: Tiles | TwoPassTiles = TwoPassTiles(tile_k=128, chunk_m=32, store_m=128, num_warps=8)
BLOCKWISE_ROWWISE_TILES: Tiles | TwoPassTiles = Tiles(16, 128, 4)
MXFP8_TILES: Tiles | TwoPassTiles = TwoPassTiles(tile_k=128, chunk_m=4, store_m=32, num_warps=2)
MXFP8_ROWWISE_TILES: Tiles | TwoPassTiles = Tiles(32, 256, 8)
TWO_D_TILES: Tiles = Tiles(128, 128, 8)
# fp32 inputs (FusedAdam requantizes weights from their fp32 master weights; a tile holds twice
# the bytes of a bf16 one), from `python3 benchmarks/sweep_blocks.py --dtype float32` on an H100
# (docs/benchmarks.md, kernels): MXFP8 with both usages runs fastest as one 2-D tile
# (163.5 vs 189.4 us two-pass at 8192^2), 1 x 128 with NaN handled early (186.8 vs 215.7). fp16
# inputs take the bf16 choices; MXFP8 rowwise only has one for every dtype (the sweep has no case
# for it). `_tiles_for` says which constant each quantize reads.
BLOCKWISE_FP32_TILES: Tiles | TwoPassTiles = TwoPassTiles(
    tile_k=128, chunk_m=32, store_m=64, num_warps=8, blocks_m=1, unroll=True, early_nan=True
)
BLOCKWISE_ROWWISE_FP32_TILES: Tiles | TwoPassTiles = Tiles(4, 128, 2)
MXFP8_FP32_TILES: Tiles | TwoPassTiles = Tiles(32, 64, 2)
TWO_D_FP32_TILES: Tiles = TWO_D_TILES


def _tiles_for(format: str, columnwise: bool, dtype: torch.dtype) -> Tiles | TwoPassTiles:
    """Launch choice of a quantize: `format` 'mxfp8', '1x128' or '128x128' (blockwise), with or
    without a columnwise output, of an input of `dtype`. Reads the module constants at each call,
    so that benchmarks/sweep_blocks.py and the tests can set them."""
    fp32 = dtype == torch.float32
    if format == "128x128":
        return TWO_D_FP32_TILES if fp32 else TWO_D_TILES
    if format == "1x128":
        if columnwise:
            return BLOCKWISE_FP32_TILES if fp32 else BLOCKWISE_TILES
        return BLOCKWISE_ROWWISE_FP32_TILES if fp32 else BLOCKWISE_ROWWISE_TILES
    assert format == "mxfp8", format
    if columnwise:
        return MXFP8_FP32_TILES if fp32 else MXFP8_TILES
    return MXFP8_ROWWISE_TILES


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
    """Tile `program_id` of x, in row-major order of tiles (`_quantize_tile`)."""
    col_tiles = tl.cdiv(K, TILE_K)
    _quantize_tile(
        x_ptr, M, K, stride_m, stride_k, rowwise_ptr, rowwise_scale_ptr, columnwise_ptr, columnwise_scale_ptr,
        tl.program_id(0) // col_tiles, tl.program_id(0) % col_tiles,
        ROWWISE, COLUMNWISE, BLOCK, TWO_D, SCALE_RULE, E4M3, TILE_M, TILE_K, HARDWARE,
    )  # fmt: skip


@triton.jit
def _quantize_tile(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    rowwise_ptr,
    rowwise_scale_ptr,
    columnwise_ptr,
    columnwise_scale_ptr,
    tile_m,
    tile_k,
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
    """Tile (tile_m, tile_k) of x: its codes and scales in every usage asked for (2-D tiles,
    reshaped into blocks). The body of the single- and the multi-tensor kernel."""
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


def _tile_shape(tiles: Tiles | TwoPassTiles, block: int) -> tuple[int, int]:
    """(rows, columns) of x that one program of a launch with these tiles quantizes."""
    if isinstance(tiles, TwoPassTiles):
        return tiles.blocks_m * block, tiles.tile_k
    return tiles.tile_m, tiles.tile_k


@functools.cache  # on every launch's host path; a handful of distinct calls per model
def _launch_options(
    tiles: Tiles | TwoPassTiles,
    *,
    block: int,
    two_d: bool,
    scale_rule: int,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    masked: bool,
) -> dict[str, object]:
    """The constexprs and launch options of a quantize with these tiles: `_quantize_two_pass_kernel`'s
    for TwoPassTiles (`masked`: some tile is partial), else `_quantize_blocks_kernel`'s. One dict
    per distinct call: read it, never change it."""
    e4m3 = fp8_dtype == torch.float8_e4m3fn
    common = dict(
        BLOCK=block, SCALE_RULE=scale_rule, E4M3=e4m3, HARDWARE=HARDWARE_FP8, ROWWISE=rowwise, COLUMNWISE=columnwise
    )
    if isinstance(tiles, TwoPassTiles):
        assert not two_d, "128 x 128 tiles take _quantize_blocks_kernel"
        assert tiles.tile_k % block == 0, tiles
        assert block % tiles.chunk_m == 0, tiles
        assert block % tiles.store_m == 0, tiles
        return dict(
            BLOCKS_M=tiles.blocks_m,
            TILE_K=tiles.tile_k,
            CHUNK_M=tiles.chunk_m,
            STORE_M=tiles.store_m,
            UNROLL=tiles.unroll,
            MASKED=masked,
            EARLY_NAN=tiles.early_nan and e4m3 and HARDWARE_FP8,
            num_warps=tiles.num_warps,
            **common,
            **EXACT,
        )
    return dict(TWO_D=two_d, TILE_M=tiles.tile_m, TILE_K=tiles.tile_k, num_warps=tiles.num_warps, **common, **EXACT)


def _launch_quantize(
    x_MK: torch.Tensor,
    buffers: tuple[torch.Tensor | None, ...],
    *,
    block: int,
    two_d: bool,
    scale_rule: int,
    fp8_dtype: torch.dtype,
    tiles: Tiles | TwoPassTiles,
) -> None:
    rowwise, rowwise_scale, columnwise, columnwise_scale = buffers
    M, K = x_MK.shape
    tile_m, tile_k = _tile_shape(tiles, block)
    options = _launch_options(
        tiles,
        block=block,
        two_d=two_d,
        scale_rule=scale_rule,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise is not None,
        columnwise=columnwise is not None,
        masked=M % tile_m != 0 or K % tile_k != 0,
    )
    kernel = _quantize_two_pass_kernel if isinstance(tiles, TwoPassTiles) else _quantize_blocks_kernel
    grid = (cdiv(M, tile_m) * cdiv(K, tile_k),)
    launch(kernel, grid, x_MK, M, K, *x_MK.stride(), rowwise, rowwise_scale, columnwise, columnwise_scale, **options)


@functools.cache
def blockwise_format(block_rows: int, fp8_dtype: torch.dtype, power_2_scales: bool) -> tuple[str, dict[str, object]]:
    """(`_tiles_for`'s format, `_launch_quantize`'s format arguments) of a blockwise FP8 quantize
    (one object per configuration: read it, never change it)."""
    two_d = block_rows > 1
    rule = _POWER_OF_TWO if power_2_scales else _FMAX_OVER_AMAX
    return "128x128" if two_d else "1x128", dict(block=128, two_d=two_d, scale_rule=rule, fp8_dtype=fp8_dtype)


MXFP8_FORMAT: tuple[str, dict[str, object]] = (
    "mxfp8",
    dict(block=32, two_d=False, scale_rule=_MXFP8, fp8_dtype=torch.float8_e4m3fn),
)


@register_kernel("quantize_fp8_blockwise", "triton", traceable=True)
def _quantize_fp8_blockwise(args: QuantizeFp8BlockwiseArgs) -> None:
    tiles_format, launch_format = blockwise_format(args.block_rows, args.fp8_dtype, args.power_2_scales)
    tiles = _tiles_for(tiles_format, args.columnwise_data is not None, args.x_MK.dtype)
    _launch_quantize(args.x_MK, quantize_buffers(args), tiles=tiles, **launch_format)


@register_kernel("quantize_mxfp8", "triton", traceable=True)
def _quantize_mxfp8(args: QuantizeMxfp8Args) -> None:
    tiles_format, launch_format = MXFP8_FORMAT
    tiles = _tiles_for(tiles_format, args.columnwise_data is not None, args.x_MK.dtype)
    _launch_quantize(args.x_MK, quantize_buffers(args), tiles=tiles, **launch_format)
