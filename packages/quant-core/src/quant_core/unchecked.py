"""Unchecked entry points for callers below their own public boundary (quant-tensors' hot path).

[Note: unchecked entries] Each function runs the operator of the same name ([Note: custom ops] in
quant_core._library) without the public function's argument checks: the caller guarantees the
operator's contract (in its format module's docstring; an operator called outside it may write
out of bounds). They run the operator as the public functions do ([Note: eager operator calls]),
so results are bitwise the same. All but the last two below are made from their operator's
arguments tuple ([Note: operator arguments]), so none repeats a parameter list:
- operators that return their outputs (amax, the dequantizes, the transposes, ...): `f(*arguments)`,
  the tuple's fields in order, 2-D operands as the operator takes them;
- operators that fill buffers (the block quantizes, `cast_to_fp8`): `f(x, *other arguments,
  rowwise=..., columnwise=...)`, x of any dims (read as its (M, K) view); the entry allocates the
  tuple's buffer fields of the usages asked for ([Note: block layouts] in quant_core.blocks._layout;
  per-tensor FP8: (M, K) and (K, M) codes), runs the operator and returns them in field order,
  rowwise data in x's shape;
- `quantize_fp8` and `quantize_fp8_delayed` are the bodies the public functions share
  (quant_core.fp8._quantize): they also fill a given scale and amax.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from quant_core._library import OPERATORS, call
from quant_core.blocks import _blockwise, _mxfp8
from quant_core.blocks._layout import QUANTIZE_BUFFERS
from quant_core.fp8 import _fp8, _quantize
from quant_core.fp8._quantize import quantize_fp8_delayed_unchecked as quantize_fp8_delayed
from quant_core.fp8._quantize import quantize_fp8_unchecked as quantize_fp8
from quant_core.nvfp4 import _dequantize, _nvfp4, _transpose

# The modules whose import defines the operators given entries below.
_DEFINING_MODULES = (_blockwise, _mxfp8, _fp8, _quantize, _dequantize, _nvfp4, _transpose)


def _returning(name: str) -> Callable[..., Any]:
    """The entry of an operator that returns its outputs: the operator, called as `call` calls it."""

    def entry(*args: Any) -> Any:
        return call(name, *args)

    return _named(entry, name, _positional(OPERATORS[name].arguments._fields))  # type: ignore[attr-defined]


def _filling(
    name: str, make: Callable[[str, type[tuple]], Callable[..., Any]], buffers: tuple[str, ...]
) -> Callable[..., Any]:
    """The entry of an operator whose trailing arguments are the buffers it fills, `buffers` (its
    `mutates_args`): `make(name, arguments tuple)` makes it; it allocates them, runs the operator
    and returns them, rowwise data in x's shape."""
    operator = OPERATORS[name]
    fields = operator.arguments._fields  # type: ignore[attr-defined]
    if operator.mutates_args != buffers or fields[len(fields) - len(buffers) :] != buffers:
        raise AssertionError(f"{name}: the buffers it fills are not the trailing fields {buffers} of {fields}")
    signature = _positional(("x", *fields[1 : len(fields) - len(buffers)]))
    usages = [inspect.Parameter(u, inspect.Parameter.KEYWORD_ONLY, annotation=bool) for u in ("rowwise", "columnwise")]
    signature = signature.replace(parameters=[*signature.parameters.values(), *usages])
    return _named(make(name, operator.arguments), name, signature)


def _in_x_shape(x: torch.Tensor, filled: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """The filled buffers with the first, rowwise data of x's (M, K) view, viewed in x's shape."""
    rowwise_data = filled[0]
    if rowwise_data is None:
        return filled
    return (rowwise_data.view(*x.shape[:-1], rowwise_data.shape[-1]), *filled[1:])


def _positional(names: tuple[str, ...]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])


def _named(entry: Callable[..., Any], name: str, signature: inspect.Signature) -> Callable[..., Any]:
    entry.__name__ = entry.__qualname__ = name
    entry.__signature__ = signature  # type: ignore[attr-defined]
    entry.__doc__ = f"`torch.ops.quant_core.{name}` without the public function's checks ([Note: unchecked entries])."
    return entry


def _block_quantize(
    block: int, data_dtype: torch.dtype, scale_dtype: torch.dtype, codes_per_byte: int
) -> Callable[[str, type[tuple]], Callable[..., Any]]:
    """The entry of a block quantize ([Note: block operators]): its four buffers allocated in the
    layout of [Note: block layouts], the block rows and the data dtype from the arguments named
    `block_rows` and `fp8_dtype` where the operator has them (else 1 and `data_dtype`)."""

    def make(op: str, arguments: type[tuple]) -> Callable[..., Any]:
        fields = arguments._fields[1:]  # type: ignore[attr-defined]
        rows_at = fields.index("block_rows") if "block_rows" in fields else None
        dtype_at = fields.index("fp8_dtype") if "fp8_dtype" in fields else None

        def entry(x: torch.Tensor, *args: Any, rowwise: bool, columnwise: bool) -> tuple[torch.Tensor | None, ...]:
            x_MK = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # as `as_2d`
            M, K = x_MK.shape
            rows = 1 if rows_at is None else args[rows_at]
            dtype = data_dtype if dtype_at is None else args[dtype_at]
            device = x_MK.device
            rowwise_data = rowwise_scale = columnwise_data = columnwise_scale = None
            if rowwise:
                rowwise_data = torch.empty((M, K // codes_per_byte), dtype=dtype, device=device)
                rowwise_scale = torch.empty((-(-M // rows), -(-K // block)), dtype=scale_dtype, device=device)
            if columnwise:
                columnwise_data = torch.empty((K, M // codes_per_byte), dtype=dtype, device=device)
                scales = (-(-K // block), -(-M // block)) if rows > 1 else (K, -(-M // block))
                columnwise_scale = torch.empty(scales, dtype=scale_dtype, device=device)
            call(op, x_MK, *args, rowwise_data, rowwise_scale, columnwise_data, columnwise_scale)
            filled = (rowwise_data, rowwise_scale, columnwise_data, columnwise_scale)
            return filled if x_MK is x else _in_x_shape(x, filled)

        return entry

    return make


def _fp8_cast(op: str, arguments: type[tuple]) -> Callable[..., Any]:
    """The entry of an FP8 cast: (M, K) rowwise and (K, M) columnwise codes of the `fp8_dtype` argument."""
    dtype_at = arguments._fields[1:].index("fp8_dtype")  # type: ignore[attr-defined]

    def entry(x: torch.Tensor, *args: Any, rowwise: bool, columnwise: bool) -> tuple[torch.Tensor | None, ...]:
        x_MK = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # as `as_2d`
        M, K = x_MK.shape
        dtype, device = args[dtype_at], x_MK.device
        rowwise_MK = torch.empty((M, K), dtype=dtype, device=device) if rowwise else None
        columnwise_KM = torch.empty((K, M), dtype=dtype, device=device) if columnwise else None
        call(op, x_MK, *args, rowwise_MK, columnwise_KM)
        return (rowwise_MK, columnwise_KM) if x_MK is x else _in_x_shape(x, (rowwise_MK, columnwise_KM))

    return entry


amax = _returning("amax")
cast_to_fp8 = _filling("cast_to_fp8", _fp8_cast, ("rowwise_MK", "columnwise_KM"))
dequantize_fp8 = _returning("dequantize_fp8")
transpose_bytes = _returning("transpose_bytes")
quantize_mxfp8 = _filling(
    "quantize_mxfp8", _block_quantize(_mxfp8.MXFP8_BLOCK, torch.float8_e4m3fn, torch.uint8, 1), QUANTIZE_BUFFERS
)
dequantize_mxfp8 = _returning("dequantize_mxfp8")
dequantize_mxfp8_pair = _returning("dequantize_mxfp8_pair")
quantize_fp8_blockwise = _filling(
    "quantize_fp8_blockwise",
    _block_quantize(_blockwise.BLOCKWISE_BLOCK, torch.float8_e4m3fn, torch.float32, 1),
    QUANTIZE_BUFFERS,
)
dequantize_fp8_blockwise = _returning("dequantize_fp8_blockwise")
quantize_nvfp4 = _filling(
    "quantize_nvfp4", _block_quantize(_nvfp4.NVFP4_BLOCK, torch.uint8, torch.float8_e4m3fn, 2), QUANTIZE_BUFFERS
)
dequantize_nvfp4 = _returning("dequantize_nvfp4")
dequantize_nvfp4_pair = _returning("dequantize_nvfp4_pair")
nvfp4_gemm_output = _returning("nvfp4_gemm_output")
transpose_nvfp4 = _returning("transpose_nvfp4")

__all__ = [
    "amax",
    "cast_to_fp8",
    "dequantize_fp8",
    "dequantize_fp8_blockwise",
    "dequantize_mxfp8",
    "dequantize_mxfp8_pair",
    "dequantize_nvfp4",
    "dequantize_nvfp4_pair",
    "nvfp4_gemm_output",
    "quantize_fp8",
    "quantize_fp8_blockwise",
    "quantize_fp8_delayed",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "transpose_bytes",
    "transpose_nvfp4",
]
