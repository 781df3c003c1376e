"""The amaxes of many tensors in one operator call (FSDP2's per-shard weight amaxes, an optimizer's
fp8 moments): entry t is what `amax` gives for tensor t, bit for bit.

Layouts: the C++ kernel reads each tensor's (M, K) view through its strides, as `amax` does (a
copy only where `reshape` makes one); the Triton kernel reads flat memory, so it copies the
non-contiguous tensors first and runs one launch for all of them, dtypes mixed.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.amax_many(tensors) -> Tensor`: a non-empty list of fp32/bf16/fp16 tensors
  on one device, any shapes and strides, empty ones included. Returns the (len(tensors),) fp32
  amaxes: max |x| over the finite elements of each (0 if none or empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.fp8._fp8 import amax_reference
from quant_core.shared._checks import as_2d, check_float_input
from quant_core.shared._cpp import _C, DTYPE_CODES


def amax_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max |x| over the finite elements of each tensor (0 if none is finite) as an fp32 tensor of
    shape (len(tensors),) on their device; entry t equals `amax(tensors[t])`.

    One kernel call for all of them (one C++ call, one Triton launch); dtypes (fp32/bf16/fp16),
    shapes and strides may differ, the device may not.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError("amax_many takes a sequence of tensors, got one tensor; use amax(x) or amax_many([x])")
    if len(tensors) == 0:
        raise ValueError("amax_many needs at least one tensor (the result lives on their device); skip the call")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        check_float_input(t, f"tensors[{i}]")
        if t.device != device:
            raise ValueError(
                f"tensors[{i}] is on {t.device} but tensors[0] is on {device}; amax_many reads one device "
                "per call: call it once per device, or move the tensors there"
            )
    return call("amax_many", list(tensors))


class AmaxManyArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.amax_many` ([Note: operator arguments])."""

    tensors: list[torch.Tensor]


def _amax_many_fake(args: AmaxManyArgs) -> torch.Tensor:
    return args.tensors[0].new_empty(len(args.tensors), dtype=torch.float32)


@define_op("amax_many", AmaxManyArgs, fake=_amax_many_fake)
def _amax_many_op(kernel: Kernel, args: AmaxManyArgs) -> torch.Tensor:
    return kernel(args)


@register_kernel("amax_many", "reference")
def _amax_many_reference_kernel(args: AmaxManyArgs) -> torch.Tensor:
    return amax_many_reference(args.tensors)


def amax_many_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Plain-torch amaxes of a non-empty sequence of tensors: `amax_reference` of each, stacked."""
    return torch.stack([amax_reference(t) for t in tensors])


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("amax_many", "cpp")
def _amax_many_cpp(args: AmaxManyArgs) -> torch.Tensor:
    views = [as_2d(t) for t in args.tensors]  # read through their strides, as amax reads them
    out = torch.empty(len(views), dtype=torch.float32)
    _C.amax_many(
        [v.data_ptr() for v in views],
        [DTYPE_CODES[v.dtype] for v in views],
        [v.shape[0] for v in views],
        [v.shape[1] for v in views],
        [v.stride(0) for v in views],
        [v.stride(1) for v in views],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
