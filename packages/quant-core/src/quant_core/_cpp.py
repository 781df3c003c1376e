"""The C++ backend: hands quant_core._C raw pointers, sizes and strides of CPU tensors.

The public ops in quant_core have already checked dtypes, devices and output buffers and pass
(M, K) views (see `_checks.as_2d`); every kernel here reads any strides and writes contiguous
outputs. Threads: as many as torch uses (`torch.get_num_threads()`).
"""

from __future__ import annotations

import torch

from quant_core import _C
from quant_core._backend import register_kernel

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8_FORMAT_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@register_kernel("amax", "cpp")
def _amax(x_MK: torch.Tensor) -> torch.Tensor:
    out = torch.empty((), dtype=torch.float32)
    M, K = x_MK.shape
    _C.amax(x_MK.data_ptr(), _DTYPE_CODES[x_MK.dtype], M, K, *x_MK.stride(), out.data_ptr(), torch.get_num_threads())
    return out


@register_kernel("cast_to_fp8", "cpp")
def _cast_to_fp8(
    x_MK: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    rowwise_MK: torch.Tensor | None,
    columnwise_KM: torch.Tensor | None,
) -> None:
    M, K = x_MK.shape
    _C.cast_to_fp8(
        x_MK.data_ptr(),
        _DTYPE_CODES[x_MK.dtype],
        M,
        K,
        *x_MK.stride(),
        scale.data_ptr(),
        _FP8_FORMAT_CODES[fp8_dtype],
        _pointer(rowwise_MK),
        _pointer(columnwise_KM),
        torch.get_num_threads(),
    )
