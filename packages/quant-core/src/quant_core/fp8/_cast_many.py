"""Many tensors cast to FP8 in one operator call, each with its own scale (an optimizer's
requantize of its per-tensor FP8 weights, a sharding layer's shards quantized ahead of their
gathers): out t holds the bytes `cast_to_fp8(xs[t], scales[t], fp8_dtype, rowwise=True)` gives,
bit for bit.

Layouts: the reference and C++ kernels cast each tensor through its (M, K) view, as
`cast_to_fp8` does; the Triton kernel reads flat memory, so it copies non-contiguous inputs first
and runs one launch for all of them, dtypes mixed ([Note: pointer tables]).

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.cast_to_fp8_many(xs, scales, fp8_dtype, outs) -> ()`: a non-empty list of
  fp32/bf16/fp16 tensors with at least one dim on one device, any strides; `scales` fp32 of shape
  (len(xs),) there; `outs` contiguous FP8 tensors of `fp8_dtype`, outs[t] of xs[t]'s shape,
  written in place (rowwise codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quant_core._backends import Backend
from quant_core._library import Kernel, backend_kernel, call, define_op, register_kernel
from quant_core.fp8._fp8 import CastToFp8Args
from quant_core.shared._checks import as_2d, check_float_input, check_fp8_dtype


def cast_to_fp8_many(
    xs: Sequence[torch.Tensor], scales: torch.Tensor, fp8_dtype: torch.dtype, outs: Sequence[torch.Tensor]
) -> None:
    """Casts every xs[t] to FP8 codes in outs[t] with scale scales[t], in place: the rowwise data
    `cast_to_fp8(xs[t], scales[t], fp8_dtype)` would make, bit for bit, in one kernel call (one
    Triton launch on CUDA, dtypes mixed).

    Args:
        xs: fp32/bf16/fp16 tensors with at least one dim, one device, any shapes and strides.
        scales: fp32, shape (len(xs),), on their device.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        outs: contiguous tensors of fp8_dtype, outs[t] of xs[t]'s shape.
    """
    if isinstance(xs, torch.Tensor) or isinstance(outs, torch.Tensor):
        raise TypeError("cast_to_fp8_many takes sequences of tensors; for one tensor call cast_to_fp8")
    if len(xs) == 0 or len(xs) != len(outs):
        raise ValueError(
            f"cast_to_fp8_many needs one out per x and at least one pair; got {len(xs)} xs and {len(outs)} outs"
        )
    check_fp8_dtype(fp8_dtype)
    device = xs[0].device
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype != torch.float32
        or tuple(scales.shape) != (len(xs),)
        or scales.device != device
    ):
        raise ValueError(
            f"scales must be an fp32 tensor of shape ({len(xs)},) on {device}, one per x; got "
            f"{getattr(scales, 'dtype', type(scales).__name__)} of shape {tuple(getattr(scales, 'shape', ()))}"
        )
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        check_float_input(x, f"xs[{i}]")
        if x.dim() == 0 or x.device != device:
            raise ValueError(
                f"xs[{i}] must have at least one dim and be on {device} like xs[0]; got shape {tuple(x.shape)} on "
                f"{x.device}: call cast_to_fp8_many once per device, reshape 0-d tensors to (1,)"
            )
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != fp8_dtype
            or out.shape != x.shape
            or out.device != device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"outs[{i}] must be a contiguous {fp8_dtype} tensor of shape {tuple(x.shape)} on {device}; got "
                f"{getattr(out, 'dtype', type(out).__name__)} of shape {tuple(getattr(out, 'shape', ()))}"
            )
    call("cast_to_fp8_many", list(xs), scales, fp8_dtype, list(outs))


class CastToFp8ManyArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.cast_to_fp8_many` ([Note: operator arguments])."""

    xs: list[torch.Tensor]
    scales: torch.Tensor
    fp8_dtype: torch.dtype
    outs: list[torch.Tensor]


@define_op("cast_to_fp8_many", CastToFp8ManyArgs, mutates_args=("outs",))
def _cast_to_fp8_many_op(kernel: Kernel, args: CastToFp8ManyArgs) -> None:
    kernel(args)


def _each(backend: Backend) -> Kernel:
    """`backend`'s kernel of `cast_to_fp8_many`: its single cast kernel on each tensor's (M, K) view."""

    def cast_each(args: CastToFp8ManyArgs) -> None:
        cast = backend_kernel("cast_to_fp8", backend)
        for x, scale, out in zip(args.xs, args.scales.unbind(), args.outs, strict=True):
            if x.numel() > 0:
                cast(CastToFp8Args(as_2d(x), scale, args.fp8_dtype, as_2d(out), None))

    return cast_each


register_kernel("cast_to_fp8_many", "reference")(_each("reference"))
register_kernel("cast_to_fp8_many", "cpp")(_each("cpp"))
