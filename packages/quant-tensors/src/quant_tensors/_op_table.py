"""The op table of QuantizedTensor: what FSDP2, DTensor, DCP and optimizers call, for every format.

Formats supply the layout-specific pieces (`_slice_rows`, `_row_alignment`, `_zeros_like_buffers`,
`dequantize`, their quantizer's `quantize_`); everything here is written once over the declared
buffers. Shapes: only the leading dims may change in a view (the (M, K) layout stays), and only
dim 0 may be split or sliced, on the format's block boundaries.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from quant_tensors._tensor import QuantizedTensor, flat_view

aten = torch.ops.aten
implements = QuantizedTensor.implements

_DATA_NAMES = ("rowwise_data", "columnwise_data")


def _rows_per_dim0(t: QuantizedTensor) -> int:
    """Rows of the (M, K) view per index of dim 0 (1 for a 2-D tensor)."""
    return math.prod(t.shape[1:-1]) if t.dim() > 1 else 1


@implements(aten.detach.default, aten.alias.default)
def _alias(func, args, kwargs):
    return args[0]._rebuilt()


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._rebuilt(fn=lambda t: t.clone())


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t: QuantizedTensor = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ValueError(
            f"{type(t).__name__} has a high-precision nominal dtype; cannot convert it to {dtype} (dequantize first)"
        )
    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    # aten._to_copy never aliases its input: every buffer is copied, moved or not.
    moved = t._rebuilt(dtype=dtype, fn=lambda b: b.to(device or b.device, non_blocking=non_blocking, copy=True))
    if kwargs.get("pin_memory"):
        moved = moved._rebuilt(fn=lambda b: b.pin_memory())
    return moved


def _leading_shape_change(t: QuantizedTensor, shape: list[int]) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = t.numel() // known if known else 0
    if math.prod(shape) != t.numel() or (t.dim() > 0 and (not shape or shape[-1] != t.shape[-1])):
        raise NotImplementedError(
            f"{type(t).__name__} can only be viewed with its last dim kept ({tuple(t.shape)} -> {tuple(shape)}): "
            "its blocks and columnwise layout follow the (M, K) view. Dequantize first for other shapes."
        )
    return shape


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    t: QuantizedTensor = args[0]
    if t.dim() > 1 and list(args[1]) in ([-1], [t.numel()]):
        return flat_view(t)  # FSDP2's bookkeeping view ([Note: flat view] in quant_tensors._tensor)
    shape = _leading_shape_change(t, args[1])
    reshape_rowwise = lambda b: b.reshape(*shape[:-1], b.shape[-1])  # noqa: E731
    changes = {
        name: reshape_rowwise(getattr(t, name))
        for name in t._buffer_names
        if name == "rowwise_data" and getattr(t, name) is not None
    }
    return t._rebuilt(shape=shape, **changes)


def _check_dim0(t: QuantizedTensor, dim: int, op: str) -> None:
    if dim not in (0, -t.dim()):
        raise NotImplementedError(f"{op} of {type(t).__name__} is supported along dim 0 only, got dim={dim}")


def _rows_slice(t: QuantizedTensor, start: int, stop: int, op: str) -> QuantizedTensor:
    """Rows [start, stop) of dim 0 as a QuantizedTensor sharing t's buffers where layouts allow."""
    per_index = _rows_per_dim0(t)
    row_start, row_stop = start * per_index, stop * per_index
    alignment = t._row_alignment()
    M = t.numel() // t.shape[-1] if t.dim() and t.shape[-1] else 0
    for boundary in (row_start, row_stop):
        if boundary % alignment and boundary != M:
            raise ValueError(
                f"{op} of {type(t).__name__} at dim-0 index {boundary // per_index} (row {boundary} of the "
                f"(M, K) view) is not on a {alignment}-row block boundary; the shard would split blocks. "
                f"Use sizes that are multiples of {alignment // math.gcd(alignment, per_index)} along dim 0, "
                "or take the high-precision fallback (dequantize, split, quantize)."
            )
    shape = (stop - start, *t.shape[1:])
    buffers = t._slice_rows(row_start, row_stop)
    if buffers.get("rowwise_data") is not None:  # formats slice the (M, K) view; restore the leading dims
        buffers["rowwise_data"] = buffers["rowwise_data"].reshape(*shape[:-1], buffers["rowwise_data"].shape[-1])
    return t._rebuilt(shape=shape, **buffers)


@implements(aten.split.Tensor)
def _split(func, args, kwargs):
    t, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _check_dim0(t, dim, "split")
    starts = range(0, t.shape[0], split_size) if t.shape[0] else [0]
    return [_rows_slice(t, s, min(s + split_size, t.shape[0]), "split") for s in starts]


@implements(aten.split_with_sizes.default)
def _split_with_sizes(func, args, kwargs):
    t, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    _check_dim0(t, dim, "split")
    offsets = [0, *itertools.accumulate(sizes)]
    return [_rows_slice(t, a, b, "split") for a, b in itertools.pairwise(offsets)]


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    t: QuantizedTensor = args[0]
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
    size = t.shape[dim]
    start = 0 if start is None else (max(start + size, 0) if start < 0 else min(start, size))
    end = size if end is None else (max(end + size, 0) if end < 0 else min(end, size))
    end = max(end, start)  # a reversed range is empty, as for plain tensors
    if step != 1:
        raise NotImplementedError(f"slice of {type(t).__name__} with step {step}: only contiguous slices are supported")
    if (start, end) == (0, size):
        return t._rebuilt()
    _check_dim0(t, dim, "slice")
    return _rows_slice(t, start, end, "slice")


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    t: QuantizedTensor = args[0]
    size, stride = list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0) or 0
    if size == list(t.shape) and stride == list(t.stride()) and offset == 0:
        return t._rebuilt()
    raise NotImplementedError(
        f"as_strided of {type(t).__name__} is supported in its no-op form only (same size and strides, offset 0)"
    )


def _zeros(t: QuantizedTensor, shape: list[int], kwargs: dict[str, Any]) -> QuantizedTensor:
    dtype = kwargs.get("dtype") or t.dtype
    device = kwargs.get("device")
    return t._rebuilt(
        shape=shape, dtype=dtype, **t._zeros_like_buffers(shape, None if device is None else torch.device(device))
    )


@implements(aten.new_zeros.default, aten.new_empty.default)
def _new_zeros(func, args, kwargs):
    return _zeros(args[0], list(args[1]), kwargs)


@implements(aten.empty_like.default, aten.zeros_like.default)
def _empty_like(func, args, kwargs):
    return _zeros(args[0], list(args[0].shape), kwargs)


@implements(aten.zero_.default)
def _zero_(func, args, kwargs):
    t: QuantizedTensor = args[0]
    for name in _DATA_NAMES:
        buffer = getattr(t, name, None)
        if buffer is not None:
            buffer.view(torch.uint8).zero_()  # code 0 is +0 in every format
    return t


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedTensor) and isinstance(src, QuantizedTensor):
        _copy_quantized(dst, src)
    elif isinstance(dst, QuantizedTensor):
        if dst.quantizer is None:
            raise ValueError(f"copy_ into a {type(dst).__name__} without a quantizer cannot requantize; attach one")
        dst.quantizer.quantize_(src, dst)
    else:
        dst.copy_(src.dequantize(dst.dtype))
    return dst


def _copy_quantized(dst: QuantizedTensor, src: QuantizedTensor) -> None:
    """Raw copy of buffers between tensors of one format (no requantization)."""
    if type(dst) is not type(src) or dst.shape != src.shape:
        raise ValueError(
            f"copy_ from {type(src).__name__}{tuple(src.shape)} into {type(dst).__name__}{tuple(dst.shape)}: raw "
            "copies need the same format and shape; dequantize the source to requantize it instead"
        )
    for name in dst._metadata_names:
        if name != "quantizer" and getattr(dst, name) != getattr(src, name):
            raise ValueError(
                f"copy_ between {type(dst).__name__}s with different {name}: {getattr(src, name)} -> {getattr(dst, name)}"
            )
    mismatched = [
        n
        for n, b in dst.buffers().items()
        if b is not None and getattr(src, n) is not None and b.dtype != getattr(src, n).dtype
    ]
    if mismatched:
        raise ValueError(
            f"copy_ between {type(dst).__name__}s with different code formats in {mismatched} "
            f"({getattr(src, mismatched[0]).dtype} -> {dst.buffers()[mismatched[0]].dtype}): dequantize the source to requantize it"
        )
    missing = [n for n, b in dst.buffers().items() if b is not None and getattr(src, n) is None]
    if missing:
        raise ValueError(f"copy_ source lacks {missing} that the destination holds; call src.update_usage(...) first")
    for name, buffer in dst.buffers().items():
        if buffer is not None:
            buffer.copy_(getattr(src, name))


@implements(aten.record_stream.default)
def _record_stream(func, args, kwargs):
    for buffer in args[0].buffers().values():
        if buffer is not None:
            buffer.record_stream(args[1])


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return all(b.is_pinned() for b in args[0].buffers().values() if b is not None)


@implements(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return args[0]._rebuilt(fn=lambda b: b.pin_memory())
