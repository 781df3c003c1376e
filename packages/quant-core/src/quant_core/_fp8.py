"""Per-tensor FP8 (DESIGN section 3): amax, scale, cast and quantize, each with its reference.

Buffers: rowwise data has the input's shape; columnwise data is the (K, M) transpose of the
input's (M, K) view (M = product of the leading dims, K = the last dim). Data tensors carry the
torch FP8 dtype; `.view(torch.uint8)` gives the raw bytes that collectives move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant_core._backend import kernel, register_kernel
from quant_core._checks import as_2d, check_float_input, check_fp8_dtype, check_scalar, output_buffer

_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_EXPONENT_MASK = 0x7F800000
# [Note: FP8 NaN] Every NaN encodes to 0x7F (a NaN in both E4M3 and E5M2), whatever its sign:
# torch's own conversions do not keep a NaN's sign reliably (its scalar fp16 -> fp32 path turns
# -NaN into +NaN), so a signed NaN code could not be reproduced bit for bit across backends.
_FP8_NAN_CODE = 0x7F


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
    """fp32 0-d: max |x| over the finite elements."""


# ---- amax ------------------------------------------------------------------------------------


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements of x as an fp32 0-d tensor (0 if none is finite)."""
    check_float_input(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return kernel("amax", x.device)(as_2d(x))


@register_kernel("amax", "reference")
def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch amax: NaN and +-Inf are ignored; empty or all non-finite gives 0."""
    magnitude = x.float().abs()
    finite = torch.where(torch.isfinite(magnitude), magnitude, 0.0)
    if finite.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return finite.max()


# ---- scale -----------------------------------------------------------------------------------


def fp8_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, *, power_2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) for current scaling: scale = fmax / amax (1 if amax is 0).

    A scale that overflows fp32 (tiny amax) is clamped to the largest finite fp32; with
    `power_2_scales` it is rounded down to a power of two, so scaling is exact. Computed with
    torch ops on amax's device (no host sync) and shared by every backend.
    """
    check_fp8_dtype(fp8_dtype)
    fmax = torch.finfo(fp8_dtype).max
    amax = amax.float()
    scale = torch.where(amax > 0, fmax / amax, 1.0).clamp(max=_FLOAT32_MAX)
    if power_2_scales:
        # Keep the exponent bits only: the largest power of two <= scale (scale is normal here).
        scale = (scale.view(torch.int32) & _FLOAT32_EXPONENT_MASK).view(torch.float32)
    return scale, torch.reciprocal(scale)


# ---- cast ------------------------------------------------------------------------------------


def _encode_reference(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(v): clamp to +-fmax (so +-Inf saturates), round to nearest even; NaN -> 0x7F."""
    fmax = torch.finfo(fp8_dtype).max
    codes = v.clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
    return torch.where(torch.isnan(v), _FP8_NAN_CODE, codes).view(fp8_dtype)


def cast_to_fp8_reference(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Plain-torch cast with a given scale: (rowwise codes, columnwise codes) = fp8(x * scale)."""
    codes = _encode_reference(x.float() * scale, fp8_dtype)
    columnwise_data = as_2d(codes).t().contiguous() if columnwise else None
    return (codes if rowwise else None), columnwise_data


def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    rowwise_out: torch.Tensor | None = None,
    columnwise_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """FP8 codes of x * scale for the usages asked for, written into `*_out` when given.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim; any strides.
        scale: one-element fp32 tensor on x's device (see `fp8_scale`).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        rowwise / columnwise: which codes to produce; columnwise is the (K, M) transpose.
        rowwise_out / columnwise_out: contiguous buffers to fill in place (shapes as above).
    Returns:
        (rowwise_data, columnwise_data), None for a usage not asked for.
    """
    check_float_input(x)
    check_fp8_dtype(fp8_dtype)
    check_scalar(scale, "scale", x.device)
    if x.dim() == 0:
        raise ValueError("x is 0-d; FP8 quantization needs a last dim to lay data out along (reshape it to (1,))")
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one usage: rowwise=True and/or columnwise=True")
    x_MK = as_2d(x)
    M, K = x_MK.shape
    rowwise_data = output_buffer(rowwise_out, "rowwise_out", tuple(x.shape), fp8_dtype, x.device) if rowwise else None
    columnwise_data = (
        output_buffer(columnwise_out, "columnwise_out", (K, M), fp8_dtype, x.device) if columnwise else None
    )
    if x.numel() > 0:
        rowwise_MK = None if rowwise_data is None else rowwise_data.view(M, K)
        kernel("cast_to_fp8", x.device)(x_MK, scale.reshape(()), fp8_dtype, rowwise_MK, columnwise_data)
    return rowwise_data, columnwise_data


@register_kernel("cast_to_fp8", "reference")
def _cast_to_fp8_reference_kernel(
    x_MK: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise_MK: torch.Tensor | None,
    columnwise_KM: torch.Tensor | None,
) -> None:
    rowwise, columnwise = cast_to_fp8_reference(
        x_MK, scale, fp8_dtype, rowwise=rowwise_MK is not None, columnwise=columnwise_KM is not None
    )
    if rowwise_MK is not None:
        rowwise_MK.copy_(rowwise)
    if columnwise_KM is not None:
        columnwise_KM.copy_(columnwise)


# ---- quantize (current scaling) ---------------------------------------------------------------


def quantize_fp8_reference(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = False,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Float8Quantized:
    """Plain-torch per-tensor current-scaling quantization (DESIGN section 3)."""
    x_amax = amax_reference(x)
    scale, scale_inv = fp8_scale(x_amax, fp8_dtype, power_2_scales=power_2_scales)
    rowwise_data, columnwise_data = cast_to_fp8_reference(x, scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return Float8Quantized(rowwise_data, columnwise_data, scale, scale_inv, x_amax)


def quantize_fp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = False,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Float8Quantized:
    """Per-tensor FP8 with current scaling: amax of x, scale = fmax / amax, then the cast.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim.
        fp8_dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
        power_2_scales: round the scale down to a power of two.
        rowwise / columnwise: which layouts to write; both come from one pass over x.
    """
    x_amax = amax(x)
    scale, scale_inv = fp8_scale(x_amax, fp8_dtype, power_2_scales=power_2_scales)
    rowwise_data, columnwise_data = cast_to_fp8(x, scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    return Float8Quantized(rowwise_data, columnwise_data, scale, scale_inv, x_amax)


# ---- dequantize -------------------------------------------------------------------------------


def dequantize_fp8_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch dequantize: fp32(data) * scale_inv, then cast to `dtype`."""
    return (data.float() * scale_inv).to(dtype)
