"""The two-pass Triton kernel of the FP8 block-format quantize, for 1 x b blocks (launched by
`_triton_quantize`, whose legend applies). Also: `_CK` is a chunk of rows of one block of rows
by the program's columns, `_SK` a step of the second pass, `_CB` a chunk's rowwise blocks, `_K`
one per column.

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
interpreter keep `encode_fp8`; benchmarks/sweep_blocks.py and the cuda tests check the GPU's codes).
SASS for sm_90 (Triton 3.9, bf16): 55 -> 26-32 instructions per element for MXFP8 both usages,
43 -> 22-31 and 249 -> 80-130 registers for 1 x 128 both usages.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from quant_core.blocks._triton_scales import _power_of_two_scale, _store_scales
from quant_core.shared._triton_numerics import encode_fp8, finite_abs, store_bytes


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
