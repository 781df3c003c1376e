"""Blockwise FP8 (docs/design.md, 'Numerics'): 1 x 128 blocks (activations, gradients), 128 x 128 tiles (weights).

Per block: with power-of-two scales (the default) scale = the largest power of two with
block_amax * scale <= fmax (1 for an all-zero block); otherwise scale = fmax / block_amax
(clamped to the largest fp32). codes = fp8(x * scale); stored: scale_inv = 1 / scale (fp32).
Columnwise of 1 x 128 is the 1 x 128 quantization of x^T; of 128 x 128 the exact transpose.

Operators ([Note: block operators]; format arguments: block_rows 1 or 128, the FP8 dtype,
power-of-two scales): `torch.ops.quant_core.quantize_fp8_blockwise(x_MK, block_rows, fp8_dtype,
power_2_scales, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv)` with
fp8_dtype data and fp32 scales; `torch.ops.quant_core.dequantize_fp8_blockwise(data_2d, scale_inv,
block_rows, dtype)`. Blocks span 128 columns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import define_op, register_fused_kernel, register_kernel
from quant_core.blocks._layout import (
    QUANTIZE_BUFFERS,
    BlockQuantized,
    BlockShape,
    RowwiseReference,
    block_amax,
    check_block_shape,
    check_quantize_input,
    copy_into,
    dequantize_blocks,
    dequantize_body,
    dequantize_fake,
    expand_blocks,
    fill_fused_quantize,
    quantize_blocks,
    quantize_blocks_reference,
    quantize_body,
    quantize_buffers,
)
from quant_core.fp8._fp8 import transpose_fp8
from quant_core.shared._checks import as_2d, check_fp8_dtype
from quant_core.shared._cpp import _C, FP8_FORMAT_CODES, out_dtype_code, outputs, x_args
from quant_core.shared._numerics import (
    FLOAT32_MAX,
    FUSABLE_INPUT_DTYPES,
    bf16_rounded,
    divide,
    encode_fp8,
    max_exponent_within,
    power_of_two,
    to_output_dtype,
)

BLOCKWISE_BLOCK = 128
BLOCKWISE_SHAPES: tuple[BlockShape, ...] = ((1, BLOCKWISE_BLOCK), (BLOCKWISE_BLOCK, BLOCKWISE_BLOCK))


def _power_2_exponent(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Each block's power-of-two scale as its exponent: the largest s with amax * 2^s <= fmax (0
    for an all-zero block), at most 127."""
    return torch.where(amax > 0, max_exponent_within(amax, fmax).clamp(max=127), 0)


def _block_scale(amax: torch.Tensor, fmax: float, power_2_scales: bool) -> torch.Tensor:
    if power_2_scales:
        return power_of_two(_power_2_exponent(amax, fmax))
    return torch.where(amax > 0, divide(fmax, amax), 1.0).clamp(max=FLOAT32_MAX)


def _rowwise_reference(block_shape: BlockShape, fp8_dtype: torch.dtype, power_2_scales: bool) -> RowwiseReference:
    """The reference's quantization of one usage: (codes, scale_inv) of a 2-D fp32 operand."""
    fmax = torch.finfo(fp8_dtype).max

    def rowwise_fn(x_MK: torch.Tensor, index_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = _block_scale(block_amax(x_MK, block_shape), fmax, power_2_scales)
        codes = encode_fp8(x_MK * expand_blocks(scale, block_shape, *x_MK.shape), fp8_dtype)
        return codes, torch.reciprocal(scale)

    return rowwise_fn


def quantize_fp8_blockwise_reference(
    x: torch.Tensor,
    block_shape: BlockShape = (1, BLOCKWISE_BLOCK),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = True,
    rowwise: bool = True,
    columnwise: bool = False,
) -> BlockQuantized:
    """Plain-torch blockwise FP8 quantization (the spec in code)."""
    check_quantize_input(x, "blockwise FP8")
    block_shape = check_block_shape(block_shape, BLOCKWISE_SHAPES, "blockwise FP8")
    rowwise_fn = _rowwise_reference(block_shape, check_fp8_dtype(fp8_dtype), power_2_scales)
    return quantize_blocks_reference(x, block_shape, rowwise_fn, rowwise=rowwise, columnwise=columnwise)


def quantize_fp8_blockwise(
    x: torch.Tensor,
    block_shape: BlockShape = (1, BLOCKWISE_BLOCK),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = True,
    rowwise: bool = True,
    columnwise: bool = False,
    out: BlockQuantized | None = None,
) -> BlockQuantized:
    """Blockwise FP8 codes and fp32 scale_inv per block, for the usages asked for, in one pass.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim; edge blocks may be partial.
        block_shape: (1, 128) for activations and gradients, (128, 128) for weights.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        power_2_scales: scales are powers of two (exact scaling) rather than fmax / amax.
        out: a previous result whose buffers are refilled in place.
    """
    check_quantize_input(x, "blockwise FP8")
    block_shape = check_block_shape(block_shape, BLOCKWISE_SHAPES, "blockwise FP8")
    return quantize_blocks(
        "quantize_fp8_blockwise",
        x,
        block_shape,
        rowwise=rowwise,
        columnwise=columnwise,
        data_dtype=check_fp8_dtype(fp8_dtype),
        scale_dtype=torch.float32,
        codes_per_byte=1,
        format_args=(block_shape[0], fp8_dtype, power_2_scales),
        out=out,
    )


class QuantizeFp8BlockwiseArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_fp8_blockwise` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    block_rows: int
    fp8_dtype: torch.dtype
    power_2_scales: bool
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None


define_op("quantize_fp8_blockwise", QuantizeFp8BlockwiseArgs, mutates_args=QUANTIZE_BUFFERS, recomputable=True)(
    quantize_body
)


@register_kernel("quantize_fp8_blockwise", "reference")
def _quantize_fp8_blockwise_reference_kernel(args: QuantizeFp8BlockwiseArgs) -> None:
    result = quantize_fp8_blockwise_reference(
        args.x_MK,
        (args.block_rows, BLOCKWISE_BLOCK),
        args.fp8_dtype,
        power_2_scales=args.power_2_scales,
        rowwise=args.rowwise_data is not None,
        columnwise=args.columnwise_data is not None,
    )
    copy_into(result, *quantize_buffers(args))


@register_fused_kernel(
    "quantize_fp8_blockwise", applies=lambda args: args.power_2_scales and args.x_MK.dtype in FUSABLE_INPUT_DTYPES
)
def _quantize_fp8_blockwise_fused_kernel(args: QuantizeFp8BlockwiseArgs) -> None:
    """[Note: kernels Inductor fuses] in quant_core._library: power-of-two scales only (fmax / amax
    scales need a division), fp32 and bf16 inputs only."""
    block_shape = (args.block_rows, BLOCKWISE_BLOCK)
    fmax = torch.finfo(args.fp8_dtype).max

    def scale_rule(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = _power_2_exponent(amax, fmax)
        return power_of_two(exponent), power_of_two(-exponent)  # 1 / scale exactly, no division

    reference = _rowwise_reference(block_shape, args.fp8_dtype, power_2_scales=True)
    fill_fused_quantize(args, bf16_rounded(args.x_MK), block_shape, scale_rule, args.fp8_dtype, reference)


def dequantize_fp8_blockwise_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_shape: BlockShape = (1, BLOCKWISE_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch blockwise FP8 dequantize: fp32(code) * scale_inv of its block."""
    data_MK = as_2d(data)
    factor = expand_blocks(scale_inv, block_shape, *data_MK.shape)
    return to_output_dtype(data_MK.float() * factor, dtype).reshape(data.shape)


def dequantize_fp8_blockwise(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_shape: BlockShape = (1, BLOCKWISE_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Blockwise FP8 values of rowwise (x's shape) or columnwise ((K, M)) data and its scale_inv."""
    block_shape = check_block_shape(block_shape, BLOCKWISE_SHAPES, "blockwise FP8")
    if not isinstance(data, torch.Tensor) or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"blockwise FP8 data must have an FP8 dtype, got {getattr(data, 'dtype', type(data).__name__)}"
        )
    return dequantize_blocks(
        "dequantize_fp8_blockwise",
        data,
        scale_inv,
        dtype,
        block_shape=block_shape,
        data_dtype=data.dtype,
        scale_dtype=torch.float32,
        codes_per_byte=1,
        format_args=(block_shape[0],),
        format_name="blockwise FP8",
    )


class DequantizeFp8BlockwiseArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_fp8_blockwise` ([Note: operator arguments])."""

    data_2d: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int
    dtype: torch.dtype


define_op("dequantize_fp8_blockwise", DequantizeFp8BlockwiseArgs, fake=dequantize_fake(codes_per_byte=1))(
    dequantize_body(1)
)


@register_kernel("dequantize_fp8_blockwise", "reference")
def _dequantize_fp8_blockwise_reference_kernel(args: DequantizeFp8BlockwiseArgs, out_2d: torch.Tensor) -> None:
    block_shape = (args.block_rows, BLOCKWISE_BLOCK)
    out_2d.copy_(dequantize_fp8_blockwise_reference(args.data_2d, args.scale_inv, block_shape, args.dtype))


def transpose_fp8_blockwise(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless columnwise from rowwise for 128 x 128 tiles: (data^T, scale_inv^T), both contiguous.

    `data` is rowwise data of any shape (viewed as (M, K)); the result equals the columnwise
    usage of quantizing the same tensor, bit for bit.
    """
    if data.dim() == 0 or data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"data must be FP8 rowwise data with at least one dim, got {data.dtype} of shape {tuple(data.shape)}"
        )
    data_MK = as_2d(data)
    expected = (-(-data_MK.shape[0] // BLOCKWISE_BLOCK), -(-data_MK.shape[1] // BLOCKWISE_BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv of 128 x 128 tiles for data of shape {tuple(data.shape)} must have shape {expected}, "
            f"got {tuple(scale_inv.shape)} (1 x 128 data cannot be transposed losslessly: quantize x^T instead)"
        )
    return transpose_fp8(data_MK), scale_inv.t().contiguous()


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("quantize_fp8_blockwise", "cpp")
def _quantize_fp8_blockwise_cpp(args: QuantizeFp8BlockwiseArgs) -> None:
    _C.quantize_fp8_blockwise(
        *x_args(args.x_MK),
        args.block_rows,
        FP8_FORMAT_CODES[args.fp8_dtype],
        args.power_2_scales,
        *outputs(*quantize_buffers(args)),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_fp8_blockwise", "cpp")
def _dequantize_fp8_blockwise_cpp(args: DequantizeFp8BlockwiseArgs, out_2d: torch.Tensor) -> None:
    data_2d = args.data_2d
    R, C = data_2d.shape
    _C.dequantize_fp8_blockwise(
        data_2d.data_ptr(),
        FP8_FORMAT_CODES[data_2d.dtype],
        R,
        C,
        args.block_rows,
        args.scale_inv.data_ptr(),
        out_2d.data_ptr(),
        out_dtype_code(out_2d),
        torch.get_num_threads(),
    )
