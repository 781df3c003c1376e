"""NVFP4: E2M1 codes (two per byte) with E4M3 scales per 1 x 16 block or 16 x 16 tile, and a global amax.

[Note: NVFP4 wgrad operands with the random Hadamard transform] With
`NVFP4BlockScaling(random_hadamard_transform=True)` the "input" and "grad_output" quantizers
quantize the columnwise usage (the wgrad operands x^T and dy^T, blocks of 16 along M) as T(x^T):
the 16 x 16 random Hadamard transform along M, with the signs of the recipe's `hadamard_seed`
(one seed for both quantizers, so T(dy^T) T(x^T)^T = dy^T x), computed in fp32 and scaled by its
own amax, amax(T(x^T)) (quant_core [Note: NVFP4 random Hadamard transform]). Rowwise usages and
weights are unchanged. An NVFP4Tensor then holds
- `amax`: amax(x), the rowwise usage's tensor scale (as without the transform);
- `columnwise_amax`: amax(T(x^T)), the columnwise usage's (0-d; None without the transform, and
  dropped with the columnwise usage);
- `hadamard_seed`: metadata, the seed of the transform its columnwise usage holds (None: x^T).
Consequences:
- The wgrad GEMM multiplies the transformed operands as they are (quant_tensors.ops: the
  emulated GEMM dequantizes the codes; no inverse is needed), and refuses operands whose
  columnwise usages hold different transforms (one transformed, one not, or other seeds).
- `dequantize()` reads rowwise data when present; a columnwise-only transformed tensor is
  dequantized to T(x^T) in fp32, mapped back by the inverse T^-1 = T^T in fp32, then rounded:
  values approximating x, with the error of the transformed quantization.
- The transform mixes runs of 16 rows, so the columnwise usage needs M a multiple of 16 (a
  ValueError names the fix otherwise); rowwise-only quantization (inference) takes any M.
- Per-tensor agreement over a group (`amax_group`: tensor and sequence parallelism) covers both
  amaxes, all-reduced in one collective; `local_amax(x)` gives both, in one read of x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

import quant_core
from quant_tensors._block_tensor import BlockQuantizer, BlockScaledTensor
from quant_tensors._gemm import emulated_mm, fp32_product
from quant_tensors._tensor import QuantizedTensor


class NVFP4Tensor(BlockScaledTensor):
    """NVFP4; `amax` is the global amax of the (unsharded) tensor, shared by every slice;
    `columnwise_amax` and `hadamard_seed`: [Note: NVFP4 wgrad operands with the random Hadamard transform]."""

    _buffer_names = (*BlockScaledTensor._buffer_names, "amax", "columnwise_amax")
    _metadata_names = (*BlockScaledTensor._metadata_names, "hadamard_seed")
    block = quant_core.NVFP4_BLOCK
    codes_per_byte = 2
    scale_dtype = torch.float8_e4m3fn
    format_name = "NVFP4"

    amax: torch.Tensor
    columnwise_amax: torch.Tensor | None
    hadamard_seed: int | None

    @classmethod
    def _data_dtype(cls, layout):
        return torch.uint8

    @classmethod
    def _allocate_buffers(cls, shape, device, rowwise, columnwise, *, block_shape, hadamard_seed=None, **layout):
        buffers = super()._allocate_buffers(shape, device, rowwise, columnwise, block_shape=block_shape)
        transformed = columnwise and hadamard_seed is not None
        return {
            **buffers,
            "amax": torch.zeros((), device=device),
            "columnwise_amax": torch.zeros((), device=device) if transformed else None,
        }

    def _slice_rows(self, start, stop):
        return {**super()._slice_rows(start, stop), "amax": self.amax, "columnwise_amax": self.columnwise_amax}

    def amax_of(self, usage: str) -> torch.Tensor:
        """The amax of a usage's tensor scale: `columnwise_amax` for a transformed columnwise usage, else `amax`."""
        if usage == "columnwise" and self.hadamard_seed is not None:
            return self.columnwise_amax
        return self.amax

    def _transform_of(self, usage: str) -> int | None:
        return self.hadamard_seed if usage == "columnwise" else None

    def _dequantize_buffers(self, data, scale_inv, dtype):
        return quant_core.dequantize_nvfp4(data, scale_inv, self.amax, self.block_shape, dtype)

    def _usage_values(self, usage, dtype):
        data, scale_inv = self.usage_buffers(usage)
        return quant_core.dequantize_nvfp4(data, scale_inv, self.amax_of(usage), self.block_shape, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values, as `dtype` (default: the nominal dtype): rowwise data if present,
        else the columnwise usage transposed back, through the inverse transform where it holds
        T(x^T) ([Note: NVFP4 wgrad operands with the random Hadamard transform])."""
        if self.hadamard_seed is None or self.rowwise_data is not None:
            return super().dequantize(dtype)
        self._check_not_flat("dequantize")
        values = quant_core.hadamard_inverse_16(self._usage_values("columnwise", torch.float32), self.hadamard_seed)
        return values.t().reshape(self.shape).to(dtype or self.dtype)

    def _transpose_buffers(self, data, scale_inv):
        return quant_core.transpose_nvfp4(data, scale_inv)

    def gemm_operand(self, usage):
        """(2-D codes, block scales, the usage's amax): `amax_of(usage)` travels with the operand."""
        if usage == "rowwise":
            data = self.rowwise_data
            return data if data.dim() == 2 else data.reshape(-1, data.shape[-1]), self.rowwise_scale_inv, self.amax
        amax = self.columnwise_amax if self.hadamard_seed is not None else self.amax  # `amax_of`, inline
        return self.columnwise_data, self.columnwise_scale_inv, amax

    def _operand_values(self, operand, usage, dtype):
        data, scale_inv, amax = operand
        return quant_core.unchecked.dequantize_nvfp4(data, scale_inv, self.block_shape[0], amax, dtype)

    def _emulated_mm(self, a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias):
        """Two NVFP4 operands dequantized in one quant-core call ([Note: dequantizing two operands] in
        quant-core). On CUDA with a bf16/fp16 output: their block values without 1 / S (exact in
        bf16, [Note: exact bf16 operands] in quant_tensors.ops) on bf16 tensor cores, then quant-core's
        `nvfp4_gemm_output`, which takes 1 / S from the two global amaxes in its kernel: no scale ops
        per GEMM on the host."""
        if type(b) is not NVFP4Tensor:
            return emulated_mm(self, a_operand, a_usage, b, b_operand, b_usage, out_dtype, bias)
        (a_data, a_scale, a_amax), (b_data, b_scale, b_amax) = a_operand, b_operand
        a_rows, b_rows = self.block_shape[0], b.block_shape[0]
        if out_dtype != torch.float32 and self.device.type == "cuda":
            a_values, b_values = quant_core.unchecked.dequantize_nvfp4_pair(
                a_data, a_scale, b_data, b_scale, a_rows, None, b_rows, None, torch.bfloat16
            )
            product = torch.mm(a_values, b_values.t(), out_dtype=torch.float32)
            return quant_core.unchecked.nvfp4_gemm_output(product, a_amax, b_amax, bias, out_dtype)
        a_values, b_values = quant_core.unchecked.dequantize_nvfp4_pair(
            a_data, a_scale, b_data, b_scale, a_rows, a_amax, b_rows, b_amax, torch.float32
        )
        return fp32_product(a_values, b_values, out_dtype, bias)


@dataclass(frozen=True, kw_only=True)
class NVFP4Quantizer(BlockQuantizer):
    """NVFP4 quantizer; the global amax is the input's own unless one is passed (shards).

    With stochastic rounding the state is an int64 0-d counter of the quantizations made: the n-th
    quantization rounds with the stream `seed + n`, and the counter advances in place, so two steps never reuse
    a stream and a layer loaded from a state dict continues where it stopped
    ([Note: quantizer configuration and bindings]). With the random Hadamard transform the
    columnwise usage holds T(x^T) ([Note: NVFP4 wgrad operands with the random Hadamard transform]).
    """

    tiled: bool = False
    """16 x 16 tiles (weights) instead of 1 x 16 blocks (activations and gradients)."""
    stochastic_rounding: bool = False
    """Round E2M1 stochastically (gradients); each call draws from a new counter stream."""
    seed: int = 0
    """Base of the stochastic-rounding streams; the n-th quantization uses seed + n."""
    random_hadamard_transform: bool = False
    """Quantize the columnwise usage as T(x^T), the 16 x 16 random Hadamard transform along M (1 x 16 blocks only)."""
    hadamard_seed: int = 0
    """Seed of the transform's 16 random signs (`quant_core.hadamard_signs`); both wgrad operands need the same."""

    tensor_class: ClassVar[type[BlockScaledTensor]] = NVFP4Tensor
    format_name: ClassVar[str] = "NVFP4"
    per_tensor_amax: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.random_hadamard_transform and self.tiled:
            raise ValueError(
                "random_hadamard_transform applies to NVFP4's 1 x 16 columnwise blocks (inputs and gradients); "
                "16 x 16 tiles (weights) take their columnwise usage by a lossless transpose: use tiled=False or "
                "random_hadamard_transform=False"
            )

    @property
    def stateless(self) -> bool:
        return not self.stochastic_rounding  # each stochastic quantize draws from the next stream

    @property
    def block_shape(self) -> tuple[int, int]:
        return (quant_core.NVFP4_BLOCK if self.tiled else 1, quant_core.NVFP4_BLOCK)

    @property
    def calls(self) -> int:
        """Stochastic quantizations made so far with the bound state (0 without stochastic rounding)."""
        return 0 if self.state is None else int(self.state)

    def new_state(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        return torch.zeros((), dtype=torch.int64, device=device) if self.stochastic_rounding else None

    def _quantize_recastable(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]]:
        quantized = self._quantize(x, out=None, amax=None, state=state, usages=(True, False))
        if self.random_hadamard_transform:  # the columnwise usage has an amax of its own, unknown yet
            return quantized, ()
        return quantized, (quantized.amax,)  # the recast scales with the forward's global amax

    def _metadata(self) -> dict[str, object]:
        return {**super()._metadata(), "hadamard_seed": self.hadamard_seed if self.random_hadamard_transform else None}

    def _allocation(self) -> dict[str, object]:
        return self._metadata()

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        """x's own amax, or with the transform the fp32 (2,) [amax(x), amax(T(x^T))] in one read
        (partial runs of 16 zero-padded); what `quantize(x, amax=...)` takes once all-reduced."""
        if not self.random_hadamard_transform:
            return super().local_amax(x)
        return quant_core.hadamard_amaxes(x, self.hadamard_seed)

    def _amaxes(
        self, x: torch.Tensor, amax: torch.Tensor | None, transform: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(global amax, columnwise amax) to quantize with: the given ones, else agreed over
        `amax_group` (both in one all-reduce), else (None, None): quant-core measures them."""
        if amax is None and self.amax_group is None:
            return None, None
        if amax is None:
            amax = quant_core.hadamard_amaxes(x, self.hadamard_seed) if transform else quant_core.amax(x).reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_group)
        amax = amax.float().reshape(-1)
        if transform and amax.numel() != 2:
            raise ValueError(
                f"NVFP4 with random_hadamard_transform scales its columnwise usage by amax(T(x^T)): quantize(x, amax=...) "
                f"needs both amaxes, [amax(x), amax(T(x^T))] (quantizer.local_amax(x), all-reduced), got "
                f"{amax.numel()} value(s)"
            )
        return amax[0], amax[1] if transform else None

    def _quantize(self, x, *, out, amax, state, usages):
        rowwise, columnwise = usages
        if (
            out is not None
            or x.dim() != 2
            or x.shape[1] % 2
            or (columnwise and x.shape[0] % 2)  # odd dims: the checked path explains how to pack them
            or self.amax_group_name is not None
            or self.random_hadamard_transform
            or (state is None and self.stochastic_rounding)
            or (amax is not None and (amax.dtype != torch.float32 or amax.numel() != 1 or amax.device != x.device))
        ):
            return super()._quantize(x, out=out, amax=amax, state=state, usages=usages)
        # The lean path: a 2-D x checked by `quantize` (or qt.nn.Linear), its own amax or a given one.
        if state is None:
            seed = torch.zeros((), dtype=torch.int64)  # read only with stochastic rounding
        else:
            seed = state + self.seed
            state.add_(1)
        if amax is not None:
            global_amax = amax.reshape(())
        elif quant_core.compiling():  # torch ops, which Inductor fuses into the kernel producing x
            global_amax = quant_core.amax_torch_ops(x)
        else:
            global_amax = quant_core.unchecked.amax(x)
        block_shape = (
            quant_core.NVFP4_BLOCK if self.tiled else 1,
            quant_core.NVFP4_BLOCK,
        )  # as the property, a call less
        buffers = quant_core.unchecked.quantize_nvfp4(
            x,
            block_shape[0],
            global_amax,
            self.stochastic_rounding,
            seed,
            global_amax,
            None,
            rowwise=rowwise,
            columnwise=columnwise,
        )
        return self._new_tensor(x, buffers, block_shape, amax=global_amax)

    def _quantize_core(self, x, rowwise, columnwise, out, amax, state):
        seed = self.seed
        if state is not None:
            seed = state + self.seed
            state.add_(1)
        transform = self.random_hadamard_transform and columnwise
        global_amax, columnwise_amax = self._amaxes(x, amax, transform)
        return quant_core.quantize_nvfp4(
            x,
            self.block_shape,
            global_amax=global_amax,
            rowwise=rowwise,
            columnwise=columnwise,
            stochastic_rounding=self.stochastic_rounding,
            seed=seed,
            hadamard_seed=self.hadamard_seed if transform else None,
            columnwise_amax=columnwise_amax,
            out=out,
        )
