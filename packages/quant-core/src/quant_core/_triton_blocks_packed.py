"""The one-read 1 x b block quantize with columnwise codes packed in registers (issue #15; a
candidate of scripts/sweep_both_usages.py, not the default until the GPU picks it).

Legend as in `_triton_blocks.py`; here a program's tile is held as `*_TNGK` (T, NB, GB, TILE_K):
element (t, n, g, k) is row b n + T g + t of the tile (b the block, NB = TILE_M / b blocks of rows,
GB = b / T groups of T rows per block) and column k. `*_NK` has one value per columnwise block,
`*_WK` one int32 word (4 columnwise codes) per 4 rows.

[Note: packed columnwise codes] The two-pass kernel ([Note: two-pass block quantize]) writes x^T
by a `tl.trans` of 8-bit codes, which the compiler turns into a byte-wise shuffle through shared
memory (the L1-bound part of its ncu profile), and re-reads x for the second pass. Here the tile
is loaded once as 4-D like NVFP4's register blocks ([Note: NVFP4 register blocks]): Triton's
default layout gives the contiguous k the 16-byte vectors and the lanes, then g and n, and leaves
the T consecutive rows of each thread's columns in its registers. A columnwise block's amax is a
max over t in registers, then over g across lanes; each thread encodes its T rows of a column
and ORs them, 4 at a time, into int32 words, which are x^T's bytes in order (little-endian:
row 4w + i in byte i). The words are stored through an int32 view of the (K, M) codes (M % 4 == 0;
otherwise byte stores), either straight from the registers that hold them (`transpose=False`:
T / 4 contiguous words per thread and column) or through `tl.trans` (the compiler's shuffle then
moves 4-byte words, a quarter of the byte-wise accesses). Rowwise codes come from the same
registers (blocks along k reduced with lane shuffles). With `load_descriptor` the tile arrives by
TMA (`tl.make_tensor_descriptor`, Hopper's bulk copy engine; x's last dim contiguous, rows 16-byte
aligned) and with `store_descriptor` both code tiles leave by TMA (bounds clipped by the hardware).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._triton_blocks import PackedTiles, _encode, _nan_to_positive, _power_of_two_scale, _store_scales
from quant_core._triton_launch import cdiv, launch
from quant_core._triton_numerics import HARDWARE_FP8, finite_abs, store_bytes


@triton.jit
def _quantize_packed_kernel(
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
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    T: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    WORDS: tl.constexpr,
    LOAD_DESCRIPTOR: tl.constexpr,
    STORE_DESCRIPTOR: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
):
    """One TILE_M x TILE_K tile of x, 1 x BLOCK blocks, every usage from one read ([Note: packed
    columnwise codes]); WORDS: columnwise codes stored as int32 words (M % 4 == 0)."""
    NB: tl.constexpr = TILE_M // BLOCK
    GB: tl.constexpr = BLOCK // T
    col_tiles = tl.cdiv(K, TILE_K)
    tile_m = tl.program_id(0) // col_tiles
    tile_k = tl.program_id(0) % col_tiles
    first_row = tile_m.to(tl.int64) * TILE_M
    t = tl.arange(0, T)[:, None, None, None]
    n = tl.arange(0, NB)[None, :, None, None]
    g = tl.arange(0, GB)[None, None, :, None]
    rows = first_row + BLOCK * n + T * g + t  # (T, NB, GB, 1)
    cols = (tile_k * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)[None, None, None, :]  # (1, 1, 1, K)
    mask = (rows < M) & (cols < K)
    if LOAD_DESCRIPTOR:
        # x as (M / BLOCK, GB, T, K) (M % BLOCK == 0): the tile arrives as (NB, GB, T, TILE_K).
        x_desc = tl.make_tensor_descriptor(
            x_ptr,
            shape=[M // BLOCK, GB, T, K],
            strides=[BLOCK * stride_m, T * stride_m, stride_m, 1],
            block_shape=[NB, GB, T, TILE_K],
        )
        x_NGTK = x_desc.load([tile_m * NB, 0, 0, tile_k * TILE_K])  # zero outside x
        x = tl.permute(x_NGTK, (2, 0, 1, 3)).to(tl.float32)
    else:
        pointers = x_ptr + rows * stride_m + cols * stride_k
        x = (tl.load(pointers, mask=mask, other=0.0) if MASKED else tl.load(pointers)).to(tl.float32)
    magnitude = finite_abs(x)
    x = _nan_to_positive(x, EARLY_NAN)
    if ROWWISE:
        J: tl.constexpr = TILE_K // BLOCK
        amax_TNGJ = tl.max(tl.reshape(magnitude, (T, NB, GB, J, BLOCK)), axis=4)
        multiplier_TNGJ, stored_TNGJ = _power_of_two_scale(amax_TNGJ, SCALE_RULE, E4M3)
        blocks = tl.reshape(x, (T, NB, GB, J, BLOCK)) * multiplier_TNGJ[:, :, :, :, None]
        codes = tl.reshape(_encode(blocks, E4M3, HARDWARE, EARLY_NAN), (T, NB, GB, TILE_K))
        if STORE_DESCRIPTOR:
            rowwise_desc = tl.make_tensor_descriptor(
                rowwise_ptr, shape=[M, K], strides=[K, 1], block_shape=[TILE_M, TILE_K]
            )
            codes_MK = tl.reshape(tl.permute(codes, (1, 2, 0, 3)), (TILE_M, TILE_K))
            rowwise_desc.store(
                [tile_m * TILE_M, tile_k * TILE_K], codes_MK.to(rowwise_ptr.dtype.element_ty, bitcast=True)
            )
        else:
            store_bytes(rowwise_ptr, rows * K + cols, codes, mask if MASKED else None)
        Kb = tl.cdiv(K, BLOCK)
        block_cols = tile_k * J + tl.arange(0, J)[None, None, None, :]
        scale_mask = (rows < M) & (block_cols < Kb) if MASKED else None
        _store_scales(rowwise_scale_ptr, rows * Kb + block_cols, stored_TNGJ, scale_mask)
    if COLUMNWISE:
        amax_NK = tl.max(tl.max(magnitude, axis=0), axis=1)
        multiplier_NK, stored_NK = _power_of_two_scale(amax_NK, SCALE_RULE, E4M3)
        # Columnwise scales are (K, Mb): entry (k, block row).
        Mb = tl.cdiv(M, BLOCK)
        block_rows = tile_m * NB + tl.arange(0, NB)[:, None]
        cols_K = tl.reshape(cols, (1, TILE_K))
        scale_mask_NK = (block_rows < Mb) & (cols_K < K) if MASKED else None
        _store_scales(columnwise_scale_ptr, block_rows + cols_K * Mb, stored_NK, scale_mask_NK)
        codes = _encode(x * multiplier_NK[None, :, None, :], E4M3, HARDWARE, EARLY_NAN).to(tl.int32)
        if WORDS:
            # Byte i of word w is row 4 w + i: (T/4, 4, NB, GB, K) summed over the 4 (disjoint bits).
            shifts = (8 * tl.arange(0, 4))[None, :, None, None, None]
            words = tl.sum(tl.reshape(codes, (T // 4, 4, NB, GB, TILE_K)) << shifts, axis=1)  # (T/4, NB, GB, K)
            words_ptr = columnwise_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            W: tl.constexpr = TILE_M // 4
            if STORE_DESCRIPTOR:
                columnwise_desc = tl.make_tensor_descriptor(
                    words_ptr, shape=[K, M // 4], strides=[M // 4, 1], block_shape=[TILE_K, W]
                )
                words_KW = tl.reshape(tl.permute(words, (3, 1, 2, 0)), (TILE_K, W))
                columnwise_desc.store([tile_k * TILE_K, tile_m * W], words_KW)
            else:
                word_rows = first_row // 4 + (BLOCK // 4) * n + (T // 4) * g + tl.arange(0, T // 4)[:, None, None, None]
                word_mask = (word_rows < M // 4) & (cols < K) if MASKED else None
                if TRANSPOSE:
                    words_KW = tl.reshape(tl.permute(words, (3, 1, 2, 0)), (TILE_K, W))
                    word_rows_W = tl.reshape(tl.permute(word_rows, (3, 1, 2, 0)), (1, W))
                    cols_K1 = tl.trans(cols_K)
                    mask_KW = (word_rows_W < M // 4) & (cols_K1 < K) if MASKED else None
                    tl.store(words_ptr + cols_K1 * (M // 4) + word_rows_W, words_KW, mask=mask_KW)
                else:
                    tl.store(words_ptr + cols * (M // 4) + word_rows, words, mask=word_mask)
        else:
            store_bytes(columnwise_ptr, cols * M + rows, codes.to(tl.uint8), mask if MASKED else None)


_ALLOCATOR_SET = False


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side TMA descriptors (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_packed(
    x_MK: torch.Tensor,
    buffers: tuple[torch.Tensor | None, ...],
    common: dict,
    tiles: PackedTiles,
    *,
    block: int,
    e4m3: bool,
) -> None:
    """Launches `_quantize_packed_kernel` for x_MK (2-D) with the constexprs in `common`."""
    global _ALLOCATOR_SET
    M, K = x_MK.shape
    assert tiles.tile_m % block == 0, tiles
    assert tiles.tile_k % block == 0, tiles
    assert block % tiles.rows_per_thread == 0, tiles
    assert tiles.rows_per_thread % 4 == 0, tiles
    # TMA: 16-byte aligned bases and row strides, a contiguous last dim (x), words of 4 rows (x^T).
    load_descriptor = (
        tiles.load_descriptor
        and x_MK.stride(1) == 1
        and (x_MK.stride(0) * x_MK.element_size()) % 16 == 0
        and x_MK.data_ptr() % 16 == 0
        and M % block == 0
    )
    codes = (buffers[0], buffers[2])
    store_descriptor = (
        tiles.store_descriptor
        and K % 16 == 0
        and M % 16 == 0
        and all(b is None or b.data_ptr() % 16 == 0 for b in codes)
    )
    if (load_descriptor or store_descriptor) and not _ALLOCATOR_SET:
        triton.set_allocator(_scratch)
        _ALLOCATOR_SET = True
    launch(
        _quantize_packed_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        M,
        K,
        *x_MK.stride(),
        *buffers,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        T=tiles.rows_per_thread,
        TRANSPOSE=tiles.transpose,
        WORDS=M % 4 == 0,
        LOAD_DESCRIPTOR=load_descriptor,
        STORE_DESCRIPTOR=store_descriptor,
        MASKED=M % tiles.tile_m != 0 or K % tiles.tile_k != 0,
        EARLY_NAN=tiles.early_nan and e4m3 and HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **common,
    )
