"""Arguments of the C++ kernels (`quant_core._C`).

[Note: C++ kernel arguments] The C++ kernels of every format (registered on the CPU dispatch key
next to each format's reference) take raw pointers, sizes and strides of CPU tensors and release
the GIL; quant-core's C++ does not link libtorch. The public ops have already checked dtypes,
devices and output buffers and pass (M, K) views (`shared._checks.as_2d`); every kernel reads any
strides and writes contiguous outputs. Dtypes travel as codes (DTYPE_CODES, FP8_FORMAT_CODES), an
absent buffer as the pointer 0. Threads: as many as torch uses (`torch.get_num_threads()`).
"""

from __future__ import annotations

import torch

from quant_core._backends import cpp_extension

_C = cpp_extension()  # None where the extension failed to import: no C++ kernel is registered then
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_FORMAT_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


def pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def out_dtype_code(out: torch.Tensor) -> int:
    return DTYPE_CODES[out.dtype]


def x_args(x_MK: torch.Tensor) -> tuple[int, ...]:
    """(pointer, dtype code, M, K, stride_row, stride_col) of a 2-D input view."""
    return (x_MK.data_ptr(), DTYPE_CODES[x_MK.dtype], *x_MK.shape, *x_MK.stride())


def outputs(*buffers: torch.Tensor | None) -> list[int]:
    """The pointers of output buffers, 0 for an absent one (`pointer` of each, inline: a loop with no
    call per buffer, on every kernel call's host path)."""
    pointers = []
    for b in buffers:
        pointers.append(0 if b is None else b.data_ptr())
    return pointers
