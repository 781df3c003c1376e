"""NVFP4: E2M1 codes (two per byte) with E4M3 scales per 1 x 16 block or 16 x 16 tile, and a global amax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import quant_core
from quant_tensors._block_tensor import BlockQuantizer, BlockScaledTensor


class NVFP4Tensor(BlockScaledTensor):
    """NVFP4; `amax` is the global amax of the (unsharded) tensor, shared by every slice."""

    _buffer_names = (*BlockScaledTensor._buffer_names, "amax")
    block = quant_core.NVFP4_BLOCK
    codes_per_byte = 2
    scale_dtype = torch.float8_e4m3fn
    format_name = "NVFP4"

    amax: torch.Tensor

    @classmethod
    def _data_dtype(cls, layout):
        return torch.uint8

    @classmethod
    def _allocate_buffers(cls, shape, device, rowwise, columnwise, *, block_shape, **layout):
        buffers = super()._allocate_buffers(shape, device, rowwise, columnwise, block_shape=block_shape)
        return {**buffers, "amax": torch.zeros((), device=device)}

    def _slice_rows(self, start, stop):
        return {**super()._slice_rows(start, stop), "amax": self.amax}

    def _dequantize_buffers(self, data, scale_inv, dtype):
        return quant_core.dequantize_nvfp4(data, scale_inv, self.amax, self.block_shape, dtype)

    def _transpose_buffers(self, data, scale_inv):
        return quant_core.transpose_nvfp4(data, scale_inv)


@dataclass(frozen=True, kw_only=True)
class NVFP4Quantizer(BlockQuantizer):
    """NVFP4 quantizer; the global amax is the input's own unless one is passed (shards).

    With stochastic rounding the state is an int64 0-d counter of the quantizations made: call n
    rounds with the stream `seed + n`, and the counter advances in place, so two steps never reuse
    a stream and a layer loaded from a state dict continues where it stopped
    ([Note: quantizer configuration and bindings]).
    """

    tiled: bool = False
    """16 x 16 tiles (weights) instead of 1 x 16 blocks (activations and gradients)."""
    stochastic_rounding: bool = False
    """Round E2M1 stochastically (gradients); each call draws from a new counter stream."""
    seed: int = 0
    """Base of the stochastic-rounding streams; call n uses seed + n."""

    tensor_class: ClassVar[type[BlockScaledTensor]] = NVFP4Tensor
    format_name: ClassVar[str] = "NVFP4"
    per_tensor_amax: ClassVar[bool] = True

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

    def _quantize_core(self, x, rowwise, columnwise, out, amax, state):
        seed = self.seed
        if state is not None:
            seed = state + self.seed
            state.add_(1)
        return quant_core.quantize_nvfp4(
            x,
            self.block_shape,
            global_amax=amax if amax is not None or self.amax_group is None else self._measured_amax(x, None),
            rowwise=rowwise,
            columnwise=columnwise,
            stochastic_rounding=self.stochastic_rounding,
            seed=seed,
            out=out,
        )
