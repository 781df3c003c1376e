"""Triton kernel of the lossless NVFP4 transpose (`_transpose.py`): 16 x 16-tiled rowwise codes to
their columnwise usage, nibbles repacked along M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.nvfp4._transpose import TransposeNvfp4Args
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import Tiles

TRANSPOSE_TILES = Tiles(128, 256, 8)


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


@register_kernel("transpose_nvfp4", "triton", traceable=True)
def _transpose_nvfp4(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    packed_MK = args.packed_MK
    M, K = packed_MK.shape[0], packed_MK.shape[1] * 2
    tiles = TRANSPOSE_TILES
    launch(
        _transpose_nvfp4_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        packed_MK,
        out_KM,
        M,
        K,
        *packed_MK.stride(),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )
