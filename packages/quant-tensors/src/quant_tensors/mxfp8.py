"""MXFP8: E4M3 codes in 1 x 32 blocks with E8M0 scales (rowwise along K, columnwise along M)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import quant_core
from quant_tensors._block_tensor import BlockQuantizer, BlockScaledTensor
from quant_tensors._gemm import bf16_product, emulated_mm, fp32_product


class MXFP8Tensor(BlockScaledTensor):
    """MXFP8 (1 x 32 blocks, E8M0 scales); columnwise is quantized separately, never derived."""

    block = quant_core.MXFP8_BLOCK
    scale_dtype = torch.uint8
    format_name = "MXFP8"

    @classmethod
    def _data_dtype(cls, layout):
        return torch.float8_e4m3fn

    def _dequantize_buffers(self, data, scale_inv, dtype):
        return quant_core.dequantize_mxfp8(data, scale_inv, dtype)

    def _operand_values(self, operand, usage, dtype):
        return quant_core.unchecked.dequantize_mxfp8(*operand, dtype)

    def _bf16_operand(self, operand, usage):
        return self._operand_values(operand, usage, torch.bfloat16), None  # E4M3 codes times powers of two

    def _emulated_mm(self, a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias):
        if type(b) is not MXFP8Tensor:
            return emulated_mm(self, a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias)
        # Both operands dequantized in one quant-core call ([Note: dequantizing two operands] in quant-core).
        bf16 = out_dtype != torch.float32 and self.device.type == "cuda"
        dtype = torch.bfloat16 if bf16 else torch.float32
        a_values, b_values = quant_core.unchecked.dequantize_mxfp8_pair(*a_operand, *b_operand, dtype)
        if bf16:
            return bf16_product(a_values, None, b_values, None, out_dtype, bias)
        return fp32_product(a_values, b_values, out_dtype, bias)


@dataclass(frozen=True, kw_only=True)
class MXFP8Quantizer(BlockQuantizer):
    """MXFP8 quantizer: both usages come from one pass over the input."""

    tensor_class: ClassVar[type[BlockScaledTensor]] = MXFP8Tensor
    format_name: ClassVar[str] = "MXFP8"

    @property
    def block_shape(self) -> tuple[int, int]:
        return (1, quant_core.MXFP8_BLOCK)

    def _quantize(self, x, *, out, amax, state, usages):
        if out is not None:
            return super()._quantize(x, out=out, amax=amax, state=state, usages=usages)
        rowwise, columnwise = usages  # x checked by `quantize` (or qt.nn.Linear)
        buffers = quant_core.unchecked.quantize_mxfp8(x, rowwise=rowwise, columnwise=columnwise)
        return self._new_tensor(x, buffers, self.block_shape)

    def _quantize_core(self, x, rowwise, columnwise, out, amax, state):
        return quant_core.quantize_mxfp8(x, rowwise=rowwise, columnwise=columnwise, out=out)

    def _quantize_many(self, srcs, outs, amaxes):  # block scales: amaxes is None
        quant_core.quantize_mxfp8_many(srcs, [out._block_quantized() for out in outs])
