"""Per-tensor FP8 quantize (docs/design.md, 'Numerics'): current and delayed scaling, each one operator.

[Note: fused FP8 quantize] `quantize_fp8` and `quantize_fp8_delayed` are single operators with a
kernel of their own per backend: the reference and C++ ones run the kernels of `amax`,
`fp8_scale` / `delayed_fp8_scale` and `cast_to_fp8` one after another (`composed_quantize_fp8*`),
the Triton one fuses them into two launches ([Note: fused FP8 quantize on the GPU] in
`fp8/_triton.py`). The host pays one operator dispatch instead of one per step (~3 us each on the
CPU, ~20 us per aten op on an H100 VM), and torch.compile sees one opaque node (no scale
arithmetic is left for Inductor to generate), so compiled equals eager bit for bit. Given an amax (one all-reduced over the ranks that
hold shards of x: callers measure it with `amax` first), the operators skip the measuring step.
Under torch.compile the public and unchecked functions always give one: x's, as torch ops
(`amax_torch_ops`, `amax_reference`'s value bit for bit) that Inductor fuses into the kernel
producing x, so the cast is the only other read of x; amax_out and the history get that amax.
The `*_into` variants fill caller-given buffers (a quantized tensor's own, to requantize in place)
and allocate nothing but x's amax and the scale.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.quantize_fp8.default(x_MK, amax, fp8_dtype, power_2_scales, rowwise_MK,
  columnwise_KM, scale_inv, scale, amax_out) -> ()`: x_MK, fp8_dtype, rowwise_MK and columnwise_KM
  as for `cast_to_fp8` (at least one buffer); amax None (measure x's) or a one-element fp32 tensor
  on x's device; scale_inv a one-element fp32 tensor there, scale and amax_out too or None (none
  of them aliasing another argument). Fills the buffers given: the codes, scale_inv, scale, and
  amax_out with x's amax when amax is None (left alone otherwise).
- `torch.ops.quant_core.quantize_fp8_delayed.default(x_MK, amax, amax_history, fp8_dtype, margin,
  power_2_scales, amax_compute_algo, rowwise_MK, columnwise_KM, scale_inv, scale, amax_out) -> ()`:
  as `quantize_fp8`, plus the history, margin and algo of `delayed_fp8_scale` ([Note: FP8 scale
  arithmetic]); the scale comes from the history as it was, then the amax (given or x's) is pushed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from quant_core._backends import Backend
from quant_core._library import backend_kernel, call, define_kernel_op, register_fused_kernel, register_kernel
from quant_core.fp8._fp8 import (
    AmaxArgs,
    CastToFp8Args,
    amax_reference,
    amax_torch_ops,
    cast_to_fp8_reference,
    check_fp8_input,
    checked_layout,
)
from quant_core.fp8._scale import (
    FP8_MAX,
    AmaxComputeAlgo,
    DelayedFp8ScaleArgs,
    Fp8ScaleArgs,
    check_amax_compute_algo,
    check_amax_history,
    check_margin,
    delayed_fp8_scale_reference,
    fp8_scale_reference,
)
from quant_core.shared._checks import check_scalar
from quant_core.shared._compile import compiling
from quant_core.shared._numerics import FUSABLE_INPUT_DTYPES, bf16_rounded


@dataclass(frozen=True)
class Float8Quantized:
    """Per-tensor FP8 quantization of a tensor: codes, one scale, and the amax it came from."""

    rowwise_data: torch.Tensor | None
    """FP8 codes with the input's shape, or None when rowwise usage was not asked for."""
    columnwise_data: torch.Tensor | None
    """FP8 codes of the transposed (K, M) view, or None when columnwise usage was not asked for."""
    scale: torch.Tensor
    """fp32 0-d: data = fp8(x * scale)."""
    scale_inv: torch.Tensor
    """fp32 0-d: 1 / scale; dequantized value = fp32(data) * scale_inv."""
    amax: torch.Tensor
    """fp32 0-d: the amax scaled with (current scaling) or pushed into the history (delayed): max |x|
    over the finite elements, or the amax the caller gave."""


# ---- current scaling ---------------------------------------------------------------------------


def quantize_fp8_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = False,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> Float8Quantized:
    """Plain-torch per-tensor current-scaling quantization (docs/design.md, 'Numerics')."""
    x_amax = amax_reference(x) if amax is None else amax.reshape(())
    scale, scale_inv = fp8_scale_reference(x_amax, fp8_dtype, power_2_scales=power_2_scales)
    rowwise_data, columnwise_data = cast_to_fp8_reference(x, scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return Float8Quantized(rowwise_data, columnwise_data, scale, scale_inv, x_amax)


def quantize_fp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = False,
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> Float8Quantized:
    """Per-tensor FP8 with current scaling: amax of x, scale = fmax / amax, then the cast, in one
    operator ([Note: fused FP8 quantize]).

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim.
        fp8_dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        power_2_scales: round the scale down to a power of two.
        rowwise: write the rowwise layout (x as it is).
        columnwise: write the columnwise layout (x^T); both come from one pass over x.
        amax: one-element fp32 tensor on x's device to scale with instead of x's own amax.
    """
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one usage: rowwise=True and/or columnwise=True")
    check_fp8_input(x, fp8_dtype)
    amax = _checked_amax(amax, x.device)
    amax_out = new_scalar(x.device) if amax is None else None
    rowwise_data, columnwise_KM, scale_inv, scale = quantize_fp8_unchecked(
        x, amax, fp8_dtype, power_2_scales, rowwise, columnwise, scale=new_scalar(x.device), amax_out=amax_out
    )
    return Float8Quantized(rowwise_data, columnwise_KM, scale, scale_inv, amax if amax_out is None else amax_out)


def quantize_fp8_unchecked(
    x: torch.Tensor,
    amax: torch.Tensor | None,
    fp8_dtype: torch.dtype,
    power_2_scales: bool,
    rowwise: bool,
    columnwise: bool,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`quantize_fp8` without its checks, for callers that have checked x (fp32/bf16/fp16, at
    least one dim, not meta), fp8_dtype, amax (None or fp32 0-d on x's device) and that a usage is
    asked for. Allocates the codes and scale_inv only; `scale` and `amax_out` (fp32 0-d on x's
    device, see `new_scalar`) are filled when given. Returns (rowwise data in x's shape,
    columnwise (K, M), scale_inv, scale)."""
    M, K = x.shape if x.dim() == 2 else (math.prod(x.shape[:-1]), x.shape[-1])  # as `as_2d`
    rowwise_data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    columnwise_KM = torch.empty((K, M), dtype=fp8_dtype, device=x.device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device).view(())  # as `new_scalar`
    x_MK = x if x.dim() == 2 else x.reshape(M, K)
    rowwise_MK = rowwise_data if rowwise_data is None or x.dim() == 2 else rowwise_data.view(M, K)
    if compiling():
        amax, amax_out = _amax_in_graph(x_MK, amax, amax_out)
    call("quantize_fp8", x_MK, amax, fp8_dtype, power_2_scales, rowwise_MK, columnwise_KM, scale_inv, scale, amax_out)
    return rowwise_data, columnwise_KM, scale_inv, scale


def quantize_fp8_into(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise_out: torch.Tensor | None = None,
    columnwise_out: torch.Tensor | None = None,
    scale_inv_out: torch.Tensor,
    power_2_scales: bool = False,
    amax: torch.Tensor | None = None,
) -> None:
    """`quantize_fp8` into given buffers: the codes of the usages whose buffer is given, and 1 / scale.

    One operator ([Note: fused FP8 quantize]); nothing else is allocated but x's amax.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2, the dtype of the code buffers.
        rowwise_out: contiguous, x's shape, or None; columnwise_out: contiguous (K, M), or None.
        scale_inv_out: one-element fp32 tensor on x's device; receives 1 / scale.
        power_2_scales: round the scale down to a power of two.
        amax: one-element fp32 tensor on x's device to scale with instead of x's own amax.
    """
    x_MK, rowwise_MK, columnwise_KM = _checked_into(x, fp8_dtype, rowwise_out, columnwise_out, scale_inv_out)
    amax = _checked_amax(amax, x.device)
    if compiling():
        amax, _ = _amax_in_graph(x_MK, amax, None)
    call("quantize_fp8", x_MK, amax, fp8_dtype, power_2_scales, rowwise_MK, columnwise_KM, scale_inv_out, None, None)


class QuantizeFp8Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_fp8` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    amax: torch.Tensor | None
    fp8_dtype: torch.dtype
    power_2_scales: bool
    rowwise_MK: torch.Tensor | None
    columnwise_KM: torch.Tensor | None
    scale_inv: torch.Tensor
    scale: torch.Tensor | None
    amax_out: torch.Tensor | None


def composed_quantize_fp8(backend: Backend) -> Callable[[QuantizeFp8Args], None]:
    """The `quantize_fp8` operator as `backend`'s amax, fp8_scale and cast kernels, one after another."""

    def quantize(args: QuantizeFp8Args) -> None:
        amax_kernel, scale_kernel, cast_kernel = steps or _step_kernels(steps, backend, "fp8_scale")
        amax, scale = _amax_and_scale(amax_kernel, args)
        scale_kernel(Fp8ScaleArgs(amax, FP8_MAX[args.fp8_dtype], 0, args.power_2_scales), scale, args.scale_inv)
        _cast(cast_kernel, args, scale)

    steps: list[Callable[..., None]] = []
    return quantize


# ---- delayed scaling -----------------------------------------------------------------------------


def quantize_fp8_delayed_reference(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    margin: int = 0,
    power_2_scales: bool = False,
    amax_compute_algo: AmaxComputeAlgo = "max",
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> Float8Quantized:
    """Plain-torch per-tensor delayed-scaling quantization (docs/design.md, 'Numerics'); updates the history."""
    x_amax = amax_reference(x) if amax is None else amax.reshape(())
    scale, scale_inv = delayed_fp8_scale_reference(
        amax_history,
        x_amax,
        fp8_dtype,
        margin=margin,
        power_2_scales=power_2_scales,
        amax_compute_algo=amax_compute_algo,
    )
    rowwise_data, columnwise_data = cast_to_fp8_reference(x, scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return Float8Quantized(rowwise_data, columnwise_data, scale, scale_inv, x_amax)


def quantize_fp8_delayed(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    margin: int = 0,
    power_2_scales: bool = False,
    amax_compute_algo: AmaxComputeAlgo = "max",
    rowwise: bool = True,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> Float8Quantized:
    """Per-tensor FP8 with delayed scaling, in one operator ([Note: fused FP8 quantize]): the scale
    of `delayed_fp8_scale_` (from the history as it was), the cast, and x's amax (or `amax`)
    pushed into the history in place.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim.
        amax_history: contiguous fp32 (history_len,) on x's device, newest first; updated in place.
        fp8_dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        margin: int in [-126, 127]; the scale is divided by 2^margin.
        power_2_scales: round the scale down to a power of two.
        amax_compute_algo: "max" (of the history) or "most_recent" (its entry 0).
        rowwise: write the rowwise layout (x as it is).
        columnwise: write the columnwise layout (x^T); both come from one pass over x.
        amax: one-element fp32 tensor on x's device to push instead of x's own amax.
    Returns:
        The codes, the scale used, and the amax pushed.
    """
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one usage: rowwise=True and/or columnwise=True")
    check_fp8_input(x, fp8_dtype)
    _check_delayed(x, amax_history, margin, amax_compute_algo)
    amax = _checked_amax(amax, x.device)
    amax_out = new_scalar(x.device) if amax is None else None
    rowwise_data, columnwise_KM, scale_inv, scale = quantize_fp8_delayed_unchecked(
        x,
        amax,
        amax_history,
        fp8_dtype,
        margin,
        power_2_scales,
        amax_compute_algo,
        rowwise,
        columnwise,
        scale=new_scalar(x.device),
        amax_out=amax_out,
    )
    return Float8Quantized(rowwise_data, columnwise_KM, scale, scale_inv, amax if amax_out is None else amax_out)


def quantize_fp8_delayed_unchecked(
    x: torch.Tensor,
    amax: torch.Tensor | None,
    amax_history: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    power_2_scales: bool,
    amax_compute_algo: str,
    rowwise: bool,
    columnwise: bool,
    *,
    scale: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`quantize_fp8_delayed` without its checks (the caller's contract: `quantize_fp8_unchecked`'s,
    plus a valid history on x's device, margin and algo); updates the history. Returns (rowwise
    data in x's shape, columnwise (K, M), scale_inv, scale)."""
    M, K = x.shape if x.dim() == 2 else (math.prod(x.shape[:-1]), x.shape[-1])  # as `as_2d`
    rowwise_data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    columnwise_KM = torch.empty((K, M), dtype=fp8_dtype, device=x.device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device).view(())  # as `new_scalar`
    x_MK = x if x.dim() == 2 else x.reshape(M, K)
    rowwise_MK = rowwise_data if rowwise_data is None or x.dim() == 2 else rowwise_data.view(M, K)
    if compiling():
        amax, amax_out = _amax_in_graph(x_MK, amax, amax_out)
    call(
        "quantize_fp8_delayed",
        x_MK,
        amax,
        amax_history,
        fp8_dtype,
        margin,
        power_2_scales,
        amax_compute_algo,
        rowwise_MK,
        columnwise_KM,
        scale_inv,
        scale,
        amax_out,
    )
    return rowwise_data, columnwise_KM, scale_inv, scale


def quantize_fp8_delayed_into(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise_out: torch.Tensor | None = None,
    columnwise_out: torch.Tensor | None = None,
    scale_inv_out: torch.Tensor,
    margin: int = 0,
    power_2_scales: bool = False,
    amax_compute_algo: AmaxComputeAlgo = "max",
    amax: torch.Tensor | None = None,
) -> None:
    """`quantize_fp8_delayed` into given buffers (see `quantize_fp8_into` for the buffers): one
    operator that fills them and updates the history."""
    x_MK, rowwise_MK, columnwise_KM = _checked_into(x, fp8_dtype, rowwise_out, columnwise_out, scale_inv_out)
    _check_delayed(x, amax_history, margin, amax_compute_algo)
    amax = _checked_amax(amax, x.device)
    if compiling():
        amax, _ = _amax_in_graph(x_MK, amax, None)
    call(
        "quantize_fp8_delayed",
        x_MK,
        amax,
        amax_history,
        fp8_dtype,
        margin,
        power_2_scales,
        amax_compute_algo,
        rowwise_MK,
        columnwise_KM,
        scale_inv_out,
        None,
        None,
    )


class QuantizeFp8DelayedArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_fp8_delayed` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    amax: torch.Tensor | None
    amax_history: torch.Tensor
    fp8_dtype: torch.dtype
    margin: int
    power_2_scales: bool
    amax_compute_algo: str
    rowwise_MK: torch.Tensor | None
    columnwise_KM: torch.Tensor | None
    scale_inv: torch.Tensor
    scale: torch.Tensor | None
    amax_out: torch.Tensor | None


def composed_quantize_fp8_delayed(backend: Backend) -> Callable[[QuantizeFp8DelayedArgs], None]:
    """The `quantize_fp8_delayed` operator as `backend`'s amax, delayed_fp8_scale and cast kernels."""

    def quantize(args: QuantizeFp8DelayedArgs) -> None:
        amax_kernel, scale_kernel, cast_kernel = steps or _step_kernels(steps, backend, "delayed_fp8_scale")
        amax, scale = _amax_and_scale(amax_kernel, args)
        scale_args = DelayedFp8ScaleArgs(
            args.amax_history, amax, FP8_MAX[args.fp8_dtype], args.margin, args.power_2_scales, args.amax_compute_algo
        )
        scale_kernel(scale_args, scale, args.scale_inv)
        _cast(cast_kernel, args, scale)

    steps: list[Callable[..., None]] = []
    return quantize


# The reference and C++ backends run the steps' kernels; Triton fuses them (`fp8/_triton.py`).
_FP8_BUFFERS = ("rowwise_MK", "columnwise_KM", "scale_inv", "scale", "amax_out")
define_kernel_op("quantize_fp8", QuantizeFp8Args, mutates_args=_FP8_BUFFERS, recomputable=True)(
    composed_quantize_fp8("reference")
)
define_kernel_op("quantize_fp8_delayed", QuantizeFp8DelayedArgs, mutates_args=("amax_history", *_FP8_BUFFERS))(
    composed_quantize_fp8_delayed("reference")
)


@register_fused_kernel("quantize_fp8", applies=lambda args: args.x_MK.dtype in FUSABLE_INPUT_DTYPES)
def _quantize_fp8_fused_kernel(args: QuantizeFp8Args) -> None:
    """The cast as torch ops, which Inductor may fuse with the kernel producing x ([Note: kernels
    Inductor fuses]); x rounded to its dtype again as the reference would read it from memory, and
    the scale from the `fp8_scale` operator (a division). (The delayed quantize writes its
    history, a graph input: it keeps quant-core's kernels.)"""
    x_MK = bf16_rounded(args.x_MK)
    amax = args.amax
    if amax is None:  # a max is exact in any order
        amax = amax_torch_ops(x_MK) if x_MK.numel() else torch.zeros((), dtype=torch.float32, device=x_MK.device)
        if args.amax_out is not None:
            args.amax_out.copy_(amax)
    scale, scale_inv = torch.ops.quant_core.fp8_scale(amax, FP8_MAX[args.fp8_dtype], 0, args.power_2_scales)
    args.scale_inv.copy_(scale_inv)
    if args.scale is not None:
        args.scale.copy_(scale)
    rowwise, columnwise = args.rowwise_MK is not None, args.columnwise_KM is not None
    rowwise_codes, columnwise_codes = cast_to_fp8_reference(
        x_MK, scale, args.fp8_dtype, rowwise=rowwise, columnwise=columnwise
    )
    if rowwise:
        args.rowwise_MK.copy_(rowwise_codes)
    if columnwise:
        args.columnwise_KM.copy_(columnwise_codes)


# ---- shared by the quantize functions ----------------------------------------------------------


def _checked_into(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise_out: torch.Tensor | None,
    columnwise_out: torch.Tensor | None,
    scale_inv_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The checks of the `*_into` functions; returns (x_MK, rowwise_MK, columnwise_KM)."""
    rowwise, columnwise = rowwise_out is not None, columnwise_out is not None
    if not (rowwise or columnwise):
        raise ValueError("pass at least one code buffer: rowwise_out and/or columnwise_out")
    x_MK, _, rowwise_MK, columnwise_KM = checked_layout(x, fp8_dtype, rowwise, columnwise, rowwise_out, columnwise_out)
    check_scalar(scale_inv_out, "scale_inv_out", x.device)
    return x_MK, rowwise_MK, columnwise_KM


def _check_delayed(x: torch.Tensor, amax_history: torch.Tensor, margin: int, amax_compute_algo: str) -> None:
    check_amax_history(amax_history, in_place=True)
    if amax_history.device != x.device:
        raise ValueError(
            f"amax_history is on {amax_history.device} but x is on {x.device}; move it with "
            f".to({str(x.device)!r}) (it is module state: module.to() moves it)"
        )
    check_margin(margin)
    check_amax_compute_algo(amax_compute_algo)


def _checked_amax(amax: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """None, or a given amax checked and viewed 0-d."""
    if amax is None:
        return None
    check_scalar(amax, "amax", device)
    return amax if amax.dim() == 0 else amax.reshape(())


def _amax_in_graph(
    x_MK: torch.Tensor, amax: torch.Tensor | None, amax_out: torch.Tensor | None
) -> tuple[torch.Tensor, None]:
    """(amax, amax_out) for a quantize operator traced by torch.compile (callers test
    `compiling()` first, so eager code never calls this): an amax not given is
    x's as torch ops (`amax_torch_ops`), which Inductor fuses into the kernel that produces x, and
    is written into amax_out if given; the operator, given an amax, measures none and leaves
    amax_out alone."""
    if amax is None:
        amax = amax_torch_ops(x_MK)
        if amax_out is not None:
            amax_out.copy_(amax)
    return amax, None


def new_scalar(device: torch.device) -> torch.Tensor:
    """An uninitialised fp32 0-d tensor (a scale or amax a kernel writes), as a view of a
    1-element tensor: under torch.compile, Inductor gives a 0-d `empty` that a traced Triton
    kernel mutates a one-element fill kernel of its own (three extra launches per FP8 quantize,
    measured on the H100) and only allocates a 1-element one. (Eager pays one view, ~2 us.)"""
    return torch.empty(1, dtype=torch.float32, device=device).view(())


def _step_kernels(steps: list[Callable[..., None]], backend: Backend, scale_op: str) -> list[Callable[..., None]]:
    """Fills `steps` with `backend`'s amax, `scale_op` and cast kernels, looked up at the first
    quantize (a backend's kernels register when it loads) and kept: the composed operator then
    costs no lookups per call."""
    steps.extend(backend_kernel(op, backend) for op in ("amax", scale_op, "cast_to_fp8"))
    return steps


def _amax_and_scale(
    amax_kernel: Callable[[AmaxArgs], torch.Tensor], args: QuantizeFp8Args | QuantizeFp8DelayedArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The composed quantize's first step: (the amax to scale with, the scale buffer). The amax is
    args.amax, or x's by `amax_kernel` (0 if x is empty), then also written into args.amax_out if
    given; the scale buffer is args.scale, or a new one."""
    amax, x_MK = args.amax, args.x_MK
    if amax is None:
        amax = amax_kernel(AmaxArgs(x_MK)) if x_MK.numel() else torch.zeros((), dtype=torch.float32, device=x_MK.device)
        if args.amax_out is not None:
            args.amax_out.copy_(amax)
    scale = args.scale
    if scale is None:
        scale = torch.empty(1, dtype=torch.float32, device=x_MK.device).view(())  # as `new_scalar`
    return amax, scale


def _cast(
    cast_kernel: Callable[[CastToFp8Args], None], args: QuantizeFp8Args | QuantizeFp8DelayedArgs, scale: torch.Tensor
) -> None:
    """The composed quantize's last step: x's codes with `scale` into the buffers given."""
    if args.x_MK.numel() > 0:
        cast_kernel(CastToFp8Args(args.x_MK, scale, args.fp8_dtype, args.rowwise_MK, args.columnwise_KM))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


# The C++ kernels of amax, the scale and the cast, one after another ([Note: fused FP8 quantize]).
register_kernel("quantize_fp8", "cpp")(composed_quantize_fp8("cpp"))


register_kernel("quantize_fp8_delayed", "cpp")(composed_quantize_fp8_delayed("cpp"))
