"""Argument checks shared by every public op: errors name the argument, what it got and the rule."""

from __future__ import annotations

import math

import torch

# Input dtypes every quantize kernel reads; anything else is converted by the caller on purpose.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_float_input(x: object, name: str = "x") -> torch.Tensor:
    """Checks that `x` is a real tensor of fp32/bf16/fp16 holding data; returns it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device and holds no values to quantize; materialize it first "
            "(module.to_empty(device=...) then reset_parameters())"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; quantization reads float32, bfloat16 or float16 "
            f"(convert with {name}.float() if the precision loss is intended)"
        )
    return x


def check_fp8_dtype(fp8_dtype: object) -> torch.dtype:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return fp8_dtype  # type: ignore[return-value]


def check_output_dtype(dtype: object) -> torch.dtype:
    """Checks the dtype asked for an op's floating-point output (dequantized values, a GEMM's output)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES} for the output values, got {dtype}")
    return dtype  # type: ignore[return-value]


def check_scalar(t: object, name: str, device: torch.device) -> torch.Tensor:
    """Checks a per-tensor fp32 scale/amax: one element, float32, on `device`."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a one-element float32 tensor, got {got}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the input is on {device}; move it with .to({str(device)!r})")
    return t


def output_buffer(
    out: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Returns `out` after checking it matches (shape, dtype, device, contiguous), or a new buffer."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {shape} on {device}, got {out.dtype} of shape "
            f"{tuple(out.shape)} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous (kernels write it densely); pass a contiguous buffer")
    return out


def with_shape(x_2d: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous 2-D result viewed in `shape`: itself when it has that shape already (the common
    case: no view object, no host time)."""
    return x_2d if x_2d.shape == shape else x_2d.view(shape)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The (M, K) view kernels read: M = product of the leading dims, K = the last (a view when possible)."""
    if x.dim() == 2:
        return x  # the common case; skipping reshape saves ~2 us of host time per call
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
