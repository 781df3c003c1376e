"""MXFP8 (docs/design.md, 'Numerics'): E4M3 codes in blocks of 32 with a power-of-two E8M0 scale each.

Per block: e = the smallest integer with block_amax <= 448 * 2^e, clamped to [-127, 127]
(an all-zero block gets -127); stored as the byte e + 127; codes = e4m3(x / 2^e); dequantized
e4m3(code) * 2^e. Rowwise blocks run along K, columnwise blocks along M ([Note: block layouts]).

Operators ([Note: block operators]; no format arguments): `torch.ops.quant_core.quantize_mxfp8(
x_MK, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)` with E4M3 data and
uint8 E8M0 scales; `torch.ops.quant_core.dequantize_mxfp8(data_2d, scale_inv, dtype)`;
`torch.ops.quant_core.dequantize_mxfp8_pair(a_data_2d, a_scale_inv, b_data_2d, b_scale_inv, dtype)
-> (Tensor, Tensor)` ([Note: dequantizing two operands]).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import call, define_op, register_fused_kernel, register_kernel
from quant_core.blocks._layout import (
    QUANTIZE_BUFFERS,
    BlockQuantized,
    block_amax,
    check_pair_device,
    check_quantize_input,
    checked_dequantize_operand,
    copy_into,
    dequantize_blocks,
    dequantize_body,
    dequantize_fake,
    dequantize_pair_body,
    dequantize_pair_fake,
    expand_blocks,
    fill_fused_quantize,
    pair_of,
    quantize_blocks,
    quantize_blocks_reference,
    quantize_body,
    quantize_buffers,
)
from quant_core.shared._checks import as_2d, check_output_dtype, with_shape
from quant_core.shared._cpp import _C, out_dtype_code, outputs, x_args
from quant_core.shared._numerics import (
    E4M3_MAX,
    FUSABLE_INPUT_DTYPES,
    bf16_rounded,
    encode_fp8,
    max_exponent_within,
    power_of_two,
    to_output_dtype,
)

MXFP8_BLOCK = 32
_BLOCK_SHAPE = (1, MXFP8_BLOCK)
E8M0_BIAS = 127


def _exponent(amax: torch.Tensor) -> torch.Tensor:
    """Each block's e, the smallest integer with amax <= 448 * 2^e, in [-127, 127] (int32)."""
    return (-max_exponent_within(amax, E4M3_MAX)).clamp(-127, 127)


def _rowwise_reference(x_MK: torch.Tensor, index_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x_MK.shape
    exponent = _exponent(block_amax(x_MK, _BLOCK_SHAPE))
    codes = encode_fp8(x_MK * expand_blocks(power_of_two(-exponent), _BLOCK_SHAPE, M, K), torch.float8_e4m3fn)
    return codes, (exponent + E8M0_BIAS).to(torch.uint8)


def quantize_mxfp8_reference(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False) -> BlockQuantized:
    """Plain-torch MXFP8 quantization (the spec in code)."""
    check_quantize_input(x, "MXFP8")
    return quantize_blocks_reference(x, _BLOCK_SHAPE, _rowwise_reference, rowwise=rowwise, columnwise=columnwise)


def quantize_mxfp8(
    x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False, out: BlockQuantized | None = None
) -> BlockQuantized:
    """MXFP8 codes (torch.float8_e4m3fn) and E8M0 scales (uint8) for the usages asked for.

    Rowwise and columnwise come from one pass over x. `out` (e.g. a previous result) is refilled in
    place when given. Any shape with at least one dim; edge blocks may be partial.
    """
    check_quantize_input(x, "MXFP8")
    return quantize_blocks(
        "quantize_mxfp8",
        x,
        _BLOCK_SHAPE,
        rowwise=rowwise,
        columnwise=columnwise,
        data_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.uint8,
        codes_per_byte=1,
        format_args=(),
        out=out,
    )


class QuantizeMxfp8Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_mxfp8` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None


define_op("quantize_mxfp8", QuantizeMxfp8Args, mutates_args=QUANTIZE_BUFFERS, recomputable=True)(quantize_body)


@register_kernel("quantize_mxfp8", "reference")
def _quantize_mxfp8_reference_kernel(args: QuantizeMxfp8Args) -> None:
    rowwise, columnwise = args.rowwise_data is not None, args.columnwise_data is not None
    copy_into(quantize_mxfp8_reference(args.x_MK, rowwise=rowwise, columnwise=columnwise), *quantize_buffers(args))


def dequantize_mxfp8_reference(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Plain-torch MXFP8 dequantize of rowwise or columnwise data: e4m3(code) * 2^(byte - 127)."""
    data_MK = as_2d(data)
    M, K = data_MK.shape
    factor = expand_blocks(power_of_two(scale_inv.to(torch.int32) - E8M0_BIAS), _BLOCK_SHAPE, M, K)
    return to_output_dtype(data_MK.float() * factor, dtype).reshape(data.shape)


def dequantize_mxfp8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 values of rowwise (x's shape) or columnwise ((K, M)) data and its E8M0 scales."""
    return dequantize_blocks(
        "dequantize_mxfp8",
        data,
        scale_inv,
        dtype,
        block_shape=_BLOCK_SHAPE,
        data_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.uint8,
        codes_per_byte=1,
        format_args=(),
        format_name="MXFP8",
    )


class DequantizeMxfp8Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_mxfp8` ([Note: operator arguments])."""

    data_2d: torch.Tensor
    scale_inv: torch.Tensor
    dtype: torch.dtype


define_op("dequantize_mxfp8", DequantizeMxfp8Args, fake=dequantize_fake(codes_per_byte=1))(dequantize_body(1))


@register_kernel("dequantize_mxfp8", "reference")
def _dequantize_mxfp8_reference_kernel(args: DequantizeMxfp8Args, out_2d: torch.Tensor) -> None:
    out_2d.copy_(dequantize_mxfp8_reference(args.data_2d, args.scale_inv, args.dtype))


def dequantize_mxfp8_pair(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_mxfp8` of two operands (e.g. a GEMM's) in one call, one launch on CUDA ([Note:
    dequantizing two operands]): the same values as two calls."""
    check_output_dtype(dtype)
    a_2d = checked_dequantize_operand(a_data, a_scale_inv, _BLOCK_SHAPE, torch.float8_e4m3fn, torch.uint8, 1, "MXFP8")
    b_2d = checked_dequantize_operand(b_data, b_scale_inv, _BLOCK_SHAPE, torch.float8_e4m3fn, torch.uint8, 1, "MXFP8")
    check_pair_device(a_data, b_data)
    a_out, b_out = call("dequantize_mxfp8_pair", a_2d, a_scale_inv, b_2d, b_scale_inv, dtype)
    return with_shape(a_out, a_data.shape), with_shape(b_out, b_data.shape)


class DequantizeMxfp8PairArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_mxfp8_pair` ([Note: operator arguments])."""

    a_data_2d: torch.Tensor
    a_scale_inv: torch.Tensor
    b_data_2d: torch.Tensor
    b_scale_inv: torch.Tensor
    dtype: torch.dtype

    def operands(self) -> tuple[DequantizeMxfp8Args, DequantizeMxfp8Args]:
        """Each operand's arguments of `dequantize_mxfp8`."""
        return (
            DequantizeMxfp8Args(self.a_data_2d, self.a_scale_inv, self.dtype),
            DequantizeMxfp8Args(self.b_data_2d, self.b_scale_inv, self.dtype),
        )


define_op("dequantize_mxfp8_pair", DequantizeMxfp8PairArgs, fake=dequantize_pair_fake(codes_per_byte=1))(
    dequantize_pair_body(1)
)
register_kernel("dequantize_mxfp8_pair", "reference")(pair_of(_dequantize_mxfp8_reference_kernel))


# ---- fused kernels ([Note: kernels Inductor fuses] in quant_core._library) ----------------------


def _scale_rule(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exponent = _exponent(amax)
    return power_of_two(-exponent), (exponent + E8M0_BIAS).to(torch.uint8)


@register_fused_kernel("quantize_mxfp8", applies=lambda args: args.x_MK.dtype in FUSABLE_INPUT_DTYPES)
def _quantize_mxfp8_fused_kernel(args: QuantizeMxfp8Args) -> None:
    x_MK = bf16_rounded(args.x_MK)
    fill_fused_quantize(args, x_MK, _BLOCK_SHAPE, _scale_rule, torch.float8_e4m3fn, _rowwise_reference)


@register_fused_kernel("dequantize_mxfp8")
def _dequantize_mxfp8_fused_kernel(args: DequantizeMxfp8Args, out_2d: torch.Tensor) -> None:
    R, C = args.data_2d.shape
    if C % MXFP8_BLOCK:
        out_2d.copy_(dequantize_mxfp8_reference(args.data_2d, args.scale_inv, args.dtype))
        return
    factor = power_of_two(args.scale_inv.to(torch.int32) - E8M0_BIAS)
    values = args.data_2d.float().reshape(R, C // MXFP8_BLOCK, MXFP8_BLOCK) * factor[:, :, None]
    out_2d.copy_(to_output_dtype(values.reshape(R, C), args.dtype))


register_fused_kernel("dequantize_mxfp8_pair")(pair_of(_dequantize_mxfp8_fused_kernel))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("quantize_mxfp8", "cpp")
def _quantize_mxfp8_cpp(args: QuantizeMxfp8Args) -> None:
    _C.quantize_mxfp8(*x_args(args.x_MK), *outputs(*quantize_buffers(args)), torch.get_num_threads())


@register_kernel("dequantize_mxfp8", "cpp")
def _dequantize_mxfp8_cpp(args: DequantizeMxfp8Args, out_2d: torch.Tensor) -> None:
    R, C = args.data_2d.shape
    _C.dequantize_mxfp8(
        args.data_2d.data_ptr(),
        R,
        C,
        args.scale_inv.data_ptr(),
        out_2d.data_ptr(),
        out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


register_kernel("dequantize_mxfp8_pair", "cpp")(pair_of(_dequantize_mxfp8_cpp))
