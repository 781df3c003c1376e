"""Per-tensor FP8 (docs/design.md, 'Numerics'): amax, cast with a given scale, dequantize and transpose, each
with its reference. The scales are in `fp8._scale`, the one-operator quantize functions in
`fp8._quantize`.

Buffers: rowwise data has the input's shape; columnwise data is the (K, M) transpose of the
input's (M, K) view (M = product of the leading dims, K = the last dim). Data tensors carry the
torch FP8 dtype; `.view(torch.uint8)` gives the raw bytes that collectives move.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.amax(x_MK) -> Tensor`: x_MK 2-D fp32/bf16/fp16, any strides. Returns
  fp32 0-d max |x| over the finite elements (0 if none or empty).
- `torch.ops.quant_core.cast_to_fp8(x_MK, scale, fp8_dtype, rowwise_MK, columnwise_KM) -> ()`:
  x_MK 2-D fp32/bf16/fp16, any strides; scale a one-element fp32 tensor on x's device;
  fp8_dtype E4M3 or E5M2; rowwise_MK a contiguous (M, K) tensor of fp8_dtype or None,
  columnwise_KM contiguous (K, M) or None. Fills the buffers given.
- `torch.ops.quant_core.dequantize_fp8(data_MK, scale_inv, dtype) -> Tensor`: data_MK 2-D FP8,
  any strides; scale_inv a one-element fp32 tensor on its device; dtype fp32/bf16/fp16.
  Returns the contiguous (M, K) values.
- `torch.ops.quant_core.transpose_bytes(data_MK) -> Tensor`: data_MK 2-D with one-byte elements,
  any strides. Returns its contiguous (K, M) transpose, same dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel, with_contiguous
from quant_core.shared._checks import (
    as_2d,
    check_float_input,
    check_fp8_dtype,
    check_output_dtype,
    check_scalar,
    output_buffer,
    with_shape,
)
from quant_core.shared._cpp import _C, DTYPE_CODES, FP8_FORMAT_CODES
from quant_core.shared._numerics import encode_fp8, finite_abs, to_output_dtype

# ---- amax ------------------------------------------------------------------------------------


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements of x as an fp32 0-d tensor (0 if none is finite)."""
    check_float_input(x)
    return call("amax", as_2d(x))


class AmaxArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.amax` ([Note: operator arguments])."""

    x_MK: torch.Tensor


def _amax_fake(args: AmaxArgs) -> torch.Tensor:
    return args.x_MK.new_empty((), dtype=torch.float32)


@define_op("amax", AmaxArgs, fake=_amax_fake)
def _amax_op(kernel: Kernel, args: AmaxArgs) -> torch.Tensor:
    if args.x_MK.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=args.x_MK.device)
    return kernel(args)


@register_kernel("amax", "reference")
def _amax_reference_kernel(args: AmaxArgs) -> torch.Tensor:
    return amax_reference(args.x_MK)


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch amax: NaN and +-Inf are ignored; empty or all non-finite gives 0."""
    finite = finite_abs(x)
    if finite.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return finite.max()


def amax_torch_ops(x: torch.Tensor) -> torch.Tensor:
    """`amax_reference`'s value, bit for bit, as plain torch ops that torch.compile traces (no
    operator, no boolean indexing): Inductor fuses them into the kernel that produces x. Max is
    exact in any dtype, so x's own dtype is reduced and the 0-d result converted to fp32."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(torch.isfinite(x), x.abs(), 0).amax().float()


# ---- cast ------------------------------------------------------------------------------------


def cast_to_fp8_reference(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Plain-torch cast with a given scale: (rowwise codes, columnwise codes) = fp8(x * scale)."""
    codes = encode_fp8(x.float() * scale, fp8_dtype)
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
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one usage: rowwise=True and/or columnwise=True")
    x_MK, rowwise_data, rowwise_MK, columnwise_KM = checked_layout(
        x, fp8_dtype, rowwise, columnwise, rowwise_out, columnwise_out
    )
    check_scalar(scale, "scale", x.device)
    call("cast_to_fp8", x_MK, scale, fp8_dtype, rowwise_MK, columnwise_KM)
    return rowwise_data, columnwise_KM


def checked_layout(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    rowwise_out: torch.Tensor | None,
    columnwise_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Checks x and fp8_dtype, checks the given buffers or allocates the missing ones of the usages
    asked for. Returns (x_MK, rowwise data in x's shape, the same as (M, K), columnwise (K, M))."""
    check_fp8_input(x, fp8_dtype)
    x_MK = as_2d(x)
    M, K = x_MK.shape
    rowwise_data = output_buffer(rowwise_out, "rowwise_out", tuple(x.shape), fp8_dtype, x.device) if rowwise else None
    columnwise_KM = output_buffer(columnwise_out, "columnwise_out", (K, M), fp8_dtype, x.device) if columnwise else None
    rowwise_MK = None if rowwise_data is None else as_2d(rowwise_data)
    return x_MK, rowwise_data, rowwise_MK, columnwise_KM


def check_fp8_input(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    """Checks an FP8 quantize's input (fp32/bf16/fp16 with at least one dim) and fp8_dtype."""
    check_float_input(x)
    check_fp8_dtype(fp8_dtype)
    if x.dim() == 0:
        raise ValueError("x is 0-d; FP8 quantization needs a last dim to lay data out along (reshape it to (1,))")


class CastToFp8Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.cast_to_fp8` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    scale: torch.Tensor
    fp8_dtype: torch.dtype
    rowwise_MK: torch.Tensor | None
    columnwise_KM: torch.Tensor | None


@define_op("cast_to_fp8", CastToFp8Args, mutates_args=("rowwise_MK", "columnwise_KM"), recomputable=True)
def _cast_to_fp8_op(kernel: Kernel, args: CastToFp8Args) -> None:
    if args.x_MK.numel() > 0:
        kernel(args)


@register_kernel("cast_to_fp8", "reference")
def _cast_to_fp8_reference_kernel(args: CastToFp8Args) -> None:
    rowwise_MK, columnwise_KM = args.rowwise_MK, args.columnwise_KM
    rowwise, columnwise = cast_to_fp8_reference(
        args.x_MK, args.scale, args.fp8_dtype, rowwise=rowwise_MK is not None, columnwise=columnwise_KM is not None
    )
    if rowwise_MK is not None:
        rowwise_MK.copy_(rowwise)
    if columnwise_KM is not None:
        columnwise_KM.copy_(columnwise)


# ---- dequantize -------------------------------------------------------------------------------


def dequantize_fp8_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch dequantize: fp32(data) * scale_inv, rounded to `dtype` (canonical NaN)."""
    return to_output_dtype(data.float() * scale_inv, dtype)


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-tensor FP8 values of rowwise or columnwise data: fp32(data) * scale_inv, as `dtype`."""
    if not isinstance(data, torch.Tensor) or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"data must have an FP8 dtype, got {getattr(data, 'dtype', type(data).__name__)}")
    check_scalar(scale_inv, "scale_inv", data.device)
    check_output_dtype(dtype)
    return with_shape(call("dequantize_fp8", as_2d(data), scale_inv, dtype), data.shape)


class DequantizeFp8Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_fp8` ([Note: operator arguments])."""

    data_MK: torch.Tensor
    scale_inv: torch.Tensor
    dtype: torch.dtype


def _dequantize_fp8_fake(args: DequantizeFp8Args) -> torch.Tensor:
    return args.data_MK.new_empty(args.data_MK.shape, dtype=args.dtype)


@define_op("dequantize_fp8", DequantizeFp8Args, fake=_dequantize_fp8_fake)
def _dequantize_fp8_op(kernel: Kernel, args: DequantizeFp8Args) -> torch.Tensor:
    """Kernels take (args with data_MK contiguous, out_MK: the contiguous (M, K) output of args.dtype)."""
    out_MK = torch.empty(args.data_MK.shape, dtype=args.dtype, device=args.data_MK.device)
    if out_MK.numel() > 0:
        kernel(with_contiguous(args, "data_MK"), out_MK)
    return out_MK


@register_kernel("dequantize_fp8", "reference")
def _dequantize_fp8_reference_kernel(args: DequantizeFp8Args, out_MK: torch.Tensor) -> None:
    out_MK.copy_(dequantize_fp8_reference(args.data_MK, args.scale_inv, args.dtype))


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """Columnwise from rowwise per-tensor FP8 data: the contiguous (K, M) transpose of its (M, K) view.

    Lossless (bytes are moved, not requantized); also moves 128 x 128 blockwise data.
    """
    if (
        not isinstance(data, torch.Tensor)
        or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
        or data.dim() == 0
    ):
        raise ValueError(
            f"data must be FP8 data with at least one dim, got {getattr(data, 'dtype', type(data).__name__)}"
        )
    return call("transpose_bytes", as_2d(data))


class TransposeBytesArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.transpose_bytes` ([Note: operator arguments])."""

    data_MK: torch.Tensor


def _transpose_bytes_fake(args: TransposeBytesArgs) -> torch.Tensor:
    return args.data_MK.new_empty((args.data_MK.shape[1], args.data_MK.shape[0]))


@define_op("transpose_bytes", TransposeBytesArgs, fake=_transpose_bytes_fake, recomputable=True)
def _transpose_bytes_op(kernel: Kernel, args: TransposeBytesArgs) -> torch.Tensor:
    """Kernels take (args with data_MK viewed as uint8, out_KM: the contiguous (K, M) uint8 output)."""
    data_MK = args.data_MK
    out_KM = torch.empty((data_MK.shape[1], data_MK.shape[0]), dtype=data_MK.dtype, device=data_MK.device)
    if out_KM.numel() > 0:
        kernel(TransposeBytesArgs(data_MK.view(torch.uint8)), out_KM.view(torch.uint8))
    return out_KM


@register_kernel("transpose_bytes", "reference")
def _transpose_bytes_reference(args: TransposeBytesArgs, out_KM: torch.Tensor) -> None:
    out_KM.copy_(args.data_MK.t())


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("amax", "cpp")
def _amax_cpp(args: AmaxArgs) -> torch.Tensor:
    x_MK = args.x_MK
    out = torch.empty((), dtype=torch.float32)
    M, K = x_MK.shape
    _C.amax(x_MK.data_ptr(), DTYPE_CODES[x_MK.dtype], M, K, *x_MK.stride(), out.data_ptr(), torch.get_num_threads())
    return out


@register_kernel("cast_to_fp8", "cpp")
def _cast_to_fp8_cpp(args: CastToFp8Args) -> None:
    x_MK, rowwise_MK, columnwise_KM = args.x_MK, args.rowwise_MK, args.columnwise_KM
    M, K = x_MK.shape
    _C.cast_to_fp8(
        x_MK.data_ptr(),
        DTYPE_CODES[x_MK.dtype],
        M,
        K,
        *x_MK.stride(),
        args.scale.data_ptr(),
        FP8_FORMAT_CODES[args.fp8_dtype],
        0 if rowwise_MK is None else rowwise_MK.data_ptr(),  # `pointer`, inline: a hot path
        0 if columnwise_KM is None else columnwise_KM.data_ptr(),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_fp8", "cpp")
def _dequantize_fp8_cpp(args: DequantizeFp8Args, out_MK: torch.Tensor) -> None:
    data_MK = args.data_MK
    R, C = data_MK.shape
    _C.dequantize_fp8(
        data_MK.data_ptr(),
        FP8_FORMAT_CODES[data_MK.dtype],
        R,
        C,
        args.scale_inv.data_ptr(),
        out_MK.data_ptr(),
        DTYPE_CODES[out_MK.dtype],
        torch.get_num_threads(),
    )


@register_kernel("transpose_bytes", "cpp")
def _transpose_bytes_cpp(args: TransposeBytesArgs, out_KM: torch.Tensor) -> None:
    data_MK = args.data_MK
    _C.transpose_bytes(
        data_MK.data_ptr(), *data_MK.shape, *data_MK.stride(), out_KM.data_ptr(), torch.get_num_threads()
    )
