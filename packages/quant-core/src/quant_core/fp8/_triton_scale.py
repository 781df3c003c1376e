"""Triton kernels of the per-tensor FP8 scales (`fp8/_scale.py`): current and delayed scaling.

A handful of scalars per call: one program of one warp, launched with `enable_fp_fusion=False`
and dividing with `tl.div_rn` ([Note: exact Triton arithmetic] in `_triton.py`), so the
results equal the reference's IEEE fp32 arithmetic ([Note: FP8 scale arithmetic]) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.fp8._scale import DelayedFp8ScaleArgs, Fp8ScaleArgs
from quant_core.shared._triton_launch import cdiv, launch, next_power_of_2

# Elements of amax per program of `fp8_scale` (one program for the usual single amax).
_SCALE_BLOCK = 128


@triton.jit
def scale_of(amax, fmax, divisor, POWER_2: tl.constexpr):
    """(scale, scale_inv) of fp32 amax, the mirror of csrc/scale.cpp `scale_of`.

    fmax and divisor (powers of two and FP8 maxima: exact in fp32) may arrive as fp64 scalars:
    Inductor types a kernel's float arguments fp64 where Triton types them fp32."""
    fmax_f32 = (tl.zeros_like(amax) + fmax).to(tl.float32)
    divisor_f32 = (tl.zeros_like(amax) + divisor).to(tl.float32)
    quotient = tl.div_rn(tl.div_rn(fmax_f32, amax), divisor_f32)
    scale = tl.where(amax > 0.0, quotient, 1.0)
    scale = tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale)
    if POWER_2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale, tl.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _fp8_scale_kernel(amax_ptr, scale_ptr, scale_inv_ptr, n, fmax, divisor, POWER_2: tl.constexpr, BLOCK: tl.constexpr):
    """scale[i], scale_inv[i] of amax[i] for the BLOCK elements of this program."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale, scale_inv = scale_of(tl.load(amax_ptr + offsets, mask=mask, other=0.0), fmax, divisor, POWER_2)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(scale_inv_ptr + offsets, scale_inv, mask=mask)


@register_kernel("fp8_scale", "triton", traceable=True)
def _fp8_scale(args: Fp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    n = args.amax.numel()
    launch(
        _fp8_scale_kernel,
        (cdiv(n, _SCALE_BLOCK),),
        args.amax,
        scale,
        scale_inv,
        n,
        args.fmax,
        2.0**args.margin,  # exact in fp32 for margin in [-126, 127]
        POWER_2=args.power_2_scales,
        BLOCK=_SCALE_BLOCK,
        num_warps=1,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )


@triton.jit
def history_amax(history_ptr, length, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    """(the history as loaded, BLOCK wide; the amax delayed scaling scales with): its max (NaN if
    any entry is NaN, as torch's max) or its entry 0."""
    offsets = tl.arange(0, BLOCK)
    history = tl.load(history_ptr + offsets, mask=offsets < length, other=float("-inf"))
    if MOST_RECENT:
        used = tl.load(history_ptr)
    else:
        any_nan = tl.max((history != history).to(tl.int32), axis=0)
        used = tl.where(any_nan > 0, float("nan"), tl.max(tl.where(history != history, 0.0, history), axis=0))
    return history, used


@triton.jit
def push_amax(history_ptr, history, length, amax, BLOCK: tl.constexpr):
    """Stores `history` (as loaded by history_amax) shifted one older, then amax at entry 0."""
    offsets = tl.arange(0, BLOCK)
    tl.store(history_ptr + offsets + 1, history, mask=offsets + 1 < length)
    tl.store(history_ptr, amax)


@triton.jit
def _delayed_fp8_scale_kernel(
    history_ptr,
    amax_ptr,
    scale_ptr,
    scale_inv_ptr,
    length,
    fmax,
    divisor,
    POWER_2: tl.constexpr,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The scale of the history (its max, NaN if any entry is NaN as torch's max; or entry 0), then
    the history shifted one older with *amax_ptr written at entry 0. One program: every entry is
    loaded before the barrier, every store comes after it."""
    history, used = history_amax(history_ptr, length, MOST_RECENT, BLOCK)
    scale, scale_inv = scale_of(used, fmax, divisor, POWER_2)
    tl.store(scale_ptr, scale)
    tl.store(scale_inv_ptr, scale_inv)
    tl.debug_barrier()
    push_amax(history_ptr, history, length, tl.load(amax_ptr), BLOCK)


@register_kernel("delayed_fp8_scale", "triton", traceable=True)
def _delayed_fp8_scale(args: DelayedFp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    length = args.amax_history.numel()
    launch(
        _delayed_fp8_scale_kernel,
        (1,),
        args.amax_history,
        args.amax,
        scale,
        scale_inv,
        length,
        args.fmax,
        2.0**args.margin,  # exact in fp32 for margin in [-126, 127]
        POWER_2=args.power_2_scales,
        MOST_RECENT=args.amax_compute_algo == "most_recent",
        BLOCK=history_block(length),
        num_warps=1,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )


def history_block(length: int) -> int:
    """The BLOCK of `history_amax` / `push_amax` for a history of `length` entries."""
    return max(next_power_of_2(length), 16)
