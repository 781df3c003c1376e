"""Triton kernels of per-tensor FP8 (`_fp8.py`): amax, the cast with its transpose, dequantize, byte transpose.

Legend: `x_MK` is the input viewed as (M, K) and read through (stride_m, stride_k); `rowwise_MK`
and `columnwise_KM` are contiguous outputs of FP8 codes (stored through uint8 views); a tile is
TILE_M x TILE_K elements of x, one per program, the program index running fastest along K.
The transposed side goes through shared memory (`tl.trans` of the tile's codes), so each
program writes TILE_M contiguous bytes to each of TILE_K columnwise rows.
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
    store_bytes,
    store_values,
)

# Tuned on an H100 (docs/benchmarks.md, tile sweep at bf16 8192^2): tiles of the strided amax, the
# flat amax of contiguous inputs (tile_m 1), the cast with and without a transposed output,
# dequantize, transpose.
AMAX_TILES = Tiles(16, 256, 8)
AMAX_FLAT_TILES = Tiles(1, 2048, 4)
CAST_TILES = Tiles(64, 256, 8)
CAST_ROWWISE_TILES = Tiles(1, 2048, 4)
DEQUANTIZE_BLOCK = 2048
TRANSPOSE_TILES = Tiles(128, 128, 8)
# Programs of an amax launch, about: enough to fill the GPU, few enough that atomics stay rare.
_AMAX_PROGRAMS = 1024


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k, tiles_per_program, TILE_M: tl.constexpr, TILE_K: tl.constexpr
):
    """max |x| over the finite elements of `tiles_per_program` tiles along K; one atomic per program."""
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    row_offsets_M = rows.to(tl.int64) * stride_m
    largest_MK = tl.zeros((TILE_M, TILE_K), dtype=tl.float32)
    first_col = tl.program_id(1).to(tl.int64) * tiles_per_program * TILE_K
    for t in range(tiles_per_program):
        cols = first_col + t * TILE_K + tl.arange(0, TILE_K)
        mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
        x_MK = tl.load(x_ptr + row_offsets_M[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
        largest_MK = tl.maximum(largest_MK, finite_abs(x_MK))
    tl.atomic_max(amax_ptr, tl.max(largest_MK))


@register_kernel("amax", "triton")
def _amax(x_MK: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((), dtype=torch.float32, device=x_MK.device)
    if x_MK.stride(0) < x_MK.stride(1):  # amax ignores order: read along the unit stride
        x_MK = x_MK.t()
    tiles = AMAX_TILES
    if x_MK.is_contiguous():
        x_MK, tiles = x_MK.view(1, -1), AMAX_FLAT_TILES
    M, K = x_MK.shape
    row_tiles, col_tiles = triton.cdiv(M, tiles.tile_m), triton.cdiv(K, tiles.tile_k)
    tiles_per_program = max(1, min(col_tiles, row_tiles * col_tiles // _AMAX_PROGRAMS))
    grid = (row_tiles, triton.cdiv(col_tiles, tiles_per_program))
    _amax_kernel[grid](
        x_MK,
        out,
        M,
        K,
        *x_MK.stride(),
        tiles_per_program,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )
    return out


@triton.jit
def _cast_kernel(
    x_ptr,
    scale_ptr,
    rowwise_ptr,
    columnwise_ptr,
    M,
    K,
    stride_m,
    stride_k,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    E4M3: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """codes = fp8(x * scale) of one tile, written rowwise and/or transposed."""
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((tl.program_id(0) // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    codes_MK = encode_fp8(x_MK.to(tl.float32) * tl.load(scale_ptr), E4M3, HARDWARE)
    if ROWWISE:
        store_bytes(rowwise_ptr, (rows * K)[:, None] + cols[None, :], codes_MK, mask_MK)
    if COLUMNWISE:
        store_bytes(columnwise_ptr, (cols * M)[:, None] + rows[None, :], tl.trans(codes_MK), tl.trans(mask_MK))


@register_kernel("cast_to_fp8", "triton")
def _cast_to_fp8(
    x_MK: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise_MK: torch.Tensor | None,
    columnwise_KM: torch.Tensor | None,
) -> None:
    tiles = CAST_TILES
    if columnwise_KM is None and x_MK.is_contiguous():
        x_MK, rowwise_MK, tiles = x_MK.view(1, -1), rowwise_MK.view(1, -1), CAST_ROWWISE_TILES
    M, K = x_MK.shape
    _cast_kernel[(triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)](
        x_MK,
        scale,
        rowwise_MK,
        columnwise_KM,
        M,
        K,
        *x_MK.stride(),
        ROWWISE=rowwise_MK is not None,
        COLUMNWISE=columnwise_KM is not None,
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@triton.jit
def _dequantize_fp8_kernel(
    data_ptr,
    scale_inv_ptr,
    out_ptr,
    n,
    E4M3: tl.constexpr,
    BLOCK: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """out = fp32(code) * scale_inv over BLOCK consecutive elements, rounded to the output dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    codes = as_bytes(tl.load(data_ptr + offsets, mask=mask))
    store_values(out_ptr, offsets, decode_fp8(codes, E4M3, HARDWARE) * tl.load(scale_inv_ptr), mask)


@register_kernel("dequantize_fp8", "triton")
def _dequantize_fp8(data_MK: torch.Tensor, scale_inv: torch.Tensor, out_MK: torch.Tensor) -> None:
    n = data_MK.numel()
    _dequantize_fp8_kernel[(triton.cdiv(n, DEQUANTIZE_BLOCK),)](
        data_MK,
        scale_inv,
        out_MK,
        n,
        E4M3=data_MK.dtype == torch.float8_e4m3fn,
        BLOCK=DEQUANTIZE_BLOCK,
        HARDWARE=HARDWARE_FP8,
        num_warps=8,
        **EXACT,
    )


@triton.jit
def _transpose_bytes_kernel(data_ptr, out_ptr, M, K, stride_m, stride_k, TILE_M: tl.constexpr, TILE_K: tl.constexpr):
    """out_KM = data_MK^T for one tile, through shared memory."""
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((tl.program_id(0) // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    data_MK = tl.load(data_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK)
    tl.store(out_ptr + (cols * M)[:, None] + rows[None, :], tl.trans(data_MK), mask=tl.trans(mask_MK))


@register_kernel("transpose_bytes", "triton")
def _transpose_bytes(data_MK: torch.Tensor, out_KM: torch.Tensor) -> None:
    M, K = data_MK.shape
    tiles = TRANSPOSE_TILES
    _transpose_bytes_kernel[(triton.cdiv(M, tiles.tile_m) * triton.cdiv(K, tiles.tile_k),)](
        data_MK,
        out_KM,
        M,
        K,
        *data_MK.stride(),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )
