"""The C++ backend: hands quant_core._C raw pointers, sizes and strides of CPU tensors.

The public ops in quant_core have already checked dtypes, devices and output buffers and pass
(M, K) views (see `_checks.as_2d`); every kernel here reads any strides and writes contiguous
outputs. Threads: as many as torch uses (`torch.get_num_threads()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from quant_core import _C
from quant_core._adam import AdamScalars
from quant_core._blocks import pair_of
from quant_core._checks import as_2d
from quant_core._fp8_quantize import composed_quantize_fp8, composed_quantize_fp8_delayed
from quant_core._library import register_kernel
from quant_core._numerics import E2M1_MAX, E4M3_MAX, to_output_dtype
from quant_core._nvfp4 import NVFP4_BLOCK, hadamard_signs
from quant_core._quantize_many import each_tensor

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


@register_kernel("amax_many", "cpp")
def _amax_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    views = [as_2d(t) for t in tensors]  # read through their strides, as amax reads them
    out = torch.empty(len(views), dtype=torch.float32)
    _C.amax_many(
        [v.data_ptr() for v in views],
        [_DTYPE_CODES[v.dtype] for v in views],
        [v.shape[0] for v in views],
        [v.shape[1] for v in views],
        [v.stride(0) for v in views],
        [v.stride(1) for v in views],
        out.data_ptr(),
        torch.get_num_threads(),
    )
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
        0 if rowwise_MK is None else rowwise_MK.data_ptr(),  # `_pointer`, inline: a hot path
        0 if columnwise_KM is None else columnwise_KM.data_ptr(),
        torch.get_num_threads(),
    )


@register_kernel("fp8_scale", "cpp")
def _fp8_scale(
    amax: torch.Tensor, fmax: float, margin: int, power_2_scales: bool, scale: torch.Tensor, scale_inv: torch.Tensor
) -> None:
    _C.fp8_scale(amax.data_ptr(), amax.numel(), fmax, margin, power_2_scales, scale.data_ptr(), scale_inv.data_ptr())


@register_kernel("delayed_fp8_scale", "cpp")
def _delayed_fp8_scale(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    fmax: float,
    margin: int,
    power_2_scales: bool,
    most_recent: bool,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
) -> None:
    _C.delayed_fp8_scale(
        amax_history.data_ptr(),
        amax_history.numel(),
        amax.data_ptr(),
        fmax,
        margin,
        power_2_scales,
        most_recent,
        scale.data_ptr(),
        scale_inv.data_ptr(),
    )


def _out_dtype_code(out: torch.Tensor) -> int:
    return _DTYPE_CODES[out.dtype]


def _x_args(x_MK: torch.Tensor) -> tuple[int, ...]:
    """(pointer, dtype code, M, K, stride_row, stride_col) of a 2-D input view."""
    return (x_MK.data_ptr(), _DTYPE_CODES[x_MK.dtype], *x_MK.shape, *x_MK.stride())


def _outputs(*buffers: torch.Tensor | None) -> tuple[int, ...]:
    return tuple(_pointer(b) for b in buffers)


@register_kernel("quantize_mxfp8", "cpp")
def _quantize_mxfp8(x_MK: torch.Tensor, *buffers: torch.Tensor | None) -> None:
    _C.quantize_mxfp8(*_x_args(x_MK), *_outputs(*buffers), torch.get_num_threads())


@register_kernel("quantize_fp8_blockwise", "cpp")
def _quantize_fp8_blockwise(
    x_MK: torch.Tensor, block_rows: int, fp8_dtype: torch.dtype, power_2_scales: bool, *buffers: torch.Tensor | None
) -> None:
    _C.quantize_fp8_blockwise(
        *_x_args(x_MK),
        block_rows,
        _FP8_FORMAT_CODES[fp8_dtype],
        power_2_scales,
        *_outputs(*buffers),
        torch.get_num_threads(),
    )


# The C++ kernels of amax, the scale and the cast, one after another ([Note: fused FP8 quantize]).
register_kernel("quantize_fp8", "cpp")(composed_quantize_fp8("cpp"))
register_kernel("quantize_fp8_delayed", "cpp")(composed_quantize_fp8_delayed("cpp"))

# One GIL-free call per tensor: a CPU quantize's host time is small next to its work.
register_kernel("quantize_mxfp8_many", "cpp")(each_tensor("quantize_mxfp8", "cpp"))
register_kernel("quantize_fp8_blockwise_many", "cpp")(each_tensor("quantize_fp8_blockwise", "cpp"))


@register_kernel("quantize_nvfp4", "cpp")
def _quantize_nvfp4(
    x_MK: torch.Tensor,
    block_rows: int,
    global_amax: torch.Tensor,
    stochastic_rounding: bool,
    seed: torch.Tensor,
    columnwise_amax: torch.Tensor,
    hadamard_seed: int | None,
    *buffers: torch.Tensor | None,
) -> None:
    seed = seed if seed.device.type == "cpu" else seed.cpu()  # read through its pointer
    _C.quantize_nvfp4(
        *_x_args(x_MK),
        block_rows,
        global_amax.data_ptr(),
        stochastic_rounding,
        seed.data_ptr(),
        columnwise_amax.data_ptr(),
        hadamard_seed is not None,
        (hadamard_seed or 0) & 0xFFFFFFFFFFFFFFFF,
        *_outputs(*buffers),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_fp8", "cpp")
def _dequantize_fp8(data_MK: torch.Tensor, scale_inv: torch.Tensor, out_MK: torch.Tensor) -> None:
    R, C = data_MK.shape
    _C.dequantize_fp8(
        data_MK.data_ptr(),
        _FP8_FORMAT_CODES[data_MK.dtype],
        R,
        C,
        scale_inv.data_ptr(),
        out_MK.data_ptr(),
        _DTYPE_CODES[out_MK.dtype],
        torch.get_num_threads(),
    )


@register_kernel("dequantize_mxfp8", "cpp")
def _dequantize_mxfp8(data_2d: torch.Tensor, scale_inv: torch.Tensor, out_2d: torch.Tensor) -> None:
    R, C = data_2d.shape
    _C.dequantize_mxfp8(
        data_2d.data_ptr(),
        R,
        C,
        scale_inv.data_ptr(),
        out_2d.data_ptr(),
        _out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


register_kernel("dequantize_mxfp8_pair", "cpp")(pair_of(_dequantize_mxfp8))


@register_kernel("dequantize_fp8_blockwise", "cpp")
def _dequantize_fp8_blockwise(
    data_2d: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, out_2d: torch.Tensor
) -> None:
    R, C = data_2d.shape
    _C.dequantize_fp8_blockwise(
        data_2d.data_ptr(),
        _FP8_FORMAT_CODES[data_2d.dtype],
        R,
        C,
        block_rows,
        scale_inv.data_ptr(),
        out_2d.data_ptr(),
        _out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_nvfp4", "cpp")
def _dequantize_nvfp4(
    data_2d: torch.Tensor,
    scale_inv: torch.Tensor,
    block_rows: int,
    global_amax: torch.Tensor | None,
    out_2d: torch.Tensor,
) -> None:
    R, C = out_2d.shape
    if global_amax is None:  # the block values alone: the amax whose tensor scale S is exactly 1
        global_amax = torch.full((), E4M3_MAX * E2M1_MAX)
    _C.dequantize_nvfp4(
        data_2d.data_ptr(),
        R,
        C,
        block_rows,
        scale_inv.data_ptr(),
        global_amax.data_ptr(),
        out_2d.data_ptr(),
        _out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


register_kernel("dequantize_nvfp4_pair", "cpp")(pair_of(_dequantize_nvfp4, 2))


@register_kernel("transpose_bytes", "cpp")
def _transpose_bytes(data_MK: torch.Tensor, out_KM: torch.Tensor) -> None:
    _C.transpose_bytes(
        data_MK.data_ptr(), *data_MK.shape, *data_MK.stride(), out_KM.data_ptr(), torch.get_num_threads()
    )


@register_kernel("transpose_nvfp4", "cpp")
def _transpose_nvfp4(packed_MK: torch.Tensor, out_KM: torch.Tensor) -> None:
    R, C = packed_MK.shape[0], packed_MK.shape[1] * 2
    _C.transpose_nvfp4(packed_MK.data_ptr(), R, C, out_KM.data_ptr(), torch.get_num_threads())


@register_kernel("hadamard_transform_16", "cpp")
def _hadamard_transform_16(x_MK: torch.Tensor, seed: int, out_MK: torch.Tensor) -> None:
    _C.hadamard_transform_16(*_x_args(x_MK), seed & 0xFFFFFFFFFFFFFFFF, out_MK.data_ptr(), torch.get_num_threads())


@register_kernel("hadamard_inverse_16", "cpp")
def _hadamard_inverse_16(x_MK: torch.Tensor, seed: int, out_MK: torch.Tensor) -> None:
    # D (1/4) H_16 y = D T(D y): the transform's kernel between two exact sign flips, in fp32.
    signs = hadamard_signs(seed, x_MK.device)
    flipped = (x_MK.float().reshape(-1, NVFP4_BLOCK) * signs).reshape(x_MK.shape)
    values = torch.empty_like(flipped)
    _hadamard_transform_16(flipped, seed, values)
    out_MK.copy_(to_output_dtype(values.reshape(-1, NVFP4_BLOCK) * signs, out_MK.dtype).reshape(out_MK.shape))


@register_kernel("hadamard_amaxes", "cpp")
def _hadamard_amaxes(x_MK: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    _C.hadamard_amaxes(*_x_args(x_MK), seed & 0xFFFFFFFFFFFFFFFF, out.data_ptr(), torch.get_num_threads())


@register_kernel("adam_step", "cpp")
def _adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: AdamScalars,
    compute_amax: bool,
) -> torch.Tensor | None:
    amax = torch.zeros(len(params), dtype=torch.float32) if compute_amax else None
    _C.adam_step(
        [p.data_ptr() for p in params],
        [g.data_ptr() for g in grads],
        [m.data_ptr() for m in exp_avgs],
        [v.data_ptr() for v in exp_avg_sqs],
        [p.numel() for p in params],
        _DTYPE_CODES[grads[0].dtype],
        _DTYPE_CODES[exp_avgs[0].dtype],
        _DTYPE_CODES[exp_avg_sqs[0].dtype],
        _C.AdamScalars(**dataclasses.asdict(scalars)),
        _pointer(amax),
        torch.get_num_threads(),
    )
    for t in (*params, *exp_avgs, *exp_avg_sqs):  # written through pointers: tell autograd and caches
        torch.autograd.graph.increment_version(t)
    return amax


@register_kernel("has_non_finite", "cpp")
def _has_non_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    found = _C.has_non_finite(
        [t.data_ptr() for t in tensors],
        [_DTYPE_CODES[t.dtype] for t in tensors],
        [t.numel() for t in tensors],
        torch.get_num_threads(),
    )
    return torch.tensor(float(found))
