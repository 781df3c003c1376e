"""Quantized GEMM: `scaled_mm(a, b, out_dtype)` computes A @ B^T from two quantized operands.

[Note: GEMM operands] Each operand is one usage of a QuantizedTensor seen as a 2-D matrix whose
second dim is the reduction dim, which is where every format's blocks run:
- "rowwise" usage of x: the (M, K) view (fprop: input and weight; dgrad: grad_output);
- "columnwise" usage of x: x^T, (K, M) (dgrad: the weight; wgrad: grad_output and input).
So fprop is scaled_mm(x, w) = X W^T, dgrad scaled_mm(dy, w, b_usage="columnwise") = dY W and
wgrad scaled_mm(dy, x, a_usage="columnwise", b_usage="columnwise") = dY^T X.

Paths: `torch._scaled_mm` where the GPU has the kernel (Hopper: per-tensor FP8, blockwise
1x128 x 128x128 and 1x128 x 1x128), else an exact emulation: on CUDA with a bf16/fp16 output,
bf16 tensor cores over operands whose values are exact in bf16 ([Note: exact bf16 operands]);
otherwise dequantize both operands to fp32, fp32 matmul. The bias is added in fp32, then the
result is cast. `scaled_mm_path` says which one runs. The formats' operands and products are
methods of their tensor classes ([Note: GEMM operand protocol] in quant_tensors._gemm).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from quant_tensors._gemm import GemmOperand, Usage
from quant_tensors._tensor import QuantizedTensor

GemmPath = Literal["torch._scaled_mm", "emulated"]


def operand_values(t: QuantizedTensor, usage: Usage, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2-D matrix a usage of `t` stands for, dequantized: (M, K) rowwise, (K, M) columnwise
    (NVFP4 with the random Hadamard transform: T(x^T), as the codes hold it)."""
    values = t._usage_values(usage, dtype)
    return values.reshape(-1, values.shape[-1])


def scaled_mm_path(
    a: QuantizedTensor, b: QuantizedTensor, *, a_usage: Usage = "rowwise", b_usage: Usage = "rowwise"
) -> GemmPath:
    """Which implementation `scaled_mm` uses for these operands on this machine."""
    if a.device.type != "cuda":
        return "emulated"
    capability = _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())
    if capability < (8, 9):
        return "emulated"
    k, a_rows, b_rows = operand_k(a, a_usage), operand_k(a, _other(a_usage)), operand_k(b, _other(b_usage))
    return "torch._scaled_mm" if a._scaled_mm_takes(b, a_rows, b_rows, k, capability) else "emulated"


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _other(usage: Usage) -> Usage:
    return "columnwise" if usage == "rowwise" else "rowwise"


def scaled_mm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    *,
    a_usage: Usage = "rowwise",
    b_usage: Usage = "rowwise",
    bias: torch.Tensor | None = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """A @ B^T (+ bias) in `out_dtype`, A and B the chosen usages of a and b ([Note: GEMM operands]).

    `fast_accumulation`: per-tensor FP8 operands on the `torch._scaled_mm` path accumulate without
    promoting the tensor cores' partial sums to fp32 (its `use_fast_accum`; [Note: fast
    accumulation]); every other path accumulates in fp32 and ignores it.
    """
    if not isinstance(a, QuantizedTensor) or not isinstance(b, QuantizedTensor):
        raise TypeError(f"scaled_mm takes two QuantizedTensors, got {type(a).__name__} and {type(b).__name__}")
    a.usage_buffers(a_usage)  # raises, naming the fix, where a usage is absent (or the tensor a flat view)
    b.usage_buffers(b_usage)
    a_k = operand_k(a, a_usage)
    b_k = operand_k(b, b_usage)
    if a_k != b_k:
        raise ValueError(f"scaled_mm reduction dims differ: A is (*, {a_k}) ({a_usage}), B is (*, {b_k}) ({b_usage})")
    _check_same_transform(a, b, a_usage, b_usage)
    path = scaled_mm_path(a, b, a_usage=a_usage, b_usage=b_usage)
    return scaled_mm_unchecked(a, b, out_dtype, a_usage, b_usage, bias, fast_accumulation, path)


def scaled_mm_unchecked(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    a_usage: Usage,
    b_usage: Usage,
    bias: torch.Tensor | None,
    fast_accumulation: bool,
    path: GemmPath,
) -> torch.Tensor:
    """`scaled_mm` on `path` (`scaled_mm_path` of these operands) without its checks: for callers
    that guarantee two QuantizedTensors, the usages present, equal reduction dims and equal
    transforms (qt.nn.Linear, whose operands its own quantizers made)."""
    a_operand: GemmOperand = a.gemm_operand(a_usage)
    b_operand: GemmOperand = b.gemm_operand(b_usage)
    if path == "torch._scaled_mm":
        return a._torch_scaled_mm(a_operand, b, b_operand, out_dtype, bias, fast_accumulation)
    return a._emulated_mm(a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias)


def _check_same_transform(a: QuantizedTensor, b: QuantizedTensor, a_usage: Usage, b_usage: Usage) -> None:
    """Refuses operands transformed differently along the reduction dim: T_a(A) T_b(B)^T is A B^T
    only when T_a = T_b is orthonormal (quant_tensors.nvfp4, the random Hadamard transform)."""
    a_transform, b_transform = a._transform_of(a_usage), b._transform_of(b_usage)
    if a_transform != b_transform:
        describe = lambda seed: "none" if seed is None else f"hadamard_seed={seed}"  # noqa: E731
        raise ValueError(
            f"scaled_mm operands hold different random Hadamard transforms along the reduction dim (A {a_usage}: "
            f"{describe(a_transform)}, B {b_usage}: {describe(b_transform)}), so their product is not A @ B^T. "
            "Quantize both wgrad operands with the 'input' and 'grad_output' quantizers of one "
            "NVFP4BlockScaling(random_hadamard_transform=True) recipe (one hadamard_seed), or both without the transform"
        )


# [Note: exact bf16 operands] bf16 holds 8 significant bits. E4M3/E5M2 codes (<= 4), codes times a
# power of two (MXFP8's E8M0 scales, blockwise FP8 with power-of-two scales) and E2M1 codes times
# E4M3 block scales (NVFP4 without its tensor scale: <= 5 bits) are exact in bf16 (short of
# underflow below 2^-133), so a bf16 GEMM with fp32 accumulation computes the emulated product
# from the same operand values; the per-tensor fp32 factors (FP8's scale_inv, NVFP4's 1 / S) are
# multiplied together and applied to the fp32 product. It differs from the fp32 emulation by
# accumulation order and the rounding of those factors (within a few fp32 ulps before the final
# rounding to bf16).


def operand_k(t: QuantizedTensor, usage: Usage) -> int:
    """The reduction dim of a usage of t: K for rowwise, M for columnwise."""
    M = t.numel() // t.shape[-1] if t.shape[-1] else 0
    return t.shape[-1] if usage == "rowwise" else M


# [Note: fast accumulation] Hopper's FP8 tensor cores sum products in a narrow accumulator (about
# 14 mantissa bits); cuBLAS by default adds it into an fp32 sum every few K-steps (a "split
# accumulator"). `use_fast_accum=True` skips that promotion. Measured on an H100
# (docs/benchmarks.md; `scripts/profile_gpu.py accumulation`): the e2e models'
# forward GEMMs take 0.94-0.98x the time (one large shape 1.05x), the relative error against the
# fp32 product grows from 1.3e-4 to 0.9e-3-2.9e-3 with K, and the e2e step does not move (fp8
# compiled 129.5k vs 129.4k tokens/s). TransformerEngine (fprop `use_split_accumulator=False`) and
# torchao (`gemm_config_output.use_fast_accum=True`) run their forward GEMM this way; ours does
# where a per-tensor FP8 recipe asks (`fprop_fast_accumulation=True`), off by default: the
# precision costs more than the step gains.
