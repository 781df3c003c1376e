"""NVFP4 dequantize (`_nvfp4.py` has the format): the values of packed codes, both operands of an
emulated GEMM in one call, and the output of that GEMM ([Note: NVFP4 GEMM output]).

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.dequantize_nvfp4(data_2d, scale_inv, block_rows, global_amax, dtype)`:
  [Note: block operators], packed data (R, C/2), E4M3 scales, global_amax as `quantize_nvfp4`'s
  (quant_core.nvfp4._nvfp4) or None (the block values without the tensor scale).
- `torch.ops.quant_core.dequantize_nvfp4_pair(a_data_2d, a_scale_inv, b_data_2d, b_scale_inv,
  a_block_rows, a_global_amax, b_block_rows, b_global_amax, dtype) -> (Tensor, Tensor)`: each
  operand as `dequantize_nvfp4`'s, one device ([Note: dequantizing two operands]).
- `torch.ops.quant_core.nvfp4_gemm_output(product, a_global_amax, b_global_amax, bias, dtype)
  -> Tensor`: [Note: NVFP4 GEMM output]; see `_nvfp4_gemm_output_op` for its contract.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.blocks._layout import (
    BlockShape,
    check_block_shape,
    check_pair_device,
    checked_dequantize_operand,
    dequantize_blocks,
    dequantize_body,
    dequantize_fake,
    dequantize_pair_body,
    dequantize_pair_fake,
    expand_blocks,
    pair_of,
)
from quant_core.nvfp4._nvfp4 import NVFP4_BLOCK, NVFP4_SHAPES, nvfp4_tensor_scale
from quant_core.shared._checks import as_2d, check_output_dtype, check_scalar, with_shape
from quant_core.shared._cpp import _C, out_dtype_code
from quant_core.shared._numerics import E2M1_MAX, E4M3_MAX, decode_e2m1, to_output_dtype, unpack_nibbles


def dequantize_nvfp4_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    global_amax: torch.Tensor | None,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch NVFP4 dequantize: fp32(q) * (fp32(s) / S) with S from global_amax; the block
    values fp32(q) * fp32(s) alone (S = 1) when global_amax is None."""
    packed = as_2d(data)
    S = None if global_amax is None else nvfp4_tensor_scale(global_amax)
    values = _dequantize_with_tensor_scale_reference(packed, scale_inv, S, block_shape)
    return to_output_dtype(values, dtype).reshape(*data.shape[:-1], values.shape[1])


def _dequantize_with_tensor_scale_reference(
    packed: torch.Tensor, scale_inv: torch.Tensor, S: torch.Tensor | None, block_shape: BlockShape
) -> torch.Tensor:
    codes = unpack_nibbles(packed)
    factor = scale_inv.float() if S is None else scale_inv.float() / S
    return decode_e2m1(codes) * expand_blocks(factor, block_shape, *codes.shape)


def dequantize_nvfp4(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    global_amax: torch.Tensor | None,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 values of rowwise (last dim K/2) or columnwise ((K, M/2)) data; the last dim doubles.

    With global_amax None: the block values without the tensor scale, fp32(q) * fp32(s), which
    bf16 holds exactly (what the emulated GEMM multiplies: `nvfp4_gemm_output` applies 1 / S).
    """
    block_shape = check_block_shape(block_shape, NVFP4_SHAPES, "NVFP4")
    if global_amax is not None:
        global_amax = check_scalar(global_amax, "global_amax", data.device).reshape(())
    return dequantize_blocks(
        "dequantize_nvfp4",
        data,
        scale_inv,
        dtype,
        block_shape=block_shape,
        data_dtype=torch.uint8,
        scale_dtype=torch.float8_e4m3fn,
        codes_per_byte=2,
        format_args=(block_shape[0], global_amax),
        format_name="NVFP4",
    )


class DequantizeNvfp4Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_nvfp4` ([Note: operator arguments])."""

    data_2d: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int
    global_amax: torch.Tensor | None
    dtype: torch.dtype


define_op("dequantize_nvfp4", DequantizeNvfp4Args, fake=dequantize_fake(codes_per_byte=2))(dequantize_body(2))


@register_kernel("dequantize_nvfp4", "reference")
def _dequantize_nvfp4_reference_kernel(args: DequantizeNvfp4Args, out_2d: torch.Tensor) -> None:
    S = None if args.global_amax is None else nvfp4_tensor_scale(args.global_amax)
    values = _dequantize_with_tensor_scale_reference(args.data_2d, args.scale_inv, S, (args.block_rows, NVFP4_BLOCK))
    out_2d.copy_(to_output_dtype(values, args.dtype))


def dequantize_nvfp4_pair(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_global_amax: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_global_amax: torch.Tensor | None,
    *,
    a_block_shape: BlockShape = (1, NVFP4_BLOCK),
    b_block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_nvfp4` of two operands (e.g. a GEMM's) in one call, one launch on CUDA ([Note:
    dequantizing two operands]): the same values as two calls."""
    check_output_dtype(dtype)
    operands = []
    for data, scale_inv, global_amax, block_shape in (
        (a_data, a_scale_inv, a_global_amax, a_block_shape),
        (b_data, b_scale_inv, b_global_amax, b_block_shape),
    ):
        block_shape = check_block_shape(block_shape, NVFP4_SHAPES, "NVFP4")
        if global_amax is not None:
            global_amax = check_scalar(global_amax, "global_amax", data.device).reshape(())
        data_2d = checked_dequantize_operand(data, scale_inv, block_shape, torch.uint8, torch.float8_e4m3fn, 2, "NVFP4")
        operands.append((data_2d, scale_inv, block_shape[0], global_amax))
    (a_2d, a_scale, a_rows, a_amax), (b_2d, b_scale, b_rows, b_amax) = operands
    check_pair_device(a_data, b_data)
    a_out, b_out = call("dequantize_nvfp4_pair", a_2d, a_scale, b_2d, b_scale, a_rows, a_amax, b_rows, b_amax, dtype)
    a_values = with_shape(a_out, (*a_data.shape[:-1], a_out.shape[1]))
    return a_values, with_shape(b_out, (*b_data.shape[:-1], b_out.shape[1]))


class DequantizeNvfp4PairArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_nvfp4_pair` ([Note: operator arguments])."""

    a_data_2d: torch.Tensor
    a_scale_inv: torch.Tensor
    b_data_2d: torch.Tensor
    b_scale_inv: torch.Tensor
    a_block_rows: int
    a_global_amax: torch.Tensor | None
    b_block_rows: int
    b_global_amax: torch.Tensor | None
    dtype: torch.dtype

    def operands(self) -> tuple[DequantizeNvfp4Args, DequantizeNvfp4Args]:
        """Each operand's arguments of `dequantize_nvfp4`."""
        return (
            DequantizeNvfp4Args(self.a_data_2d, self.a_scale_inv, self.a_block_rows, self.a_global_amax, self.dtype),
            DequantizeNvfp4Args(self.b_data_2d, self.b_scale_inv, self.b_block_rows, self.b_global_amax, self.dtype),
        )


define_op("dequantize_nvfp4_pair", DequantizeNvfp4PairArgs, fake=dequantize_pair_fake(codes_per_byte=2))(
    dequantize_pair_body(2)
)
register_kernel("dequantize_nvfp4_pair", "reference")(pair_of(_dequantize_nvfp4_reference_kernel))


# ---- the output of an emulated GEMM ---------------------------------------------------------------


def nvfp4_gemm_output_reference(
    product: torch.Tensor,
    a_global_amax: torch.Tensor,
    b_global_amax: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain-torch [Note: NVFP4 GEMM output]: dtype(product * (1/S_a * 1/S_b) + fp32(bias))."""
    factor = torch.reciprocal(nvfp4_tensor_scale(a_global_amax)) * torch.reciprocal(nvfp4_tensor_scale(b_global_amax))
    values = product * factor
    if bias is not None:
        values = values + bias.float()
    return to_output_dtype(values, dtype)


def nvfp4_gemm_output(
    product: torch.Tensor,
    a_global_amax: torch.Tensor,
    b_global_amax: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The output of an emulated NVFP4 GEMM from the fp32 product of its operands' block values.

    [Note: NVFP4 GEMM output] A @ B^T of two NVFP4 operands is (A_b @ B_b^T) / (S_a S_b), A_b and
    B_b the block values (`dequantize_nvfp4(..., None)`: exact in bf16, so bf16 tensor cores with
    fp32 accumulation multiply them). Given that fp32 (M, N) product, this returns
    dtype(product * f + fp32(bias)) with f = fp32(1 / S_a) * fp32(1 / S_b), S from each operand's
    global amax (`nvfp4_tensor_scale`), bias (N,) optional: one fp32 multiply, one fp32 add, one
    rounding (no fused multiply-add). On CUDA one kernel, which computes f itself from the two
    amaxes (no scale ops on the host's stream).
    """
    if not isinstance(product, torch.Tensor) or product.dtype != torch.float32 or product.dim() != 2:
        got = f"{product.dtype} of shape {tuple(product.shape)}" if isinstance(product, torch.Tensor) else type(product)
        raise ValueError(f"product must be a 2-D float32 tensor (the fp32 GEMM product), got {got}")
    check_scalar(a_global_amax, "a_global_amax", product.device)
    check_scalar(b_global_amax, "b_global_amax", product.device)
    if bias is not None and (bias.shape != product.shape[1:] or bias.device != product.device):
        raise ValueError(
            f"bias must have shape ({product.shape[1]},) on {product.device} (one per output column), got "
            f"shape {tuple(bias.shape)} on {bias.device}"
        )
    check_output_dtype(dtype)
    return call(
        "nvfp4_gemm_output", product.contiguous(), a_global_amax.reshape(()), b_global_amax.reshape(()), bias, dtype
    )


class Nvfp4GemmOutputArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.nvfp4_gemm_output` ([Note: operator arguments])."""

    product: torch.Tensor
    a_global_amax: torch.Tensor
    b_global_amax: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype


def _nvfp4_gemm_output_fake(args: Nvfp4GemmOutputArgs) -> torch.Tensor:
    return args.product.new_empty(args.product.shape, dtype=args.dtype)


@define_op("nvfp4_gemm_output", Nvfp4GemmOutputArgs, fake=_nvfp4_gemm_output_fake)
def _nvfp4_gemm_output_op(kernel: Kernel, args: Nvfp4GemmOutputArgs) -> torch.Tensor:
    """Contract: product contiguous 2-D fp32, amaxes 0-d fp32 and bias None or (N,), all on one
    device. Kernels take (args, out: the new output of args.dtype)."""
    out = torch.empty(args.product.shape, dtype=args.dtype, device=args.product.device)
    if out.numel() > 0:
        kernel(args, out)
    return out


@register_kernel("nvfp4_gemm_output", "reference")
def _nvfp4_gemm_output_reference_kernel(args: Nvfp4GemmOutputArgs, out: torch.Tensor) -> None:
    out.copy_(nvfp4_gemm_output_reference(*args))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("dequantize_nvfp4", "cpp")
def _dequantize_nvfp4_cpp(args: DequantizeNvfp4Args, out_2d: torch.Tensor) -> None:
    R, C = out_2d.shape
    global_amax = args.global_amax
    if global_amax is None:  # the block values alone: the amax whose tensor scale S is exactly 1
        global_amax = torch.full((), E4M3_MAX * E2M1_MAX)
    _C.dequantize_nvfp4(
        args.data_2d.data_ptr(),
        R,
        C,
        args.block_rows,
        args.scale_inv.data_ptr(),
        global_amax.data_ptr(),
        out_2d.data_ptr(),
        out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


register_kernel("dequantize_nvfp4_pair", "cpp")(pair_of(_dequantize_nvfp4_cpp))
