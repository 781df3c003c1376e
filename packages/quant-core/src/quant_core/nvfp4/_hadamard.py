"""The 16 x 16 random Hadamard transform that NVFP4 applies to its wgrad operands: reference,
operators and C++ kernels ([Note: NVFP4 random Hadamard transform] in quant_core.nvfp4._nvfp4).

`hadamard_transform_16` multiplies each group of 16 along the last dim by the seed's random
signs and the orthonormal 16 x 16 Sylvester Hadamard matrix; `hadamard_inverse_16` undoes it;
`hadamard_amaxes` gives the amax of x and of its transform in one pass.

Operator contracts (what the caller guarantees):
- `torch.ops.quant_core.hadamard_transform_16(x_MK, seed) -> Tensor`: x_MK 2-D fp32/bf16/fp16
  with K a multiple of 16, any strides; seed an int in int64 range (`signed64`). Returns the
  contiguous (M, K) transform in x's dtype.
- `torch.ops.quant_core.hadamard_amaxes(x_MK, seed) -> Tensor`: x_MK 2-D fp32/bf16/fp16, any
  strides and M; seed as above. Returns fp32 (2,): amax(x) and amax(T(x^T)), T along M in runs
  of 16 (a partial last run zero-padded).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.fp8._fp8 import amax_reference
from quant_core.shared._checks import as_2d, check_float_input, with_shape
from quant_core.shared._cpp import _C, x_args
from quant_core.shared._numerics import (
    signed64,
    splitmix64,
    to_output_dtype,
)

GROUP = 16
"""Elements the transform mixes: one NVFP4 block."""


# ---- random Hadamard transform ------------------------------------------------------------------


def hadamard_signs(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 random signs (+-1, fp32) of the transform: element j is -1 iff the top bit of draw j is set."""
    draws = splitmix64(seed, torch.arange(GROUP, device=device))
    return torch.where(draws < 0, -1.0, 1.0)


def hadamard_transform_16_reference(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Plain-torch 16 x 16 random Hadamard transform along the last dim (the spec in code).

    Each group of 16 is multiplied by the seed's signs, put through the 4-stage fast
    Walsh-Hadamard butterfly (stage h adds and subtracts elements h apart, in fp32) and scaled by
    1/4, so the transform is orthonormal; the result is rounded to x's dtype.
    """
    groups = _butterfly(x.float().reshape(-1, GROUP) * hadamard_signs(seed, x.device))
    return to_output_dtype(groups * 0.25, x.dtype).reshape(x.shape)


def _butterfly(groups: torch.Tensor) -> torch.Tensor:
    """The 4-stage fast Walsh-Hadamard butterfly of each row of 16 (stage h adds and subtracts
    elements h apart), unscaled, in the rows' dtype."""
    for h in (1, 2, 4, 8):
        pairs = groups.reshape(-1, GROUP // (2 * h), 2, h)
        first, second = pairs[:, :, 0, :], pairs[:, :, 1, :]
        groups = torch.stack((first + second, first - second), dim=2).reshape(-1, GROUP)
    return groups


def hadamard_transform_16(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """16 x 16 random Hadamard transform of x along its last dim (which must be a multiple of 16)."""
    return _checked_call("hadamard_transform_16", x, seed)


def _checked_call(name: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    """The transform operator `name` on x's (M, K) view, after the checks both transforms share."""
    check_float_input(x)
    if x.dim() == 0 or x.shape[-1] % GROUP:
        raise ValueError(f"the Hadamard transform mixes groups of 16 along the last dim; got shape {tuple(x.shape)}")
    return with_shape(call(name, as_2d(x), signed64(int(seed))), x.shape)


class HadamardArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.hadamard_transform_16`, `hadamard_inverse_16` and
    `hadamard_amaxes` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    seed: int


def _hadamard_fake(args: HadamardArgs) -> torch.Tensor:
    return args.x_MK.new_empty(args.x_MK.shape)


def _transform_op(kernel: Kernel, args: HadamardArgs) -> torch.Tensor:
    """The body of both transform operators: kernel(args, out_MK), a fresh contiguous (M, K) output."""
    out_MK = torch.empty(args.x_MK.shape, dtype=args.x_MK.dtype, device=args.x_MK.device)
    if out_MK.numel() > 0:
        kernel(args, out_MK)
    return out_MK


define_op("hadamard_transform_16", HadamardArgs, fake=_hadamard_fake)(_transform_op)
define_op("hadamard_inverse_16", HadamardArgs, fake=_hadamard_fake)(_transform_op)


@register_kernel("hadamard_transform_16", "reference")
def _hadamard_reference_kernel(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    out_MK.copy_(hadamard_transform_16_reference(args.x_MK, args.seed))


def hadamard_inverse_16_reference(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Plain-torch inverse of `hadamard_transform_16_reference` along the last dim (the spec in code).

    T = (1/4) H_16 D is orthonormal and H_16 is symmetric, so T^-1 = T^T = D (1/4) H_16: each
    group of 16 goes through the 4-stage butterfly (in fp32), is scaled by 1/4, then multiplied
    by the seed's signs; the result is rounded to x's dtype.
    """
    groups = _butterfly(x.float().reshape(-1, GROUP))
    return to_output_dtype(groups * 0.25 * hadamard_signs(seed, x.device), x.dtype).reshape(x.shape)


def hadamard_inverse_16(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The inverse of `hadamard_transform_16` along x's last dim (a multiple of 16), in fp32, rounded to x's dtype."""
    return _checked_call("hadamard_inverse_16", x, seed)


@register_kernel("hadamard_inverse_16", "reference")
def _hadamard_inverse_reference_kernel(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    out_MK.copy_(hadamard_inverse_16_reference(args.x_MK, args.seed))


def hadamard_amaxes_reference(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Plain-torch (2,) fp32: amax(x) and amax(T(x^T)), T the transform with `seed`'s signs along
    dim 0 of x's (M, K) view in runs of 16, a partial last run zero-padded, computed in fp32."""
    x_MK = as_2d(x).float()
    padded = torch.nn.functional.pad(x_MK, (0, 0, 0, -x_MK.shape[0] % GROUP))
    transformed = hadamard_transform_16_reference(padded.t(), seed)
    return torch.stack((amax_reference(x), amax_reference(transformed)))


def hadamard_amaxes(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """amax(x) and amax(T(x^T)) in one read of x: fp32 (2,) ([Note: NVFP4 random Hadamard transform]).

    T runs along dim 0 of x's (M, K) view in runs of 16 rows (a partial last run zero-padded),
    in fp32. Both amaxes ignore NaN and +-Inf (0 if nothing is finite).
    """
    check_float_input(x)
    return call("hadamard_amaxes", as_2d(x), signed64(int(seed)))


def _hadamard_amaxes_fake(args: HadamardArgs) -> torch.Tensor:
    return args.x_MK.new_empty((2,), dtype=torch.float32)


@define_op("hadamard_amaxes", HadamardArgs, fake=_hadamard_amaxes_fake)
def _hadamard_amaxes_op(kernel: Kernel, args: HadamardArgs) -> torch.Tensor:
    """Kernels take (args, out: fp32 (2,) zeros to fill)."""
    out = torch.zeros(2, dtype=torch.float32, device=args.x_MK.device)  # the Triton kernel takes atomic maxima
    if args.x_MK.numel() > 0:
        kernel(args, out)
    return out


@register_kernel("hadamard_amaxes", "reference")
def _hadamard_amaxes_reference_kernel(args: HadamardArgs, out: torch.Tensor) -> None:
    out.copy_(hadamard_amaxes_reference(args.x_MK, args.seed))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("hadamard_transform_16", "cpp")
def _hadamard_transform_16_cpp(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    seed = args.seed & 0xFFFFFFFFFFFFFFFF
    _C.hadamard_transform_16(*x_args(args.x_MK), seed, out_MK.data_ptr(), torch.get_num_threads())


@register_kernel("hadamard_inverse_16", "cpp")
def _hadamard_inverse_16_cpp(args: HadamardArgs, out_MK: torch.Tensor) -> None:
    # D (1/4) H_16 y = D T(D y): the transform's kernel between two exact sign flips, in fp32.
    x_MK = args.x_MK
    signs = hadamard_signs(args.seed, x_MK.device)
    flipped = (x_MK.float().reshape(-1, GROUP) * signs).reshape(x_MK.shape)
    values = torch.empty_like(flipped)
    _hadamard_transform_16_cpp(HadamardArgs(flipped, args.seed), values)
    out_MK.copy_(to_output_dtype(values.reshape(-1, GROUP) * signs, out_MK.dtype).reshape(out_MK.shape))


@register_kernel("hadamard_amaxes", "cpp")
def _hadamard_amaxes_cpp(args: HadamardArgs, out: torch.Tensor) -> None:
    seed = args.seed & 0xFFFFFFFFFFFFFFFF
    _C.hadamard_amaxes(*x_args(args.x_MK), seed, out.data_ptr(), torch.get_num_threads())
