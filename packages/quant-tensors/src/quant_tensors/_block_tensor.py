"""What MXFP8, blockwise FP8 and NVFP4 tensors share: four buffers laid out as quant-core's blocks.

Buffers ([Note: block layouts] in quant_core.blocks._layout): rowwise_data and rowwise_scale_inv of the
(M, K) view, columnwise_data and columnwise_scale_inv of x^T. With b x b tiles the columnwise
buffers are the exact transpose of the rowwise ones, so either follows from the other; with
1 x b blocks columnwise is quantized separately (its blocks run along M).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import quant_core
from quant_tensors._gemm import GemmOperand, emulated_mm
from quant_tensors._tensor import QuantizedTensor, matrix_shape
from quant_tensors.quantizer import Quantizer


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockScaledTensor(QuantizedTensor):
    """Base of MXFP8Tensor, Float8BlockwiseTensor and NVFP4Tensor."""

    _buffer_names: ClassVar[tuple[str, ...]] = (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
    )
    _metadata_names: ClassVar[tuple[str, ...]] = ("quantizer", "block_shape")

    block: ClassVar[int]  # block size b of 1 x b blocks and b x b tiles
    codes_per_byte: ClassVar[int] = 1
    scale_dtype: ClassVar[torch.dtype]
    format_name: ClassVar[str]

    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None
    block_shape: tuple[int, int]

    # Format hook besides _dequantize_buffers: quant-core's lossless 2-D transpose for this format.
    def _transpose_buffers(self, data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def tiled(self) -> bool:
        """True for b x b tiles (columnwise = exact transpose), False for 1 x b blocks."""
        return self.block_shape[0] > 1

    # ---- GEMM operands ([Note: GEMM operand protocol] in quant_tensors._gemm) ----------------

    def gemm_operand(self, usage: str) -> GemmOperand:
        if usage == "rowwise":
            data, scale_inv = self.rowwise_data, self.rowwise_scale_inv
            return (data if data.dim() == 2 else data.reshape(-1, data.shape[-1])), scale_inv
        return self.columnwise_data, self.columnwise_scale_inv  # 2-D already

    def _scaled_mm_takes(self, b: Any, a_rows: int, b_rows: int, k: int, capability: tuple[int, int]) -> bool:
        return False  # emulated (blockwise FP8 on Hopper overrides this)

    _emulated_mm = emulated_mm

    def _bf16_operand(self, operand: GemmOperand, usage: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None  # formats whose values bf16 holds exactly override this

    def _block_quantized(self) -> quant_core.BlockQuantized:
        """The four buffers as quant-core's BlockQuantized (what its quantize functions refill)."""
        return quant_core.BlockQuantized(
            self.rowwise_data, self.rowwise_scale_inv, self.columnwise_data, self.columnwise_scale_inv
        )

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        for wanted, present, usage in (
            (columnwise, self.columnwise_data, "columnwise"),
            (rowwise, self.rowwise_data, "rowwise"),
        ):
            if wanted and present is None and not self.tiled:
                raise ValueError(
                    f"{self.format_name} with {self.block_shape} blocks cannot derive {usage} data from the other "
                    "usage: its 1-D blocks run along different dims. Quantize with both usages instead."
                )
        if columnwise and self.columnwise_data is None:
            self.columnwise_data, self.columnwise_scale_inv = self._transpose_buffers(
                self.rowwise_data, self.rowwise_scale_inv
            )
        if rowwise and self.rowwise_data is None:
            data, self.rowwise_scale_inv = self._transpose_buffers(self.columnwise_data, self.columnwise_scale_inv)
            self.rowwise_data = data.reshape(*self.shape[:-1], data.shape[-1])
        self._drop_usages(rowwise, columnwise)

    def _row_alignment(self) -> int:
        return self.block if self.tiled or self.columnwise_data is not None else 1

    def _slice_rows(self, start: int, stop: int) -> dict[str, torch.Tensor | None]:
        b, cpb = self.block, self.codes_per_byte
        block_rows = self.block_shape[0]
        buffers: dict[str, torch.Tensor | None] = {
            "rowwise_data": None,
            "rowwise_scale_inv": None,
            "columnwise_data": None,
            "columnwise_scale_inv": None,
        }
        if self.rowwise_data is not None:
            buffers["rowwise_data"] = self.rowwise_data.reshape(-1, self.rowwise_data.shape[-1])[start:stop]
            buffers["rowwise_scale_inv"] = self.rowwise_scale_inv[start // block_rows : _ceil_div(stop, block_rows)]
        if self.columnwise_data is not None:
            buffers["columnwise_data"] = self.columnwise_data[:, start // cpb : stop // cpb]
            buffers["columnwise_scale_inv"] = self.columnwise_scale_inv[:, start // b : _ceil_div(stop, b)]
        return buffers

    @classmethod
    def _data_dtype(cls, layout: dict[str, Any]) -> torch.dtype:
        raise NotImplementedError

    @classmethod
    def _allocate_buffers(cls, shape, device, rowwise, columnwise, *, block_shape, **layout):
        M, K = matrix_shape(shape)
        b, cpb, tiled = cls.block, cls.codes_per_byte, block_shape[0] > 1
        data_dtype = cls._data_dtype(layout)
        rowwise_scales = (_ceil_div(M, block_shape[0]), _ceil_div(K, b))
        columnwise_scales = (_ceil_div(K, b), _ceil_div(M, b)) if tiled else (K, _ceil_div(M, b))
        zeros = lambda shape_, dtype: torch.zeros(shape_, dtype=dtype, device=device)  # noqa: E731
        return {
            "rowwise_data": zeros((*shape[:-1], K // cpb), data_dtype) if rowwise else None,
            "rowwise_scale_inv": zeros(rowwise_scales, cls.scale_dtype) if rowwise else None,
            "columnwise_data": zeros((K, M // cpb), data_dtype) if columnwise else None,
            "columnwise_scale_inv": zeros(columnwise_scales, cls.scale_dtype) if columnwise else None,
        }


@dataclass(frozen=True, kw_only=True)
class BlockQuantizer(Quantizer):
    """Base of the block-scaled formats' quantizers: `_quantize` runs the format's quant-core op."""

    @property
    def block_shape(self) -> tuple[int, int]:
        """(rows, columns) of one scale's block: (b, b) when tiled, else (1, b)."""
        raise NotImplementedError

    @property
    def tiled(self) -> bool:
        """b x b tiles (weights) rather than 1 x b blocks, as the made tensors' `tiled` says."""
        return self.block_shape[0] > 1

    @property
    def can_derive_columnwise(self) -> bool:
        return self.tiled

    @property
    def row_alignment(self) -> int:
        return self.tensor_class.block if self.tiled or self.columnwise else 1

    @property
    def dim_multiple(self) -> tuple[int, int]:
        block = self.tensor_class.block
        return block, block

    def _metadata(self) -> dict[str, Any]:
        return {"block_shape": self.block_shape}

    def _allocation(self) -> dict[str, Any]:
        return {"block_shape": self.block_shape}

    def _quantize_core(
        self,
        x: torch.Tensor,
        rowwise: bool,
        columnwise: bool,
        out: quant_core.BlockQuantized | None,
        amax: torch.Tensor | None,
        state: torch.Tensor | None,
    ) -> quant_core.BlockQuantized:
        raise NotImplementedError

    def _check_out(self, src: torch.Tensor, out: QuantizedTensor) -> None:
        super()._check_out(src, out)
        if tuple(out.block_shape) != self.block_shape:
            raise ValueError(f"quantize_ into {out.block_shape} blocks with a {self.block_shape} quantizer")
        for buffer in (out.rowwise_data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv):
            if buffer is not None and not buffer.is_contiguous():
                raise ValueError(
                    f"quantize_ needs contiguous destination buffers; this {type(out).__name__} is a slice whose "
                    "columnwise buffers are views (quantize the whole tensor instead)"
                )

    def _new_tensor(
        self, x: torch.Tensor, buffers: tuple[torch.Tensor | None, ...], block_shape: tuple[int, int], **extra: Any
    ) -> QuantizedTensor:
        """The tensor of x's shape and dtype holding `buffers` (rowwise data and scales, columnwise
        data and scales, as quant-core's unchecked quantizes return them), `block_shape` (this
        quantizer's) and `extra` fields."""
        rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv = buffers
        return self.tensor_class.from_buffers(
            x.shape,
            x.dtype,
            x.device,
            rowwise_data=rowwise_data,
            rowwise_scale_inv=rowwise_scale_inv,
            columnwise_data=columnwise_data,
            columnwise_scale_inv=columnwise_scale_inv,
            quantizer=self,
            block_shape=block_shape,
            **extra,
        )

    def _quantize(self, x, *, out, amax, state, usages):
        core_out = None if out is None else out._block_quantized()
        result = self._quantize_core(x, *usages, core_out, amax, state)
        per_tensor = [name for name in ("amax", "columnwise_amax") if name in self.tensor_class._buffer_names]
        if out is not None:
            for name in per_tensor:
                if getattr(out, name) is not None and getattr(result, name) is not None:
                    getattr(out, name).copy_(getattr(result, name))
            return out
        extra = {name: getattr(result, name) for name in per_tensor}
        return self.tensor_class(
            x.shape,
            x.dtype,
            rowwise_data=result.rowwise_data,
            rowwise_scale_inv=result.rowwise_scale_inv,
            columnwise_data=result.columnwise_data,
            columnwise_scale_inv=result.columnwise_scale_inv,
            quantizer=self,
            **extra,
            **self._metadata(),
        )
