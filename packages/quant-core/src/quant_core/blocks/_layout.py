"""What every block-scaled format (MXFP8, blockwise FP8, NVFP4) shares: layouts, checks, dispatch.

[Note: block layouts] A tensor x is viewed as (M, K): M = product of the leading dims, K = last.
- Rowwise data holds x's codes in x's shape (NVFP4: two codes per byte, so the last dim is K/2).
  Rowwise scales are 2-D: (M, ceil(K/b)) for 1 x b blocks, (ceil(M/b), ceil(K/b)) for b x b tiles.
- Columnwise data is always 2-D and holds x^T: for 1 x b blocks it is the rowwise quantization
  of x^T (blocks run along M; different numbers from rowwise), for b x b tiles it is the exact
  transpose of the rowwise codes and scales. Shapes (K, M) (NVFP4: (K, M/2)); scales
  (K, ceil(M/b)) or (ceil(K/b), ceil(M/b)).
- Every scale stored is a dequantization multiplier (`*_scale_inv`): E8M0 bytes for MXFP8, fp32
  for blockwise FP8, E4M3 for NVFP4 (times 1/S, S = the tensor scale from `amax`).
- Nothing is padded: edge blocks may be partial. An FSDP2 shard along dim 0 concatenates rowwise
  data and scales along dim 0 (when its rows fall on block boundaries) and columnwise data and
  scales along dim 1.

[Note: block operators] Every block format has two operators ([Note: custom ops]) with one
contract (format-specific arguments in the format's module docstring):
- `quantize_<format>(x_MK, *format args, rowwise_data, rowwise_scale_inv, columnwise_data,
  columnwise_scale_inv) -> ()`: x_MK 2-D fp32/bf16/fp16, any strides; each buffer None (usage
  not wanted) or contiguous with the shape and dtype of [Note: block layouts] for an (M, K)
  input (rowwise data as (M, K / codes per byte)). Fills the buffers given. Its body is
  `quantize_body`; kernels take the arguments tuple ([Note: operator arguments] in
  quant_core._library), non-empty x only.
- `dequantize_<format>(data_2d, scale_inv, *format args, dtype) -> Tensor`: data_2d 2-D codes of
  either usage (R, C / codes per byte), scale_inv (ceil(R / block rows), ceil(C / block cols)) of
  the format's scale dtype on data's device, any strides; dtype fp32/bf16/fp16. Returns the
  contiguous (R, C) values. Its body is `dequantize_body`; kernels take (the arguments with
  data_2d and scale_inv contiguous, the output).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quant_core._library import Kernel, call, with_contiguous
from quant_core.shared._checks import as_2d, check_float_input, check_output_dtype, output_buffer, with_shape
from quant_core.shared._numerics import encode_fp8, finite_abs

# (rows, cols) of a 2-D block, e.g. (1, 32) or (128, 128).
BlockShape = tuple[int, int]


@dataclass(frozen=True)
class BlockQuantized:
    """A block-scaled quantization of a tensor; see [Note: block layouts] in quant_core.blocks._layout."""

    rowwise_data: torch.Tensor | None
    """Codes of x in x's shape (NVFP4: uint8, last dim K/2), or None if rowwise was not asked for."""
    rowwise_scale_inv: torch.Tensor | None
    """Per-block dequantization multipliers of the rowwise data (2-D)."""
    columnwise_data: torch.Tensor | None
    """Codes of x^T, shape (K, M) (NVFP4: (K, M/2)), or None if columnwise was not asked for."""
    columnwise_scale_inv: torch.Tensor | None
    """Per-block dequantization multipliers of the columnwise data (2-D)."""
    amax: torch.Tensor | None = None
    """NVFP4 only: the global amax (fp32 0-d) the tensor scale comes from."""
    columnwise_amax: torch.Tensor | None = None
    """NVFP4 with the random Hadamard transform only: amax(T(x^T)) (fp32 0-d), the columnwise
    usage's own tensor scale's amax ([Note: NVFP4 random Hadamard transform] in quant_core.nvfp4._nvfp4)."""


def num_blocks(size: int, block: int) -> int:
    return -(-size // block)


def scale_shape(rows: int, cols: int, block_shape: BlockShape) -> tuple[int, int]:
    """Shape of the scales of a (rows, cols) operand quantized in `block_shape` blocks."""
    return num_blocks(rows, block_shape[0]), num_blocks(cols, block_shape[1])


def check_block_shape(block_shape: object, allowed: tuple[BlockShape, ...], format_name: str) -> BlockShape:
    if tuple(block_shape) not in allowed:
        raise ValueError(f"{format_name} block_shape must be one of {allowed}, got {block_shape}")
    return tuple(block_shape)  # type: ignore[return-value]


def check_quantize_input(x: torch.Tensor, format_name: str, name: str = "x") -> torch.Tensor:
    """Checks x (called `name` in errors) for a block quantizer: fp32/bf16/fp16 with at least one dim."""
    check_float_input(x, name)
    if x.dim() == 0:
        raise ValueError(f"{name} is 0-d; {format_name} needs a last dim to lay blocks along (reshape it to (1,))")
    return x


def quantize_blocks(
    op: str,
    x: torch.Tensor,
    block_shape: BlockShape,
    *,
    rowwise: bool,
    columnwise: bool,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    codes_per_byte: int,
    format_args: tuple[object, ...],
    amax: torch.Tensor | None = None,
    out: BlockQuantized | None = None,
) -> BlockQuantized:
    """Allocates (or checks `out`'s) buffers and calls operator `op`: the body of every block quantize.

    The operator is called as op(x_MK, *format_args, rowwise_data_MK, rowwise_scale_inv,
    columnwise_data, columnwise_scale_inv), each buffer None when its usage is not asked for
    ([Note: block operators]).
    """
    if not (rowwise or columnwise):
        raise ValueError("ask for at least one usage: rowwise=True and/or columnwise=True")
    buffers = block_buffers(
        x,
        block_shape,
        rowwise=rowwise,
        columnwise=columnwise,
        data_dtype=data_dtype,
        scale_dtype=scale_dtype,
        codes_per_byte=codes_per_byte,
        out=out,
    )
    rowwise_data, rowwise_scale, columnwise_data, columnwise_scale = buffers
    rowwise_MK = None if rowwise_data is None else as_2d(rowwise_data)
    call(op, as_2d(x), *format_args, rowwise_MK, rowwise_scale, columnwise_data, columnwise_scale)
    return BlockQuantized(*buffers, amax)


def block_buffers(
    x: torch.Tensor,
    block_shape: BlockShape,
    *,
    rowwise: bool,
    columnwise: bool,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    codes_per_byte: int,
    out: BlockQuantized | None,
    out_name: str = "out",
) -> tuple[torch.Tensor | None, ...]:
    """(rowwise data, rowwise scales, columnwise data, columnwise scales) of quantizing x, None
    for a usage not asked for: `out`'s buffers after checking them ([Note: block layouts]), or
    new ones where `out` is None or holds none. `out_name` names `out` in errors."""
    shapes = buffer_shapes(x.shape, block_shape, codes_per_byte)
    device = x.device

    def get(k: int, dtype: torch.dtype) -> torch.Tensor:
        name = QUANTIZE_BUFFERS[k]
        return output_buffer(
            None if out is None else getattr(out, name), f"{out_name}.{name}", shapes[k], dtype, device
        )

    rowwise_data = rowwise_scale = columnwise_data = columnwise_scale = None
    if rowwise:
        rowwise_data, rowwise_scale = get(0, data_dtype), get(1, scale_dtype)
    if columnwise:
        columnwise_data, columnwise_scale = get(2, data_dtype), get(3, scale_dtype)
    return rowwise_data, rowwise_scale, columnwise_data, columnwise_scale


# The buffers a block quantize fills, the last four arguments of every one ([Note: block operators]).
QUANTIZE_BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def buffer_shapes(shape: tuple[int, ...], block_shape: BlockShape, codes_per_byte: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of (rowwise data, rowwise scales, columnwise data, columnwise scales) of a tensor
    of `shape` ([Note: block layouts]). On every quantize's host path: plain int arithmetic."""
    K = shape[-1]
    M = shape[0] if len(shape) == 2 else math.prod(shape[:-1])
    rows, cols = block_shape
    # Columnwise scales: of x^T in the transposed tiles, or in 1 x b blocks along M.
    columnwise_scales = (-(-K // cols), -(-M // rows)) if rows > 1 else (K, -(-M // cols))
    return (
        (*shape[:-1], K // codes_per_byte),
        (-(-M // rows), -(-K // cols)),
        (K, M // codes_per_byte),
        columnwise_scales,
    )


def quantize_buffers(
    args: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(rowwise data, rowwise scales, columnwise data, columnwise scales) of a block quantize's arguments."""
    return args.rowwise_data, args.rowwise_scale_inv, args.columnwise_data, args.columnwise_scale_inv


def quantize_body(kernel: Kernel, args: Any) -> None:
    """The body of every block quantize operator: the kernel on the arguments unless x is empty."""
    if args.x_MK.numel() > 0:
        kernel(args)


def dequantize_body(codes_per_byte: int) -> Callable[[Kernel, Any], torch.Tensor]:
    """The body of a block dequantize operator: kernel(args with contiguous data_2d and scale_inv,
    out_2d), out_2d the new contiguous (R, C) output of args.dtype."""

    def body(kernel: Kernel, args: Any) -> torch.Tensor:
        data_2d = args.data_2d
        out_2d = torch.empty(
            (data_2d.shape[0], data_2d.shape[1] * codes_per_byte), dtype=args.dtype, device=data_2d.device
        )
        if out_2d.numel() > 0:
            contiguous = data_2d.is_contiguous() and args.scale_inv.is_contiguous()  # the usual case: no call
            kernel(args if contiguous else with_contiguous(args, "data_2d", "scale_inv"), out_2d)
        return out_2d

    return body


# [Note: dequantizing two operands] The emulated GEMMs on CUDA ([Note: exact bf16 operands] in
# quant_tensors.ops) dequantize both operands of every GEMM to bf16 before cuBLAS runs. Each public
# call costs tens of us of host time on an H100 VM (checks, operator, allocation, Triton launch),
# more than the GPU time of dequantizing a small weight, so the two-operand operators
# (`dequantize_mxfp8_pair`, `dequantize_nvfp4_pair`) take both operands in one call and, on CUDA,
# one launch: the grid's first programs dequantize A's tiles, the rest B's, each through the same
# tile code as the single-operand kernel (bit for bit the same values). Operator arguments: (a_data_2d,
# a_scale_inv, b_data_2d, b_scale_inv, *A's format args, *B's format args, dtype) -> (a_out, b_out);
# their tuple's `operands()` gives each operand's arguments of the single-operand operator.
_PAIR_OPERANDS = ("a_data_2d", "a_scale_inv", "b_data_2d", "b_scale_inv")


def dequantize_pair_body(codes_per_byte: int) -> Callable[[Kernel, Any], tuple[torch.Tensor, torch.Tensor]]:
    """The body of a two-operand dequantize operator ([Note: dequantizing two operands]):
    kernel(args with the four operands contiguous, a_out_2d, b_out_2d)."""

    def body(kernel: Kernel, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a_data, b_data = args.a_data_2d, args.b_data_2d  # the outputs spelled out: no generator on the host path
        a_out = torch.empty((a_data.shape[0], a_data.shape[1] * codes_per_byte), dtype=args.dtype, device=a_data.device)
        b_out = torch.empty((b_data.shape[0], b_data.shape[1] * codes_per_byte), dtype=args.dtype, device=b_data.device)
        if a_out.numel() > 0 or b_out.numel() > 0:
            contiguous = (
                a_data.is_contiguous()
                and b_data.is_contiguous()
                and args.a_scale_inv.is_contiguous()
                and args.b_scale_inv.is_contiguous()
            )
            kernel(args if contiguous else with_contiguous(args, *_PAIR_OPERANDS), a_out, b_out)
        return a_out, b_out

    return body


def pair_of(single: Callable[..., None]) -> Callable[..., None]:
    """A two-operand dequantize kernel that runs a single-operand kernel of the same backend on
    each operand holding elements (backends without a two-operand kernel: C++, reference)."""

    def run(args: Any, a_out: torch.Tensor, b_out: torch.Tensor) -> None:
        for operand, out in zip(args.operands(), (a_out, b_out), strict=True):
            if out.numel() > 0:
                single(operand, out)

    return run


def dequantize_fake(codes_per_byte: int) -> Callable[[Any], torch.Tensor]:
    """The fake of a block dequantize operator (output metadata for torch.compile)."""

    def fake(args: Any) -> torch.Tensor:
        data_2d = args.data_2d
        return data_2d.new_empty((data_2d.shape[0], data_2d.shape[1] * codes_per_byte), dtype=args.dtype)

    return fake


def dequantize_pair_fake(codes_per_byte: int) -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    """The fake of a two-operand dequantize operator."""

    def fake(args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a_out, b_out = (
            d.new_empty((d.shape[0], d.shape[1] * codes_per_byte), dtype=args.dtype)
            for d in (args.a_data_2d, args.b_data_2d)
        )
        return a_out, b_out

    return fake


# ---- reference building blocks ----------------------------------------------------------------


def block_amax(x_MK: torch.Tensor, block_shape: BlockShape) -> torch.Tensor:
    """Max |x| over the finite elements of each block: (ceil(M/br), ceil(K/bc)) fp32.

    Edge blocks are padded with zeros, which never change a max of magnitudes.
    """
    rows, cols = block_shape
    M, K = x_MK.shape
    Mb, Kb = scale_shape(M, K, block_shape)
    magnitude = torch.nn.functional.pad(finite_abs(x_MK), (0, Kb * cols - K, 0, Mb * rows - M))
    return magnitude.reshape(Mb, rows, Kb, cols).amax(dim=(1, 3))


def expand_blocks(per_block: torch.Tensor, block_shape: BlockShape, M: int, K: int) -> torch.Tensor:
    """Repeats one value per block over the block's elements, cropped to (M, K)."""
    rows, cols = block_shape
    return per_block.repeat_interleave(rows, dim=0)[:M].repeat_interleave(cols, dim=1)[:, :K]


# rowwise_fn(x_MK as fp32, index_offset) -> (codes of x_MK, 2-D scale_inv); index_offset is where
# the element counter of x_MK starts (stochastic rounding, [Note: counter RNG]).
RowwiseReference = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


# ---- fused kernels' building blocks ([Note: kernels Inductor fuses] in quant_core._library) ----

# scale_rule(block amaxes) -> (what each block's elements are multiplied by before encoding, the
# block scales as stored), the format's rule as its reference applies it.
ScaleRule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def tiles(rows: int, cols: int, block_shape: BlockShape) -> bool:
    """Whether blocks of block_shape tile a (rows, cols) operand (no partial edge block)."""
    return rows % block_shape[0] == 0 and cols % block_shape[1] == 0


def quantize_tiled(
    x_MK: torch.Tensor, block_shape: BlockShape, scale_rule: ScaleRule, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in x's layout, (M / br, K / bc) stored scales) of fp32 x_MK in br x bc blocks that
    tile it (`tiles`): the reference's arithmetic, with each block's rows and columns dims of
    their own instead of divisions of x's indices, so that Inductor can fuse it with the kernel
    producing x. (b, 1) blocks are those of x^T's 1 x b rowwise usage, reduced across x's rows so
    that x is read along its contiguous dim."""
    M, K = x_MK.shape
    rows, cols = block_shape
    blocks = x_MK.reshape(M // rows, rows, K // cols, cols)
    multiplier, stored = scale_rule(finite_abs(blocks).amax(dim=(1, 3)))
    codes = encode_fp8(blocks * multiplier[:, None, :, None], fp8_dtype)
    return codes.reshape(M, K), stored


def fill_fused_quantize(
    args: Any,
    x_MK: torch.Tensor,
    block_shape: BlockShape,
    scale_rule: ScaleRule,
    fp8_dtype: torch.dtype,
    rowwise_reference: RowwiseReference,
) -> None:
    """A block-format fused quantize kernel's work: the buffers of `args` (a quantize operator's
    arguments) from fp32 x_MK, each usage by `quantize_tiled` where its blocks tile x and by the
    format's `rowwise_reference` (of x, or of x^T for the columnwise usage) where they do not; a b x b
    tiling's columnwise usage is its rowwise one transposed, as in `quantize_blocks_reference`."""
    M, K = x_MK.shape
    two_d = block_shape[0] > 1
    rowwise = None
    if args.rowwise_data is not None or (two_d and args.columnwise_data is not None):
        if tiles(M, K, block_shape):
            rowwise = quantize_tiled(x_MK, block_shape, scale_rule, fp8_dtype)
        else:
            rowwise = rowwise_reference(x_MK, 0)
        if args.rowwise_data is not None:
            args.rowwise_data.copy_(rowwise[0].reshape(args.rowwise_data.shape))
            args.rowwise_scale_inv.copy_(rowwise[1])
    if args.columnwise_data is not None:
        if two_d:
            codes, scales = rowwise[0].t(), rowwise[1].t()
        elif tiles(M, K, block_shape[::-1]):  # blocks along M: x^T's rowwise blocks
            codes, scales = quantize_tiled(x_MK, block_shape[::-1], scale_rule, fp8_dtype)
            codes, scales = codes.t(), scales.t()
        else:
            codes, scales = rowwise_reference(x_MK.t(), M * K)
        args.columnwise_data.copy_(codes)
        args.columnwise_scale_inv.copy_(scales)


def quantize_blocks_reference(
    x: torch.Tensor,
    block_shape: BlockShape,
    rowwise_fn: RowwiseReference,
    *,
    rowwise: bool,
    columnwise: bool,
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
    amax: torch.Tensor | None = None,
    columnwise_fn: RowwiseReference | None = None,
) -> BlockQuantized:
    """The reference of every block format, given the format's rowwise quantization of a 2-D tensor.

    Columnwise is rowwise_fn (or `columnwise_fn` where given: NVFP4's transformed columnwise usage)
    applied to x^T for 1 x b blocks (its element counter continuing after x's M*K elements), and
    the exact transpose of the rowwise result for b x b tiles.
    """
    x_MK = as_2d(x).float()
    M, K = x_MK.shape
    pack = pack or (lambda codes: codes)
    codes, scale_inv = rowwise_fn(x_MK, 0)
    packed = pack(codes)
    rowwise_data = packed.reshape(*x.shape[:-1], packed.shape[1]) if rowwise else None
    rowwise_scale = scale_inv if rowwise else None
    columnwise_data = columnwise_scale = None
    if columnwise:
        if block_shape[0] > 1:
            columnwise_codes, columnwise_scale = codes.t().contiguous(), scale_inv.t().contiguous()
        else:
            columnwise_codes, columnwise_scale = (columnwise_fn or rowwise_fn)(x_MK.t(), M * K)
        columnwise_data = pack(columnwise_codes)
    return BlockQuantized(rowwise_data, rowwise_scale, columnwise_data, columnwise_scale, amax)


def element_index(shape: tuple[int, int], offset: int, device: torch.device) -> torch.Tensor:
    """Row-major element counter of a 2-D operand, starting at `offset` (int64)."""
    return torch.arange(offset, offset + math.prod(shape), dtype=torch.int64, device=device).reshape(shape)


def copy_into(result: BlockQuantized, *buffers: torch.Tensor | None) -> None:
    """Writes a reference result into a kernel's output buffers (the reference kernels' tail)."""
    fields = (result.rowwise_data, result.rowwise_scale_inv, result.columnwise_data, result.columnwise_scale_inv)
    for buffer, value in zip(buffers, fields, strict=True):
        if buffer is not None:
            buffer.copy_(value.reshape(buffer.shape).view(buffer.dtype))


def dequantize_blocks(
    op: str,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    *,
    block_shape: BlockShape,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    codes_per_byte: int,
    format_args: tuple[object, ...],
    format_name: str,
) -> torch.Tensor:
    """Checks a (data, scale_inv) pair of either usage and calls dequantize operator `op`.

    The operator is called as op(data_2d, scale_inv, *format_args, dtype) (its kernel gets them
    with contiguous 2-D operands, `dequantize_body`); columnwise data is x^T's rowwise layout, so
    one kernel serves both usages.
    """
    check_output_dtype(dtype)
    format_ = (data_dtype, scale_dtype, codes_per_byte, format_name)
    data_2d = checked_dequantize_operand(data, scale_inv, block_shape, *format_)
    out_2d = call(op, data_2d, scale_inv, *format_args, dtype)
    return with_shape(out_2d, (*data.shape[:-1], out_2d.shape[1]))


def checked_dequantize_operand(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_shape: BlockShape,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    codes_per_byte: int,
    format_name: str,
) -> torch.Tensor:
    """The (R, C / codes per byte) view of `data` after checking it and its scales' dtype, shape and device."""
    if not isinstance(data, torch.Tensor) or data.dtype != data_dtype or data.dim() == 0:
        got = f"{data.dtype} of shape {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{format_name} data must be a {data_dtype} tensor with at least one dim, got {got}")
    data_2d = as_2d(data)
    R, C = data_2d.shape[0], data_2d.shape[1] * codes_per_byte
    expected = scale_shape(R, C, block_shape)
    if scale_inv.dtype != scale_dtype or tuple(scale_inv.shape) != expected or scale_inv.device != data.device:
        raise ValueError(
            f"{format_name} scale_inv for data of shape {tuple(data.shape)} in {block_shape} blocks must be a "
            f"{scale_dtype} tensor of shape {expected} on {data.device}, got {scale_inv.dtype} of shape "
            f"{tuple(scale_inv.shape)} on {scale_inv.device}"
        )
    return data_2d


def check_pair_device(a_data: torch.Tensor, b_data: torch.Tensor) -> None:
    """The two operands of a two-operand dequantize ([Note: dequantizing two operands]) share a device."""
    if a_data.device != b_data.device:
        raise ValueError(f"the two operands are on {a_data.device} and {b_data.device}; dequantize them on one device")
