"""Many tensors quantized into their existing buffers in one operator call (FusedAdam's requantize
of every block-format weight after a step): MXFP8 and blockwise FP8, each tensor's bytes those the
single-tensor quantize writes into the same buffers, bit for bit.

One operator per format, as for one tensor, so a call takes one format configuration (a weight
quantizer's); usages are per tensor (the buffers present), shapes, strides and input dtypes may
differ, the device may not. Kernels: the reference and C++ ones run the format's single-tensor
kernel on each tensor in turn (C++: one GIL-free call per tensor; its host time is small next to
a CPU quantize); the Triton one quantizes all of them in one launch per group of tensors sharing
its compile-time constants ([Note: multi-tensor block quantize] in `blocks._triton_many`).

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.quantize_mxfp8_many(xs, rowwise, columnwise, rowwise_data,
  rowwise_scale_inv, columnwise_data, columnwise_scale_inv)`: xs 2-D (M, K) views, fp32/bf16/fp16,
  any strides, empty ones allowed, on one device; `rowwise`, `columnwise` one bool per tensor
  (at least one True each); each buffer list holds the buffers of the tensors with that usage,
  in order, as [Note: block operators] lays them out for the tensor's (M, K). Lists of the
  present buffers rather than None entries: torch.compile's functionalization refuses None in a
  mutated `Tensor?[]` (torch 2.13).
- `torch.ops.quant_core.quantize_fp8_blockwise_many(xs, block_rows, fp8_dtype, power_2_scales,
  rowwise, columnwise, rowwise_data, ...)`: likewise, with `quantize_fp8_blockwise`'s format
  arguments.
Kernels take one list: the single-tensor quantize's arguments of each non-empty tensor (a usage
it does not have: None buffers). Every operator bumps the version counter of each buffer given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from quant_core._backends import Backend, cpp_extension
from quant_core._library import Kernel, backend_kernel, call, define_op, register_kernel
from quant_core.blocks._blockwise import BLOCKWISE_BLOCK, BLOCKWISE_SHAPES, QuantizeFp8BlockwiseArgs
from quant_core.blocks._layout import (
    QUANTIZE_BUFFERS,
    BlockQuantized,
    BlockShape,
    block_buffers,
    buffer_shapes,
    check_block_shape,
    check_quantize_input,
)
from quant_core.blocks._mxfp8 import MXFP8_BLOCK, QuantizeMxfp8Args
from quant_core.shared._checks import FLOAT_DTYPES, as_2d, check_fp8_dtype


def quantize_mxfp8_many(xs: Sequence[torch.Tensor], outs: Sequence[BlockQuantized]) -> None:
    """Refills outs[i] in place with the MXFP8 quantization of xs[i], for every i: the bytes
    `quantize_mxfp8(xs[i], out=outs[i])` writes with the usages outs[i] holds, in one kernel call.

    Args:
        xs: fp32/bf16/fp16 tensors of any shapes (at least one dim) and strides, on one device.
        outs: one BlockQuantized per tensor (a previous result of `quantize_mxfp8`), whose present
            buffers (rowwise and/or columnwise, data with its scales) are refilled.
    """
    _quantize_many(
        "quantize_mxfp8_many",
        xs,
        outs,
        (1, MXFP8_BLOCK),
        data_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.uint8,
        format_args=(),
        format_name="MXFP8",
    )


def quantize_fp8_blockwise_many(
    xs: Sequence[torch.Tensor],
    outs: Sequence[BlockQuantized],
    block_shape: BlockShape = (1, BLOCKWISE_BLOCK),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    power_2_scales: bool = True,
) -> None:
    """Refills outs[i] in place with the blockwise FP8 quantization of xs[i], for every i: the bytes
    `quantize_fp8_blockwise(xs[i], block_shape, fp8_dtype, power_2_scales=..., out=outs[i])` writes
    with the usages outs[i] holds, in one kernel call. xs and outs as in `quantize_mxfp8_many`; the
    format arguments as in `quantize_fp8_blockwise`, one configuration for every tensor."""
    block_shape = check_block_shape(block_shape, BLOCKWISE_SHAPES, "blockwise FP8")
    _quantize_many(
        "quantize_fp8_blockwise_many",
        xs,
        outs,
        block_shape,
        data_dtype=check_fp8_dtype(fp8_dtype),
        scale_dtype=torch.float32,
        format_args=(block_shape[0], fp8_dtype, power_2_scales),
        format_name="blockwise FP8",
    )


def _quantize_many(
    op: str,
    xs: Sequence[torch.Tensor],
    outs: Sequence[BlockQuantized],
    block_shape: BlockShape,
    *,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    format_args: tuple[object, ...],
    format_name: str,
) -> None:
    """Checks every (x, out) pair as the single-tensor quantize checks its own, then calls operator
    `op` once: op(xs as (M, K) views, *format_args, usages, the four lists of buffers present)."""
    if isinstance(xs, torch.Tensor) or isinstance(outs, BlockQuantized):
        raise TypeError(f"{op} takes a sequence of tensors and one of BlockQuantized outs; wrap a single pair in lists")
    if len(xs) != len(outs):
        raise ValueError(f"{op} got {len(xs)} tensors but {len(outs)} outs; pass one out (BlockQuantized) per tensor")
    if len(xs) == 0:
        return
    device = check_quantize_input(xs[0], format_name, "xs[0]").device
    layout = (block_shape, data_dtype, scale_dtype)
    x_MKs: list[torch.Tensor] = []
    usages: tuple[list[bool], list[bool]] = ([], [])
    buffer_lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        buffers = _fitting_buffers(x, out, device, *layout)
        if buffers is None:
            _explain_misfit(op, format_name, i, x, out, device, *layout)
        x_MKs.append(as_2d(x))
        usages[0].append(buffers[0] is not None)
        usages[1].append(buffers[2] is not None)
        for buffer_list, buffer in zip(buffer_lists, buffers, strict=True):
            if buffer is not None:
                buffer_list.append(buffer)
    call(op, x_MKs, *format_args, *usages, *buffer_lists)


def _fitting_buffers(
    x: object,
    out: object,
    device: torch.device,
    block_shape: BlockShape,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, ...] | None:
    """out's four buffers (rowwise data as its (M, K) view) where (x, out) is a pair the operator
    takes, else None (then `_explain_misfit` says why). The checks of the single-tensor quantize,
    on its fast path: a few comparisons per buffer."""
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(out, BlockQuantized)
        and x.dtype in FLOAT_DTYPES
        and x.dim() > 0
        and x.device == device
    ):
        return None
    buffers = (out.rowwise_data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv)
    if (buffers[0] is None) != (buffers[1] is None) or (buffers[2] is None) != (buffers[3] is None):
        return None
    if buffers[0] is None and buffers[2] is None:
        return None
    shapes = buffer_shapes(x.shape, block_shape, 1)
    for buffer, shape, dtype in zip(buffers, shapes, (data_dtype, scale_dtype, data_dtype, scale_dtype), strict=True):
        if buffer is not None and not (
            buffer.shape == shape and buffer.dtype == dtype and buffer.device == device and buffer.is_contiguous()
        ):
            return None
    return (None if buffers[0] is None else as_2d(buffers[0]), *buffers[1:])


def _explain_misfit(
    op: str,
    format_name: str,
    i: int,
    x: object,
    out: object,
    device: torch.device,
    block_shape: BlockShape,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
) -> NoReturn:
    """Raises the error that says what is wrong with pair i (x, out) and how to fix it."""
    if isinstance(x, torch.Tensor) and x.device != device:
        raise ValueError(
            f"xs[{i}] is on {x.device} but xs[0] is on {device}; {op} quantizes on one device per call: call it "
            "once per device"
        )
    check_quantize_input(x, format_name, f"xs[{i}]")
    rowwise, columnwise = _usages_of(out, f"outs[{i}]")
    block_buffers(
        x,
        block_shape,
        rowwise=rowwise,
        columnwise=columnwise,
        data_dtype=data_dtype,
        scale_dtype=scale_dtype,
        codes_per_byte=1,
        out=out,
        out_name=f"outs[{i}]",
    )
    raise AssertionError(f"{op}: pair {i} failed the fast checks but passed the detailed ones")


def _usages_of(out: object, name: str) -> tuple[bool, bool]:
    """(rowwise, columnwise): the usages a refill of `out` writes, those whose data and scales it holds."""
    if not isinstance(out, BlockQuantized):
        raise TypeError(f"{name} must be a BlockQuantized (a previous quantize's result), got {type(out).__name__}")
    usages = []
    for usage in ("rowwise", "columnwise"):
        data, scales = getattr(out, f"{usage}_data"), getattr(out, f"{usage}_scale_inv")
        if (data is None) != (scales is None):
            raise ValueError(
                f"{name} holds {usage}_data or {usage}_scale_inv but not both; a refill writes the data with its "
                "scales: pass both buffers, or neither"
            )
        usages.append(data is not None)
    if not any(usages):
        raise ValueError(f"{name} holds no usage (no rowwise nor columnwise data) to refill")
    return usages[0], usages[1]


class QuantizeMxfp8ManyArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_mxfp8_many` ([Note: operator arguments])."""

    xs: list[torch.Tensor]
    rowwise: list[bool]
    columnwise: list[bool]
    rowwise_data: list[torch.Tensor]
    rowwise_scale_inv: list[torch.Tensor]
    columnwise_data: list[torch.Tensor]
    columnwise_scale_inv: list[torch.Tensor]


class QuantizeFp8BlockwiseManyArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_fp8_blockwise_many` ([Note: operator arguments])."""

    xs: list[torch.Tensor]
    block_rows: int
    fp8_dtype: torch.dtype
    power_2_scales: bool
    rowwise: list[bool]
    columnwise: list[bool]
    rowwise_data: list[torch.Tensor]
    rowwise_scale_inv: list[torch.Tensor]
    columnwise_data: list[torch.Tensor]
    columnwise_scale_inv: list[torch.Tensor]


@define_op("quantize_mxfp8_many", QuantizeMxfp8ManyArgs, mutates_args=QUANTIZE_BUFFERS)
def _quantize_mxfp8_many_op(kernel: Kernel, args: QuantizeMxfp8ManyArgs) -> None:
    tensors = _each_tensor(args, lambda x_MK, buffers: QuantizeMxfp8Args(x_MK, *buffers))
    if tensors:
        kernel(tensors)


@define_op("quantize_fp8_blockwise_many", QuantizeFp8BlockwiseManyArgs, mutates_args=QUANTIZE_BUFFERS)
def _quantize_fp8_blockwise_many_op(kernel: Kernel, args: QuantizeFp8BlockwiseManyArgs) -> None:
    block_format = (args.block_rows, args.fp8_dtype, args.power_2_scales)
    tensors = _each_tensor(args, lambda x_MK, buffers: QuantizeFp8BlockwiseArgs(x_MK, *block_format, *buffers))
    if tensors:
        kernel(tensors)


def _each_tensor(args: Any, single: Callable[[torch.Tensor, tuple[torch.Tensor | None, ...]], Any]) -> list[Any]:
    """The single-tensor quantize's arguments of each non-empty tensor of a multi-tensor quantize's
    `args` (an empty tensor's buffers are empty too): single(x_MK, its four buffers, None for a
    usage it does not have)."""
    lists = [iter(getattr(args, name)) for name in QUANTIZE_BUFFERS]
    tensors = []
    for x_MK, rowwise, columnwise in zip(args.xs, args.rowwise, args.columnwise, strict=True):
        rowwise_buffers = (next(lists[0]), next(lists[1])) if rowwise else (None, None)
        columnwise_buffers = (next(lists[2]), next(lists[3])) if columnwise else (None, None)
        if x_MK.numel() > 0:
            tensors.append(single(x_MK, rowwise_buffers + columnwise_buffers))
    return tensors


def each_tensor(op: str, backend: Backend) -> Callable[[Sequence[Any]], None]:
    """A multi-tensor kernel that runs `backend`'s kernel of the single-tensor quantize `op` on each
    tensor's arguments in turn (the reference and C++ kernels of the operators above)."""
    single = backend_kernel(op, backend)

    def run(tensors: Sequence[Any]) -> None:
        for args in tensors:
            single(args)

    return run


register_kernel("quantize_mxfp8_many", "reference")(each_tensor("quantize_mxfp8", "reference"))
register_kernel("quantize_fp8_blockwise_many", "reference")(each_tensor("quantize_fp8_blockwise", "reference"))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


# One GIL-free call per tensor: a CPU quantize's host time is small next to its work. Without the
# extension (a broken build) the single-tensor ops have no C++ kernel to loop over.
if cpp_extension() is not None:
    register_kernel("quantize_mxfp8_many", "cpp")(each_tensor("quantize_mxfp8", "cpp"))
    register_kernel("quantize_fp8_blockwise_many", "cpp")(each_tensor("quantize_fp8_blockwise", "cpp"))
