"""Triton kernels of the FP8 block formats: blockwise FP8 (1 x 128, 128 x 128) and MXFP8 (1 x 32).

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); a program
quantizes one TILE_M x TILE_K tile (both multiples of the block) and writes every usage from
that one read ([Note: block layouts] in `blocks/_layout.py`): rowwise codes `rowwise_MK` with one
scale per 1 x BLOCK run (`*_MB`: TILE_M x TILE_K/BLOCK), columnwise codes (x^T, `columnwise_KM`)
with one scale per BLOCK x 1 run (`*_BK`: TILE_M/BLOCK x TILE_K), transposed through shared
memory; a 128 x 128 tile has one scale for both. Scales are stored as the reference stores them:
fp32 `scale_inv` (blockwise), E8M0 bytes (MXFP8). 1 x b blocks can also take the two-pass kernel
([Note: two-pass block quantize]): `_CK` is a chunk of rows of one block of rows by the program's
columns, `_SK` a step of the second pass, `_CB` a chunk's rowwise blocks, `_K` one per column.
Each kernel maps its program to a tile and runs a tile body (`_quantize_tile`,
`_quantize_two_pass_tile`) that the multi-tensor kernels share ([Note: multi-tensor block
quantize] in `blocks._triton_many`).

[Note: two-pass block quantize] A columnwise 1 x b code needs the amax of its column over b rows
first. `_quantize_blocks_kernel` reduces a whole tile along both axes: it keeps the tile, two
encodes and cross-thread reductions live (H100, bf16 8192^2, ncu: 1 x 128 at 254 registers and
12.5% occupancy; MXFP8 bound on L1, its SASS has 5 shuffles and 3 shared-memory accesses per
element for the column reduction and the transpose). The
two-pass kernel walks each block of rows in chunks. Pass one loads `chunk_m` rows at a time,
writes their rowwise codes and scales (complete within a row) and folds |x| into a running max
shaped like a chunk, elementwise in registers; one reduction of that running max gives the
column amaxes. Pass two reloads the rows `store_m` at a time (L1/L2 hits: DRAM still reads x
once) and writes the columnwise codes through the transposed tile. Live registers are bounded by
a chunk. Other savings, bit for bit the same results: power-of-two scales from amax's exponent
field (`_power_of_two_scale`), no masks when the tiles divide x (`MASKED`), and with
`early_nan` one select per element turns every NaN into +NaN before both E4M3 casts, whose
hardware code for +NaN is 0x7F, instead of a fix-up of each code after its cast (E5M2 and the
interpreter keep `encode_fp8`; scripts/sweep_blocks.py and the cuda tests check the GPU's codes).
SASS for sm_90 (Triton 3.9, bf16): 55 -> 26-32 instructions per element for MXFP8 both usages,
43 -> 22-31 and 249 -> 80-130 registers for 1 x 128 both usages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._blockwise import DequantizeFp8BlockwiseArgs, QuantizeFp8BlockwiseArgs
from quant_core.blocks._layout import quantize_buffers
from quant_core.blocks._mxfp8 import DequantizeMxfp8Args, DequantizeMxfp8PairArgs, QuantizeMxfp8Args
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
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


@dataclass(frozen=True)
class TwoPassTiles:
    """Launch choice of `_quantize_two_pass_kernel` ([Note: two-pass block quantize])."""

    tile_k: int
    """Columns per program, a multiple of the block."""
    chunk_m: int
    """Rows per step of the first pass (rowwise codes, running column max); divides the block."""
    store_m: int
    """Rows per step of the second pass (columnwise codes); divides the block."""
    num_warps: int
    """Warps per program."""
    blocks_m: int = 1
    """Blocks of rows per program, one after the other."""
    unroll: bool = True
    """Unroll the loops over chunks (all of a pass's loads in flight) or keep them rolled (fewer registers)."""
    early_nan: bool = False
    """E4M3 on the GPU: NaN -> +NaN once per element before the casts instead of after each cast."""


# Scale rules (constexpr SCALE_RULE): MXFP8's E8M0, blockwise power-of-two, blockwise fmax / amax.
_MXFP8, _POWER_OF_TWO, _FMAX_OVER_AMAX = 0, 1, 2
# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2): 1 x b blocks with a columnwise
# output (tile_m a multiple of the block; or the two-pass kernel's choice), rowwise only, 128 x 128
# tiles, dequantize. scripts/sweep_blocks.py times the candidates.
BLOCKWISE_TILES: Tiles | TwoPassTiles = TwoPassTiles(tile_k=128, chunk_m=32, store_m=128, num_warps=8)
BLOCKWISE_ROWWISE_TILES: Tiles | TwoPassTiles = Tiles(16, 128, 4)
MXFP8_TILES: Tiles | TwoPassTiles = TwoPassTiles(tile_k=128, chunk_m=4, store_m=32, num_warps=2)
MXFP8_ROWWISE_TILES: Tiles | TwoPassTiles = Tiles(32, 256, 8)
TWO_D_TILES: Tiles = Tiles(128, 128, 8)
DEQUANTIZE_TILES = Tiles(16, 256, 4)
# fp32 inputs (FusedAdam requantizes weights from their fp32 master weights; a tile holds twice
# the bytes of a bf16 one), from `python3 scripts/sweep_blocks.py --dtype float32` on an H100
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
    so that scripts/sweep_blocks.py and the tests can set them."""
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


@triton.jit
def _power_of_two_scale(amax, SCALE_RULE: tl.constexpr, E4M3: tl.constexpr):
    """`_block_scale` of finite amax >= 0, the power-of-two rules read off amax's exponent field.

    With amax = 1.m * 2^(f - 127) and fmax = 1.75 * 2^F, both rules step at m = 0.75 (0x600000).
    MXFP8: e = f - 127 - 8 + (m > 0.75) clamped to >= -127, so the E8M0 byte is
    max(f - 8 + (m > 0.75), 0) and the multiplier 2^-e = 2^(127 - byte). Blockwise:
    s = 127 + F - f - (m > 0.75) limited to 127 (0 if amax is 0), scale_inv 2^-s exactly (what
    1 / 2^s rounds to: 2^-127 is the subnormal 0x00400000). A subnormal amax (f = 0) gives
    the clamped exponent either way, so no renormalisation is needed.
    """
    if SCALE_RULE == 2:
        multiplier, stored = _block_scale(amax, SCALE_RULE, E4M3)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        field = bits >> 23
        above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        if SCALE_RULE == 0:
            biased = tl.maximum(field - 8 + above, 0)
            multiplier = ((254 - biased) << 23).to(tl.float32, bitcast=True)
            stored = biased.to(tl.uint8)
        else:
            fmax_exponent: tl.constexpr = 8 if E4M3 else 15
            exponent = tl.where(amax > 0, tl.minimum(127 + fmax_exponent - field - above, 127), 0)
            multiplier = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
            stored = tl.where(exponent < 127, (127 - exponent) << 23, 0x00400000).to(tl.float32, bitcast=True)
    return multiplier, stored


@triton.jit
def _nan_to_positive(x, EARLY_NAN: tl.constexpr):
    """x with every NaN replaced by +NaN when EARLY_NAN, else x ([Note: two-pass block quantize])."""
    if EARLY_NAN:
        x = tl.where(x == x, x, float("nan"))
    return x


@triton.jit
def _encode(v, E4M3: tl.constexpr, HARDWARE: tl.constexpr, EARLY_NAN: tl.constexpr):
    """encode_fp8(v); with EARLY_NAN (E4M3 on the GPU only) v's NaNs are +NaN, which the plain
    hardware cast already encodes as 0x7F."""
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True) if EARLY_NAN else encode_fp8(v, E4M3, HARDWARE)


@triton.jit
def _load_rows(x_ptr, rows, cols, M, K, stride_m, stride_k, MASKED: tl.constexpr):
    """fp32 rows x cols of x (0 outside it when MASKED) and the mask of the elements inside."""
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    pointers = x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :]
    values = tl.load(pointers, mask=mask, other=0.0) if MASKED else tl.load(pointers)
    return values.to(tl.float32), mask


@triton.jit
def _first_pass_chunk(
    x_ptr,
    rows,
    cols,
    block_cols,
    M,
    K,
    stride_m,
    stride_k,
    rowwise_ptr,
    rowwise_scale_ptr,
    amax_CK,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    CHUNK_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
):
    """Rowwise codes and scales of one chunk of rows; returns the running column max with the chunk's |x|."""
    x_CK, mask_CK = _load_rows(x_ptr, rows, cols, M, K, stride_m, stride_k, MASKED)
    magnitude_CK = finite_abs(x_CK)
    if ROWWISE:
        amax_CB = tl.max(tl.reshape(magnitude_CK, (CHUNK_M, TILE_K // BLOCK, BLOCK)), axis=2)
        multiplier_CB, stored_CB = _power_of_two_scale(amax_CB, SCALE_RULE, E4M3)
        blocks = tl.reshape(_nan_to_positive(x_CK, EARLY_NAN), (CHUNK_M, TILE_K // BLOCK, BLOCK))
        codes_CK = tl.reshape(_encode(blocks * multiplier_CB[:, :, None], E4M3, HARDWARE, EARLY_NAN), (CHUNK_M, TILE_K))
        store_bytes(rowwise_ptr, (rows * K)[:, None] + cols[None, :], codes_CK, mask_CK if MASKED else None)
        Kb = tl.cdiv(K, BLOCK)
        scale_mask_CB = (rows < M)[:, None] & (block_cols < Kb)[None, :] if MASKED else None
        _store_scales(rowwise_scale_ptr, (rows * Kb)[:, None] + block_cols[None, :], stored_CB, scale_mask_CB)
    if COLUMNWISE:
        amax_CK = tl.maximum(amax_CK, magnitude_CK)
    return amax_CK


@triton.jit
def _second_pass_step(
    x_ptr,
    rows,
    cols,
    M,
    K,
    stride_m,
    stride_k,
    columnwise_ptr,
    multiplier_K,
    E4M3: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
):
    """Columnwise codes of one step of rows (x^T: each of the columns gets len(rows) contiguous bytes)."""
    x_SK, mask_SK = _load_rows(x_ptr, rows, cols, M, K, stride_m, stride_k, MASKED)
    codes_SK = _encode(_nan_to_positive(x_SK, EARLY_NAN) * multiplier_K[None, :], E4M3, HARDWARE, EARLY_NAN)
    offsets_KS = (cols * M)[:, None] + rows[None, :]
    store_bytes(columnwise_ptr, offsets_KS, tl.trans(codes_SK), tl.trans(mask_SK) if MASKED else None)


@triton.jit
def _quantize_two_pass_kernel(
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
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    BLOCKS_M: tl.constexpr,
    TILE_K: tl.constexpr,
    CHUNK_M: tl.constexpr,
    STORE_M: tl.constexpr,
    UNROLL: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
):
    """Tile `program_id` of x, in row-major order of tiles (`_quantize_two_pass_tile`)."""
    col_tiles = tl.cdiv(K, TILE_K)
    _quantize_two_pass_tile(
        x_ptr, M, K, stride_m, stride_k, rowwise_ptr, rowwise_scale_ptr, columnwise_ptr, columnwise_scale_ptr,
        tl.program_id(0) // col_tiles, tl.program_id(0) % col_tiles,
        ROWWISE, COLUMNWISE, BLOCK, SCALE_RULE, E4M3, BLOCKS_M, TILE_K, CHUNK_M, STORE_M, UNROLL, HARDWARE, MASKED,
        EARLY_NAN,
    )  # fmt: skip


@triton.jit
def _quantize_two_pass_tile(
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
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    BLOCKS_M: tl.constexpr,
    TILE_K: tl.constexpr,
    CHUNK_M: tl.constexpr,
    STORE_M: tl.constexpr,
    UNROLL: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
):
    """Tile (tile_m, tile_k) of x: BLOCKS_M blocks of rows x TILE_K columns, 1 x BLOCK blocks, in
    two passes per block of rows ([Note: two-pass block quantize]). The body of the single- and
    the multi-tensor kernel."""
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    block_cols = tile_k * (TILE_K // BLOCK) + tl.arange(0, TILE_K // BLOCK)
    Mb = tl.cdiv(M, BLOCK)
    for b in tl.static_range(BLOCKS_M):
        block_row = tile_m * BLOCKS_M + b
        first_row = block_row.to(tl.int64) * BLOCK
        amax_CK = tl.zeros((CHUNK_M, TILE_K), dtype=tl.float32)
        if UNROLL:
            for c in tl.static_range(BLOCK // CHUNK_M):
                rows = first_row + c * CHUNK_M + tl.arange(0, CHUNK_M)
                amax_CK = _first_pass_chunk(
                    x_ptr, rows, cols, block_cols, M, K, stride_m, stride_k, rowwise_ptr, rowwise_scale_ptr, amax_CK,
                    ROWWISE, COLUMNWISE, BLOCK, SCALE_RULE, E4M3, CHUNK_M, TILE_K, HARDWARE, MASKED, EARLY_NAN,
                )  # fmt: skip
        else:
            for c in range(BLOCK // CHUNK_M):
                rows = first_row + c * CHUNK_M + tl.arange(0, CHUNK_M)
                amax_CK = _first_pass_chunk(
                    x_ptr, rows, cols, block_cols, M, K, stride_m, stride_k, rowwise_ptr, rowwise_scale_ptr, amax_CK,
                    ROWWISE, COLUMNWISE, BLOCK, SCALE_RULE, E4M3, CHUNK_M, TILE_K, HARDWARE, MASKED, EARLY_NAN,
                )  # fmt: skip
        if COLUMNWISE:
            multiplier_K, stored_K = _power_of_two_scale(tl.max(amax_CK, axis=0), SCALE_RULE, E4M3)
            # Columnwise scales are (K, Mb): entry (k, block row).
            scale_mask_K = cols < tl.where(block_row < Mb, K, 0) if MASKED else None
            _store_scales(columnwise_scale_ptr, block_row + cols * Mb, stored_K, scale_mask_K)
            if UNROLL:
                for c in tl.static_range(BLOCK // STORE_M):
                    rows = first_row + c * STORE_M + tl.arange(0, STORE_M)
                    _second_pass_step(
                        x_ptr, rows, cols, M, K, stride_m, stride_k, columnwise_ptr, multiplier_K,
                        E4M3, HARDWARE, MASKED, EARLY_NAN,
                    )  # fmt: skip
            else:
                for c in range(BLOCK // STORE_M):
                    rows = first_row + c * STORE_M + tl.arange(0, STORE_M)
                    _second_pass_step(
                        x_ptr, rows, cols, M, K, stride_m, stride_k, columnwise_ptr, multiplier_K,
                        E4M3, HARDWARE, MASKED, EARLY_NAN,
                    )  # fmt: skip


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
