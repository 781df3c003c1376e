"""Triton kernels of the 16 x 16 random Hadamard transform (`_hadamard.py`): the transform and its
inverse, and the amaxes of x and T(x^T) in one read ([Note: NVFP4 random Hadamard transform] in
`_nvfp4.py`). `_hadamard_runs` also serves the transformed columnwise usage of the quantize
kernel (`_triton_quantize`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.nvfp4._hadamard import HadamardArgs
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
    EXACT,
    Tiles,
    finite_abs,
    from_int32_halves,
    int32_halves,
    splitmix64,
    store_values,
)

HADAMARD_TILES = Tiles(16, 128, 4)
# The amaxes of x and of T(x^T): swept, no tile more than 2% faster (93.8-100.4 us at 8192^2).
HADAMARD_AMAXES_TILES = Tiles(64, 64, 4)


@triton.jit
def _butterfly(groups, H: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform on (N, 16) groups: elements H apart become
    (first + second, first - second)."""
    N: tl.constexpr = groups.shape[0]
    pairs = tl.permute(tl.reshape(groups, (N, 16 // (2 * H), 2, H)), (0, 1, 3, 2))
    first, second = tl.split(pairs)
    pairs = tl.permute(tl.join(first + second, first - second), (0, 1, 3, 2))
    return tl.reshape(pairs, (N, 16))


@triton.jit
def _hadamard_runs(runs, seed_hi, seed_lo):
    """(1/4) H_16 D of every run of an (N, 16) fp32 tensor, D the signs of the seed (`int32_halves`):
    the reference's signs, 4-stage butterfly and 1/4, in that order."""
    draws = splitmix64(from_int32_halves(seed_hi, seed_lo), tl.arange(0, 16).to(tl.uint64))
    signs = tl.where((draws >> 63) != 0, -1.0, 1.0)
    runs = _butterfly(_butterfly(_butterfly(_butterfly(runs * signs[None, :], 1), 2), 4), 8)
    return runs * 0.25


@triton.jit(do_not_specialize=["seed_hi", "seed_lo"])
def _hadamard_amaxes_kernel(
    x_ptr, amax_ptr, M, K, stride_m, stride_k, seed_hi, seed_lo, TILE_M: tl.constexpr, TILE_K: tl.constexpr
):  # fmt: skip
    """amax(x) and amax(T(x^T)) of one TILE_M x TILE_K tile (TILE_M a multiple of 16; rows past M
    read as 0, which pads a partial last run): one atomic max per program into amax_ptr[0] and [1]."""
    rows = ((tl.program_id(0) // tl.cdiv(K, TILE_K)) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % tl.cdiv(K, TILE_K)) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    x_MK = x_MK.to(tl.float32)
    runs_NP = _hadamard_runs(tl.reshape(tl.trans(x_MK), (TILE_K * TILE_M // 16, 16)), seed_hi, seed_lo)
    tl.atomic_max(amax_ptr, tl.max(finite_abs(x_MK)))
    tl.atomic_max(amax_ptr + 1, tl.max(finite_abs(runs_NP)))


@register_kernel("hadamard_amaxes", "triton", traceable=True)
def _hadamard_amaxes(args: HadamardArgs, out: torch.Tensor) -> None:
    x_MK = args.x_MK
    M, K = x_MK.shape
    tiles = HADAMARD_AMAXES_TILES
    launch(
        _hadamard_amaxes_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        out,
        M,
        K,
        *x_MK.stride(),
        *int32_halves(args.seed),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
        **EXACT,
    )


@triton.jit(do_not_specialize=["seed_hi", "seed_lo"])
def _hadamard_kernel(
    x_ptr,
    out_ptr,
    M,
    K,
    stride_m,
    stride_k,
    seed_hi,
    seed_lo,
    INVERSE: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """The 16 x 16 random Hadamard transform of one tile (K and TILE_K multiples of 16), or with
    INVERSE its inverse: the signs applied after the butterfly instead of before."""
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((tl.program_id(0) // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((tl.program_id(0) % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    draws = splitmix64(from_int32_halves(seed_hi, seed_lo), tl.arange(0, 16).to(tl.uint64))
    signs = tl.where((draws >> 63) != 0, -1.0, 1.0)
    groups = tl.reshape(x_MK.to(tl.float32), (TILE_M * TILE_K // 16, 16))
    if not INVERSE:
        groups = groups * signs[None, :]
    groups = _butterfly(_butterfly(_butterfly(_butterfly(groups, 1), 2), 4), 8) * 0.25
    if INVERSE:
        groups = groups * signs[None, :]
    out_MK = tl.reshape(groups, (TILE_M, TILE_K))
    store_values(out_ptr, (rows * K)[:, None] + cols[None, :], out_MK, mask_MK)


@register_kernel("hadamard_transform_16", "triton", traceable=True)
def _hadamard_transform_16(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    _launch_hadamard(args.x_MK, args.seed, out_MK, inverse=False)


@register_kernel("hadamard_inverse_16", "triton", traceable=True)
def _hadamard_inverse_16(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    _launch_hadamard(args.x_MK, args.seed, out_MK, inverse=True)


def _launch_hadamard(x_MK: torch.Tensor, seed: int, out_MK: torch.Tensor, *, inverse: bool) -> None:
    M, K = x_MK.shape
    tiles = HADAMARD_TILES
    launch(
        _hadamard_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        x_MK,
        out_MK,
        M,
        K,
        *x_MK.stride(),
        *int32_halves(seed),
        INVERSE=inverse,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
        **EXACT,
    )
