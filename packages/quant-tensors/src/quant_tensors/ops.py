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
result is cast. `scaled_mm_path` says which one runs.
"""

from __future__ import annotations

import functools
import operator
from typing import Literal

import torch

import quant_core
from quant_tensors._tensor import QuantizedTensor
from quant_tensors.blockwise import Float8BlockwiseTensor
from quant_tensors.float8 import Float8Tensor
from quant_tensors.mxfp8 import MXFP8Tensor
from quant_tensors.nvfp4 import NVFP4Tensor

Usage = Literal["rowwise", "columnwise"]
GemmPath = Literal["torch._scaled_mm", "emulated"]


def operand_values(t: QuantizedTensor, usage: Usage, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2-D matrix a usage of `t` stands for, dequantized: (M, K) rowwise, (K, M) columnwise
    (NVFP4 with the random Hadamard transform: T(x^T), as the codes hold it)."""
    values = t._usage_values(usage, dtype)
    return values.reshape(-1, values.shape[-1])


def _operand_buffers(t: QuantizedTensor, usage: Usage) -> tuple[torch.Tensor, torch.Tensor]:
    if type(t) is Float8Tensor and t._flat_shape is None:  # `usage_buffers`, inline: the hot path
        data = t.rowwise_data if usage == "rowwise" else t.columnwise_data
        if data is not None:
            return (data if data.dim() == 2 else data.reshape(-1, data.shape[-1])), t.scale_inv
    data, scale_inv = t.usage_buffers(usage)
    return data.reshape(-1, data.shape[-1]), scale_inv


def scaled_mm_path(
    a: QuantizedTensor, b: QuantizedTensor, *, a_usage: Usage = "rowwise", b_usage: Usage = "rowwise"
) -> GemmPath:
    """Which implementation `scaled_mm` uses for these operands on this machine."""
    if a.device.type != "cuda":
        return "emulated"
    capability = _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())
    if capability < (8, 9):
        return "emulated"
    if isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor):
        both_e5m2 = a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2
        # torch._scaled_mm's conditions: K and B's rows in multiples of 16, any number of A's rows
        # (a decoding step's one token among them).
        dims_ok = _dims_ok(a, b, a_usage, b_usage, 16, a_rows=False)
        return "emulated" if both_e5m2 or not dims_ok else "torch._scaled_mm"
    if isinstance(a, Float8BlockwiseTensor) and isinstance(b, Float8BlockwiseTensor):
        # Hopper's kernels: A in 1 x 128 blocks, B in 128 x 128 tiles or 1 x 128 blocks. With
        # 128 x 128 tiles, torch 2.11's kernel returns wrong results (silently, ~50% error) unless
        # the reduction dim holds a multiple of 4 blocks (measured on H100, docs/benchmarks.md).
        hopper = capability[0] == 9
        reduction_ok = not b.tiled or operand_k(a, a_usage) % 512 == 0
        if hopper and not a.tiled and reduction_ok and _dims_ok(a, b, a_usage, b_usage, 128):
            return "torch._scaled_mm"
    return "emulated"


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _dims_ok(
    a: QuantizedTensor, b: QuantizedTensor, a_usage: Usage, b_usage: Usage, multiple: int, *, a_rows: bool = True
) -> bool:
    """Whether the reduction dim, B's rows and (if `a_rows`) A's rows are multiples of `multiple`."""
    sizes = (
        operand_k(a, a_usage),
        operand_k(b, _other(b_usage)),
        *((operand_k(a, _other(a_usage)),) if a_rows else ()),
    )
    return all(size % multiple == 0 for size in sizes)


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
    a_data, a_scale = _operand_buffers(a, a_usage)
    b_data, b_scale = _operand_buffers(b, b_usage)
    if path == "torch._scaled_mm":
        return _hardware_scaled_mm(a, b, a_data, a_scale, b_data, b_scale, out_dtype, bias, fast_accumulation)
    if type(a) is Float8Tensor and type(b) is Float8Tensor and a.device.type == "cpu":
        # The fp32 emulation below, each operand dequantized from its 2-D buffers directly.
        product = torch.matmul(
            quant_core.unchecked.dequantize_fp8(a_data, a_scale, torch.float32),
            quant_core.unchecked.dequantize_fp8(b_data, b_scale, torch.float32).t(),
        )
        if bias is not None:
            product = product + bias.float()
        return product.to(out_dtype)
    if out_dtype != torch.float32:
        out = _bf16_tensor_core_product(a, b, (a_data, a_scale), (b_data, b_scale), a_usage, b_usage, out_dtype, bias)
        if out is not None:
            return out
    product = torch.matmul(operand_values(a, a_usage), operand_values(b, b_usage).t())
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)


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


def _bf16_tensor_core_product(
    a: QuantizedTensor,
    b: QuantizedTensor,
    a_buffers: tuple[torch.Tensor, torch.Tensor],
    b_buffers: tuple[torch.Tensor, torch.Tensor],
    a_usage: Usage,
    b_usage: Usage,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """A @ B^T (+ bias) in `out_dtype` (bf16 or fp16) from bf16 tensor cores with fp32
    accumulation (the buffers: `_operand_buffers` of each operand's usage), on CUDA, where both
    operands' values are exact in bf16 ([Note: exact bf16 operands]); None elsewhere (the caller
    multiplies in fp32). Two MXFP8 or two NVFP4 operands are dequantized in one quant-core call
    (quant-core's [Note: dequantizing two operands]).

    The fp32 accumulator is rounded once to `out_dtype` after the per-tensor factors and the bias
    (in fp32). Without either the GEMM writes bf16 itself; otherwise it writes fp32 and one
    elementwise pass scales, adds and rounds (an fp32 product is 4 bytes per element written and
    read again: for MXFP8 on Hopper these passes were ~10 ms of a 0.67B Llama training step).
    NVFP4's pass is quant-core's `nvfp4_gemm_output`, which takes 1 / S from the two global amaxes
    in its kernel: no scale ops per GEMM on the host."""
    if a.device.type != "cuda":
        return None
    if isinstance(a, NVFP4Tensor) and isinstance(b, NVFP4Tensor):  # the block values, without 1 / S
        a_values, b_values = quant_core.dequantize_nvfp4_pair(
            *a_buffers,
            None,
            *b_buffers,
            None,
            a_block_shape=a.block_shape,
            b_block_shape=b.block_shape,
            dtype=torch.bfloat16,
        )
        product = torch.mm(a_values, b_values.t(), out_dtype=torch.float32)
        return quant_core.nvfp4_gemm_output(product, a.amax_of(a_usage), b.amax_of(b_usage), bias, out_dtype)
    if isinstance(a, MXFP8Tensor) and isinstance(b, MXFP8Tensor):
        a_values, b_values = quant_core.dequantize_mxfp8_pair(*a_buffers, *b_buffers, torch.bfloat16)
        a_factor = b_factor = None
    else:
        a_values, a_factor = bf16_operand(a, *a_buffers)
        b_values, b_factor = bf16_operand(b, *b_buffers)
    if a_values is None or b_values is None:
        return None
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


# [Note: exact bf16 operands] bf16 holds 8 significant bits. E4M3/E5M2 codes (<= 4), codes times a
# power of two (MXFP8's E8M0 scales, blockwise FP8 with power-of-two scales) and E2M1 codes times
# E4M3 block scales (NVFP4 without its tensor scale: <= 5 bits) are exact in bf16 (short of
# underflow below 2^-133), so a bf16 GEMM with fp32 accumulation computes the emulated product
# from the same operand values; the per-tensor fp32 factors (FP8's scale_inv, NVFP4's 1 / S) are
# multiplied together and applied to the fp32 product. It differs from the fp32 emulation by
# accumulation order and the rounding of those factors (within a few fp32 ulps before the final
# rounding to bf16).
def bf16_operand(
    t: QuantizedTensor, data: torch.Tensor, scale_inv: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bf16 values of t's buffers of one usage, per-tensor fp32 factor or None), or (None, None)
    where the values are not exact in bf16 ([Note: exact bf16 operands]); NVFP4 operands go through
    quant-core's `dequantize_nvfp4_pair` and `nvfp4_gemm_output` instead (None, None here)."""
    if isinstance(t, Float8Tensor):
        return data.to(torch.bfloat16), scale_inv
    if isinstance(t, MXFP8Tensor) or (isinstance(t, Float8BlockwiseTensor) and t.quantizer.power_2_scales):
        return t._dequantize_buffers(data, scale_inv, torch.bfloat16), None
    return None, None


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
def _hardware_scaled_mm(a, b, a_data, a_scale, b_data, b_scale, out_dtype, bias, fast_accumulation):
    if isinstance(a, Float8Tensor):
        # torch._scaled_mm refuses a bias with fp32 output: that bias is added afterwards, in fp32.
        fused_bias = bias if out_dtype != torch.float32 else None
        out = torch._scaled_mm(
            a_data,
            b_data.t(),
            scale_a=a_scale.reshape(()),
            scale_b=b_scale.reshape(()),
            bias=fused_bias,
            out_dtype=out_dtype,
            use_fast_accum=fast_accumulation,
        )
        return out if bias is None or fused_bias is not None else out + bias
    # Blockwise on Hopper (FACTS.md): scale_a (M, K/128) stored K-block-major, i.e. strides (1, M);
    # scale_b (K/128, N/128) for 128 x 128 tiles or (K/128, N) for 1 x 128 blocks, stored the same way.
    scale_a = a_scale.t().contiguous().t()
    scale_b = b_scale.t() if b.tiled else b_scale.t().contiguous()
    out = torch._scaled_mm(a_data, b_data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out if bias is None else (out.float() + bias.float()).to(out_dtype)
