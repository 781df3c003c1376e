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

from quant_core._library import register_kernel
from quant_core.fp8._fp8 import AmaxArgs, CastToFp8Args, DequantizeFp8Args, TransposeBytesArgs
from quant_core.fp8._quantize import (
    QuantizeFp8Args,
    QuantizeFp8DelayedArgs,
    composed_quantize_fp8,
    composed_quantize_fp8_delayed,
    new_scalar,
)
from quant_core.fp8._scale import FP8_MAX
from quant_core.fp8._triton_scale import history_amax, history_block, push_amax, scale_of
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
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
# Programs of an amax launch, about: enough to fill the GPU, few enough that atomics (or partial
# amaxes to reduce) stay few.
_AMAX_PROGRAMS = 1024


@triton.jit
def _amax_kernel(
    x_ptr,
    amax_ptr,
    M,
    K,
    stride_m,
    stride_k,
    tiles_per_program,
    PARTIAL: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
):
    """max |x| over the finite elements of `tiles_per_program` tiles along K: one atomic max into
    amax_ptr[0] per program, or (PARTIAL) stored at amax_ptr[program], one partial amax each."""
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    row_offsets_M = rows.to(tl.int64) * stride_m
    largest_MK = tl.zeros((TILE_M, TILE_K), dtype=tl.float32)
    first_col = tl.program_id(1).to(tl.int64) * tiles_per_program * TILE_K
    for t in range(tiles_per_program):
        cols = first_col + t * TILE_K + tl.arange(0, TILE_K)
        mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
        x_MK = tl.load(x_ptr + row_offsets_M[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
        largest_MK = tl.maximum(largest_MK, finite_abs(x_MK))
    if PARTIAL:
        tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(largest_MK))
    else:
        tl.atomic_max(amax_ptr, tl.max(largest_MK))


def _launch_amax(x_MK: torch.Tensor, out: torch.Tensor | None, programs: int) -> torch.Tensor:
    """Launches `_amax_kernel` over x_MK with about `programs` programs: atomics into `out` (zeroed,
    one element), or with out None the partial amaxes, one per program, in a new fp32 tensor."""
    if x_MK.stride(0) < x_MK.stride(1):  # amax ignores order: read along the unit stride
        x_MK = x_MK.t()
    tiles = AMAX_TILES
    if x_MK.is_contiguous():
        x_MK, tiles = x_MK.view(1, -1), AMAX_FLAT_TILES
    M, K = x_MK.shape
    row_tiles, col_tiles = cdiv(M, tiles.tile_m), cdiv(K, tiles.tile_k)
    tiles_per_program = max(1, min(col_tiles, row_tiles * col_tiles // programs))
    grid = (row_tiles, cdiv(col_tiles, tiles_per_program))
    if out is None:
        out = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x_MK.device)
    launch(
        _amax_kernel,
        grid,
        x_MK,
        out,
        M,
        K,
        *x_MK.stride(),
        tiles_per_program,
        PARTIAL=out.dim() == 1,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )
    return out


@register_kernel("amax", "triton", traceable=True)
def _amax(args: AmaxArgs) -> torch.Tensor:
    return _launch_amax(args.x_MK, torch.zeros((), dtype=torch.float32, device=args.x_MK.device), _AMAX_PROGRAMS)


# How the cast kernel gets its scale (constexpr DELAYED): loaded, or from the amax history.


@triton.jit
def _max_of(values_ptr, n, BLOCK: tl.constexpr):
    """The max of values_ptr[:n] (non-negative amaxes), read BLOCK at a time by one program."""
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.load(values_ptr + offsets, mask=offsets < n, other=0.0))
    return tl.max(largest, axis=0)


@triton.jit
def _current_scale_kernel(
    amax_ptr, num_amax, scale_ptr, scale_inv_ptr, amax_out_ptr, fmax, POWER_2: tl.constexpr, BLOCK: tl.constexpr
):
    """Current scaling's scale, one program: amax = the max of amax_ptr[:num_amax] (partial
    amaxes, or one given amax), stored at amax_out_ptr if given."""
    amax = _max_of(amax_ptr, num_amax, BLOCK)
    scale, scale_inv = scale_of(amax, fmax, 1.0, POWER_2)
    tl.store(scale_ptr, scale)
    tl.store(scale_inv_ptr, scale_inv)
    if amax_out_ptr is not None:
        tl.store(amax_out_ptr, amax)


@triton.jit
def _cast_kernel(
    x_ptr,
    rowwise_ptr,
    columnwise_ptr,
    M,
    K,
    stride_m,
    stride_k,
    scale_ptr,
    scale_inv_ptr,
    partials_ptr,
    history_ptr,
    history_len,
    fmax,
    divisor,
    DELAYED: tl.constexpr,
    STORE_SCALE: tl.constexpr,
    STORE_PARTIALS: tl.constexpr,
    POWER_2: tl.constexpr,
    MOST_RECENT: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    E4M3: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    """codes = fp8(x * scale) of one tile, written rowwise and/or transposed ([Note: fused FP8
    quantize on the GPU]). The scale is loaded, or (DELAYED) computed by every program from the
    history (read only in this launch), program 0 storing scale_inv and (STORE_SCALE) the scale;
    with STORE_PARTIALS each program stores its tile's amax at partials_ptr[program]."""
    pid = tl.program_id(0)
    if DELAYED:
        _, used = history_amax(history_ptr, history_len, MOST_RECENT, HISTORY_BLOCK)
        scale, scale_inv = scale_of(used, fmax, divisor, POWER_2)
        if pid == 0:
            tl.store(scale_inv_ptr, scale_inv)
            if STORE_SCALE:
                tl.store(scale_ptr, scale)
    else:
        scale = tl.load(scale_ptr)
    col_tiles = tl.cdiv(K, TILE_K)
    rows = ((pid // col_tiles) * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = ((pid % col_tiles) * TILE_K + tl.arange(0, TILE_K)).to(tl.int64)
    mask_MK = (rows < M)[:, None] & (cols < K)[None, :]
    x_MK = tl.load(x_ptr + (rows * stride_m)[:, None] + (cols * stride_k)[None, :], mask=mask_MK, other=0.0)
    codes_MK = encode_fp8(x_MK.to(tl.float32) * scale, E4M3, HARDWARE)
    if ROWWISE:
        store_bytes(rowwise_ptr, (rows * K)[:, None] + cols[None, :], codes_MK, mask_MK)
    if COLUMNWISE:
        store_bytes(columnwise_ptr, (cols * M)[:, None] + rows[None, :], tl.trans(codes_MK), tl.trans(mask_MK))
    if STORE_PARTIALS:
        tl.store(partials_ptr + pid, tl.max(finite_abs(x_MK)))


@triton.jit
def _push_partial_amax_kernel(partials_ptr, num_partials, history_ptr, history_len, amax_out_ptr, BLOCK: tl.constexpr):
    """Delayed scaling's last step, one program: amax = the max of the partial amaxes, pushed into
    the history (after the cast kernel read it) and stored at amax_out_ptr if given."""
    amax = _max_of(partials_ptr, num_partials, BLOCK)
    history, _ = history_amax(history_ptr, history_len, True, BLOCK)
    tl.debug_barrier()
    push_amax(history_ptr, history, history_len, amax, BLOCK)
    if amax_out_ptr is not None:
        tl.store(amax_out_ptr, amax)


def _launch_cast(
    x_MK: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise_MK: torch.Tensor | None,
    columnwise_KM: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    scale_inv: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    partials: bool = False,
    power_2_scales: bool = False,
    most_recent: bool = False,
    margin: int = 0,
) -> torch.Tensor | None:
    """Launches `_cast_kernel`: with the scale given, or with a history (delayed scaling, see the
    kernel); with `partials`, returns the tiles' amaxes."""
    tiles = CAST_TILES
    if columnwise_KM is None and x_MK.is_contiguous():
        x_MK, rowwise_MK, tiles = x_MK.view(1, -1), rowwise_MK.view(1, -1), CAST_ROWWISE_TILES
    M, K = x_MK.shape
    programs = cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k)
    tile_amaxes = torch.empty(programs, dtype=torch.float32, device=x_MK.device) if partials else None
    history_len = 0 if history is None else history.numel()
    launch(
        _cast_kernel,
        (programs,),
        x_MK,
        rowwise_MK,
        columnwise_KM,
        M,
        K,
        *x_MK.stride(),
        scale,
        scale_inv,
        tile_amaxes,
        history,
        history_len,
        FP8_MAX[fp8_dtype],
        2.0**margin,  # exact in fp32 for margin in [-126, 127]
        DELAYED=history is not None,
        STORE_SCALE=scale is not None,
        STORE_PARTIALS=partials,
        POWER_2=power_2_scales,
        MOST_RECENT=most_recent,
        HISTORY_BLOCK=history_block(history_len),
        ROWWISE=rowwise_MK is not None,
        COLUMNWISE=columnwise_KM is not None,
        E4M3=fp8_dtype == torch.float8_e4m3fn,
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        HARDWARE=HARDWARE_FP8,
        num_warps=tiles.num_warps,
        **EXACT,
    )
    return tile_amaxes


@register_kernel("cast_to_fp8", "triton", traceable=True)
def _cast_to_fp8(args: CastToFp8Args) -> None:
    _launch_cast(args.x_MK, args.fp8_dtype, args.rowwise_MK, args.columnwise_KM, args.scale)


@register_kernel("quantize_fp8", "triton", traceable=True)
def _quantize_fp8(args: QuantizeFp8Args) -> None:
    """[Note: fused FP8 quantize on the GPU] Current scaling in three launches and one read of x
    for the amax: the partial amaxes (one per program: no zeroed buffer, no atomics), one program
    that reduces them into the scale, then the cast (a second read). Delayed scaling reads x once:
    the cast computes the scale from the history (read only in that launch) and stores each tile's
    amax; one small program then reduces those and pushes the amax into the history. (Computing
    the current scale inside every cast program instead cost ~60 us at 8192^2 on the H100: the
    amax pass, cut to a few hundred programs so each cast program could read them all, lost half
    its bandwidth.)"""
    x_MK, amax, amax_out, scale = args.x_MK, args.amax, args.amax_out, args.scale
    if x_MK.numel() == 0:
        return composed_quantize_fp8("triton")(args)
    if amax is None:
        amax = _launch_amax(x_MK, None, _AMAX_PROGRAMS)
    else:
        amax_out = None  # the operator leaves it alone when an amax is given
    if scale is None:
        scale = new_scalar(x_MK.device)
    launch(
        _current_scale_kernel,
        (1,),
        amax,
        amax.numel(),
        scale,
        args.scale_inv,
        amax_out,
        FP8_MAX[args.fp8_dtype],
        POWER_2=args.power_2_scales,
        BLOCK=1024,
        num_warps=4,
        **EXACT,
    )
    _launch_cast(x_MK, args.fp8_dtype, args.rowwise_MK, args.columnwise_KM, scale)


@register_kernel("quantize_fp8_delayed", "triton", traceable=True)
def _quantize_fp8_delayed(args: QuantizeFp8DelayedArgs) -> None:
    """[Note: fused FP8 quantize on the GPU], delayed scaling."""
    if args.x_MK.numel() == 0:
        return composed_quantize_fp8_delayed("triton")(args)
    amax_history = args.amax_history
    partials = _launch_cast(
        args.x_MK,
        args.fp8_dtype,
        args.rowwise_MK,
        args.columnwise_KM,
        args.scale,
        scale_inv=args.scale_inv,
        history=amax_history,
        partials=args.amax is None,
        power_2_scales=args.power_2_scales,
        most_recent=args.amax_compute_algo == "most_recent",
        margin=args.margin,
    )
    pushed = args.amax if partials is None else partials
    launch(
        _push_partial_amax_kernel,
        (1,),
        pushed,
        pushed.numel(),
        amax_history,
        amax_history.numel(),
        None if partials is None else args.amax_out,
        BLOCK=history_block(max(amax_history.numel(), 1024)),
        num_warps=4,
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


@register_kernel("dequantize_fp8", "triton", traceable=True)
def _dequantize_fp8(args: DequantizeFp8Args, out_MK: torch.Tensor) -> None:
    n = args.data_MK.numel()
    launch(
        _dequantize_fp8_kernel,
        (cdiv(n, DEQUANTIZE_BLOCK),),
        args.data_MK,
        args.scale_inv,
        out_MK,
        n,
        E4M3=args.data_MK.dtype == torch.float8_e4m3fn,
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


@register_kernel("transpose_bytes", "triton", traceable=True)
def _transpose_bytes(args: TransposeBytesArgs, out_KM: torch.Tensor) -> None:
    data_MK = args.data_MK
    M, K = data_MK.shape
    tiles = TRANSPOSE_TILES
    launch(
        _transpose_bytes_kernel,
        (cdiv(M, tiles.tile_m) * cdiv(K, tiles.tile_k),),
        data_MK,
        out_KM,
        M,
        K,
        *data_MK.stride(),
        TILE_M=tiles.tile_m,
        TILE_K=tiles.tile_k,
        num_warps=tiles.num_warps,
    )
