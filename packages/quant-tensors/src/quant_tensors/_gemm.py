"""The GEMM operand protocol of the tensor classes, and the emulated products they share.

[Note: GEMM operand protocol] `quant_tensors.ops.scaled_mm` names no format: each tensor class
says what its operands are and how they multiply, through
- `gemm_operand(usage) -> (data_2d, scale)`: the 2-D codes of a usage ([Note: GEMM operands] in
  quant_tensors.ops) and their dequantization scales, unchecked (the usage must be present);
- `_scaled_mm_takes(b, a_rows, b_rows, k, capability) -> bool`: whether `torch._scaled_mm` on a
  GPU of this compute capability multiplies this (A) with b (B), A (a_rows, k), B (b_rows, k);
- `_torch_scaled_mm(a_operand, b, b_operand, out_dtype, bias, fast_accumulation)`: that product;
- `_emulated_mm(a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias)`: the exact emulation
  (`emulated_mm` below, or the format's own where two operands of it dequantize in one quant-core
  call: MXFP8 and NVFP4);
- `_operand_values(operand, usage, dtype)`: the 2-D values of one operand, and
  `_bf16_operand(operand, usage)`: (values exact in bf16, per-tensor fp32 factor or None), or
  (None, None) where the values are not exact in bf16 ([Note: exact bf16 operands] in
  quant_tensors.ops).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Literal

import torch

Usage = Literal["rowwise", "columnwise"]
GemmOperand = tuple[torch.Tensor, torch.Tensor]  # (2-D codes, their scales), `gemm_operand`'s


def emulated_mm(
    a: Any,
    a_operand: GemmOperand,
    a_usage: Usage,
    b: Any,
    b_operand: GemmOperand,
    b_usage: Usage,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A @ B^T (+ bias) in `out_dtype`, emulated: on CUDA with a bf16/fp16 output from bf16 tensor
    cores where both operands' values are exact in bf16 ([Note: exact bf16 operands] in
    quant_tensors.ops), else in fp32 from each operand's values."""
    if out_dtype != torch.float32 and a.device.type == "cuda":
        a_values, a_factor = a._bf16_operand(a_operand, a_usage)
        b_values, b_factor = b._bf16_operand(b_operand, b_usage)
        if a_values is not None and b_values is not None:
            return bf16_product(a_values, a_factor, b_values, b_factor, out_dtype, bias)
    a_values = a._operand_values(a_operand, a_usage, torch.float32)
    return fp32_product(a_values, b._operand_values(b_operand, b_usage, torch.float32), out_dtype, bias)


def fp32_product(
    a_values: torch.Tensor, b_values: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """A @ B^T of fp32 operand values, plus the bias in fp32, cast to `out_dtype`."""
    product = torch.matmul(a_values, b_values.t())
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)


def bf16_product(
    a_values: torch.Tensor,
    a_factor: torch.Tensor | None,
    b_values: torch.Tensor,
    b_factor: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A @ B^T (+ bias) in `out_dtype` (bf16 or fp16) from bf16 operand values with fp32
    accumulation, the per-tensor factors (fp32, or None) and the bias applied in fp32.

    The fp32 accumulator is rounded once to `out_dtype` after the per-tensor factors and the bias
    (in fp32). Without either the GEMM writes bf16 itself; otherwise it writes fp32 and one
    elementwise pass scales, adds and rounds (an fp32 product is 4 bytes per element written and
    read again: for MXFP8 on Hopper these passes were ~10 ms of a 0.67B Llama training step)."""
    factors = [f for f in (a_factor, b_factor) if f is not None]
    if not factors and bias is None and out_dtype == torch.bfloat16:
        return torch.mm(a_values, b_values.t())
    product = torch.mm(a_values, b_values.t(), out_dtype=torch.float32)
    out = torch.empty(product.shape, dtype=out_dtype, device=product.device)
    factor = functools.reduce(operator.mul, factors) if factors else None
    if bias is None:  # one pass: fp32 product times the factor, rounded into `out`
        return torch.mul(product, factor, out=out) if factor is not None else out.copy_(product)
    if factor is not None:
        product.mul_(factor)
    return torch.add(product, bias, out=out)
