"""Blockwise FP8: 1 x 128 blocks (activations, gradients) or 128 x 128 tiles (weights), fp32 scales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import quant_core
from quant_tensors._block_tensor import BlockQuantizer, BlockScaledTensor


class Float8BlockwiseTensor(BlockScaledTensor):
    """Blockwise-scaled FP8; with 128 x 128 tiles columnwise is a lossless transpose of rowwise."""

    block = quant_core.BLOCKWISE_BLOCK
    scale_dtype = torch.float32
    format_name = "blockwise FP8"

    @property
    def fp8_dtype(self) -> torch.dtype:
        return (self.rowwise_data if self.rowwise_data is not None else self.columnwise_data).dtype

    @classmethod
    def _data_dtype(cls, layout):
        return layout.get("fp8_dtype", torch.float8_e4m3fn)

    def _allocation(self):
        return {"block_shape": self.block_shape, "fp8_dtype": self.fp8_dtype}

    def _dequantize_buffers(self, data, scale_inv, dtype):
        return quant_core.dequantize_fp8_blockwise(data, scale_inv, self.block_shape, dtype)

    def _transpose_buffers(self, data, scale_inv):
        return quant_core.transpose_fp8_blockwise(data, scale_inv)

    def _operand_values(self, operand, usage, dtype):
        return quant_core.unchecked.dequantize_fp8_blockwise(*operand, self.block_shape[0], dtype)

    def _bf16_operand(self, operand, usage):
        if not self.quantizer.power_2_scales:  # fmax / amax scales: values not exact in bf16
            return None, None
        return self._operand_values(operand, usage, torch.bfloat16), None

    def _scaled_mm_takes(self, b, a_rows, b_rows, k, capability):
        # Hopper's kernels: A in 1 x 128 blocks, B in 128 x 128 tiles or 1 x 128 blocks, every dim in
        # multiples of 128. With 128 x 128 tiles, torch 2.11's kernel returns wrong results (silently,
        # ~50% error) unless the reduction dim holds a multiple of 4 blocks (measured on H100,
        # docs/benchmarks.md).
        if not isinstance(b, Float8BlockwiseTensor) or capability[0] != 9 or self.tiled:
            return False
        reduction_ok = not b.tiled or k % 512 == 0
        return reduction_ok and k % 128 == 0 and b_rows % 128 == 0 and a_rows % 128 == 0

    def _torch_scaled_mm(self, a_operand, b, b_operand, out_dtype, bias, fast_accumulation):
        (a_data, a_scale), (b_data, b_scale) = a_operand, b_operand
        # scale_a (M, K/128) stored K-block-major, i.e. strides (1, M); scale_b (K/128, N/128) for
        # 128 x 128 tiles or (K/128, N) for 1 x 128 blocks, stored the same way.
        scale_a = a_scale.t().contiguous().t()
        scale_b = b_scale.t() if b.tiled else b_scale.t().contiguous()
        out = torch._scaled_mm(a_data, b_data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return out if bias is None else (out.float() + bias.float()).to(out_dtype)


@dataclass(frozen=True, kw_only=True)
class Float8BlockQuantizer(BlockQuantizer):
    """Blockwise FP8 quantizer: power-of-two scales by default, both usages in one pass."""

    tiled: bool = False
    """128 x 128 tiles (weights) instead of 1 x 128 blocks (activations and gradients)."""
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    power_2_scales: bool = True
    """Scales are powers of two (exact scaling) rather than fmax / amax."""

    tensor_class: ClassVar[type[BlockScaledTensor]] = Float8BlockwiseTensor
    format_name: ClassVar[str] = "blockwise FP8"

    @property
    def block_shape(self) -> tuple[int, int]:
        return (quant_core.BLOCKWISE_BLOCK if self.tiled else 1, quant_core.BLOCKWISE_BLOCK)

    def _allocation(self):
        return {"block_shape": self.block_shape, "fp8_dtype": self.fp8_dtype}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}")

    def _quantize(self, x, *, out, amax, state, usages):
        if out is not None:
            return super()._quantize(x, out=out, amax=amax, state=state, usages=usages)
        rowwise, columnwise = usages  # x checked by `quantize` (or qt.nn.Linear)
        block_shape = self.block_shape
        buffers = quant_core.unchecked.quantize_fp8_blockwise(
            x, block_shape[0], self.fp8_dtype, self.power_2_scales, rowwise=rowwise, columnwise=columnwise
        )
        return self._new_tensor(x, buffers, block_shape)

    def _quantize_core(self, x, rowwise, columnwise, out, amax, state):
        return quant_core.quantize_fp8_blockwise(
            x,
            self.block_shape,
            self.fp8_dtype,
            power_2_scales=self.power_2_scales,
            rowwise=rowwise,
            columnwise=columnwise,
            out=out,
        )

    def _quantize_many(self, srcs, outs, amaxes):  # block scales: amaxes is None
        quant_core.quantize_fp8_blockwise_many(
            srcs,
            [out._block_quantized() for out in outs],
            self.block_shape,
            self.fp8_dtype,
            power_2_scales=self.power_2_scales,
        )
