"""The lossless NVFP4 transpose of 16 x 16-tiled data (`_nvfp4.py` has the format).

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.transpose_nvfp4(packed_MK, scale_inv) -> (Tensor, Tensor)`: rowwise
  16 x 16 data (M, K/2) uint8 with M even, any strides, and its (M/16, K/16) scales. Returns the
  packed codes of x^T, contiguous (K, M/2), and the scales transposed, contiguous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel, with_contiguous
from quant_core.nvfp4._nvfp4 import NVFP4_BLOCK
from quant_core.shared._checks import as_2d
from quant_core.shared._cpp import _C
from quant_core.shared._numerics import pack_nibbles, unpack_nibbles


def transpose_nvfp4(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless columnwise from rowwise for 16 x 16 tiles: codes transposed and repacked, scales transposed.

    `data` is rowwise packed data (viewed as (M, K/2)); M must be even. The result equals the
    columnwise usage of quantizing the same tensor with 16 x 16 tiles, bit for bit.
    """
    if data.dim() == 0 or data.dtype != torch.uint8:
        raise ValueError(
            f"data must be NVFP4 rowwise data (uint8) with at least one dim, got {data.dtype} of shape {tuple(data.shape)}"
        )
    packed = as_2d(data)
    M, K = packed.shape[0], packed.shape[1] * 2
    if M % 2:
        raise ValueError(f"NVFP4 transpose repacks codes in pairs along dim 0, which must be even; got M={M}")
    expected = (-(-M // NVFP4_BLOCK), -(-K // NVFP4_BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv of 16 x 16 tiles for data of shape {tuple(data.shape)} must have shape {expected}, got "
            f"{tuple(scale_inv.shape)} (1 x 16 data cannot be transposed losslessly: quantize x^T instead)"
        )
    return call("transpose_nvfp4", packed, scale_inv)


def _transposed_packed_shape(packed_MK: torch.Tensor) -> tuple[int, int]:
    """(K, M/2): the packed shape of x^T for packed (M, K/2) codes."""
    return packed_MK.shape[1] * 2, packed_MK.shape[0] // 2


class TransposeNvfp4Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.transpose_nvfp4` ([Note: operator arguments])."""

    packed_MK: torch.Tensor
    scale_inv: torch.Tensor


def _transpose_nvfp4_fake(args: TransposeNvfp4Args) -> tuple[torch.Tensor, torch.Tensor]:
    packed_MK, scale_inv = args.packed_MK, args.scale_inv
    return packed_MK.new_empty(_transposed_packed_shape(packed_MK)), scale_inv.new_empty(scale_inv.shape[::-1])


@define_op("transpose_nvfp4", TransposeNvfp4Args, fake=_transpose_nvfp4_fake, recomputable=True)
def _transpose_nvfp4_op(kernel: Kernel, args: TransposeNvfp4Args) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels take (args with packed_MK contiguous, out_KM: the new packed codes of x^T)."""
    # The scales are transposed here, not by the caller, so that torch.compile recomputes them in
    # the backward with the codes ([Note: recomputed quantizations] in quant_core._recompute).
    out_KM = torch.empty(_transposed_packed_shape(args.packed_MK), dtype=torch.uint8, device=args.packed_MK.device)
    if out_KM.numel() > 0:
        kernel(with_contiguous(args, "packed_MK"), out_KM)
    return out_KM, args.scale_inv.t().clone(memory_format=torch.contiguous_format)


@register_kernel("transpose_nvfp4", "reference")
def _transpose_nvfp4_reference(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    out_KM.copy_(pack_nibbles(unpack_nibbles(args.packed_MK).t()))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("transpose_nvfp4", "cpp")
def _transpose_nvfp4_cpp(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    packed_MK = args.packed_MK
    R, C = packed_MK.shape[0], packed_MK.shape[1] * 2
    _C.transpose_nvfp4(packed_MK.data_ptr(), R, C, out_KM.data_ptr(), torch.get_num_threads())
