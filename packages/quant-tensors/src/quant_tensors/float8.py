"""Per-tensor FP8: Float8Tensor and its quantizers (current and delayed scaling).

Buffers: rowwise_data (x's shape, FP8), columnwise_data ((K, M), FP8, the exact transpose) and
one scale_inv (fp32 0-d) shared by both. Columnwise follows from rowwise losslessly and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

import quant_core
from quant_tensors._gemm import GemmOperand, emulated_mm
from quant_tensors._tensor import QuantizedTensor, matrix_shape
from quant_tensors.quantizer import Quantizer

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Float8Tensor(QuantizedTensor):
    """Per-tensor scaled FP8 (current or delayed scaling); see quant_tensors.float8."""

    _buffer_names = ("rowwise_data", "columnwise_data", "scale_inv")
    _metadata_names = ("quantizer",)

    rowwise_data: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    scale_inv: torch.Tensor

    @property
    def fp8_dtype(self) -> torch.dtype:
        return (self.rowwise_data if self.rowwise_data is not None else self.columnwise_data).dtype

    def _scale_inv_of(self, usage: str) -> torch.Tensor:
        return self.scale_inv  # one scale for both usages

    def _dequantize_buffers(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return quant_core.dequantize_fp8(data, scale_inv, dtype)

    # ---- GEMM operands ([Note: GEMM operand protocol] in quant_tensors._gemm) ----------------

    def gemm_operand(self, usage: str) -> GemmOperand:
        data = self.rowwise_data if usage == "rowwise" else self.columnwise_data
        return (data if data.dim() == 2 else data.reshape(-1, data.shape[-1])), self.scale_inv

    def _scaled_mm_takes(self, b: Any, a_rows: int, b_rows: int, k: int, capability: tuple[int, int]) -> bool:
        # torch._scaled_mm's conditions (compute capability 8.9 on): K and B's rows in multiples of
        # 16, any number of A's rows (a decoding step's one token among them); not two E5M2 operands.
        if not isinstance(b, Float8Tensor) or self.fp8_dtype == b.fp8_dtype == torch.float8_e5m2:
            return False
        return k % 16 == 0 and b_rows % 16 == 0

    def _torch_scaled_mm(self, a_operand, b, b_operand, out_dtype, bias, fast_accumulation):
        (a_data, a_scale), (b_data, b_scale) = a_operand, b_operand
        # torch._scaled_mm refuses a bias with fp32 output: that bias is added afterwards, in fp32.
        fused_bias = bias if out_dtype != torch.float32 else None
        out = torch._scaled_mm(
            a_data,
            b_data.t(),
            scale_a=a_scale.reshape(()),
            scale_b=b_scale.reshape(()),
            bias=fused_bias,
            out_dtype=out_dtype,
            use_fast_accum=fast_accumulation,  # [Note: fast accumulation] in quant_tensors.ops
        )
        return out if bias is None or fused_bias is not None else out + bias

    _emulated_mm = emulated_mm

    def _operand_values(self, operand: GemmOperand, usage: str, dtype: torch.dtype) -> torch.Tensor:
        return quant_core.unchecked.dequantize_fp8(*operand, dtype)

    def _bf16_operand(self, operand: GemmOperand, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale_inv = operand
        return data.to(torch.bfloat16), scale_inv  # the codes are exact in bf16; the scale a per-tensor factor

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if columnwise and self.columnwise_data is None:
            self.columnwise_data = quant_core.transpose_fp8(self.rowwise_data)
        if rowwise and self.rowwise_data is None:
            self.rowwise_data = quant_core.transpose_fp8(self.columnwise_data).reshape(self.shape)
        self._drop_usages(rowwise, columnwise)

    def _row_alignment(self) -> int:
        return 1

    def _slice_rows(self, start: int, stop: int) -> dict[str, torch.Tensor | None]:
        rowwise = self.rowwise_data
        return {
            "rowwise_data": None if rowwise is None else rowwise.reshape(-1, rowwise.shape[-1])[start:stop],
            "columnwise_data": None if self.columnwise_data is None else self.columnwise_data[:, start:stop],
            "scale_inv": self.scale_inv,  # one scale for the whole tensor: shared by every slice
        }

    @classmethod
    def _allocate_buffers(cls, shape, device, rowwise, columnwise, *, fp8_dtype=torch.float8_e4m3fn, scale_inv=None):
        M, K = matrix_shape(shape)
        return {
            "rowwise_data": torch.zeros(shape, dtype=fp8_dtype, device=device) if rowwise else None,
            "columnwise_data": torch.zeros((K, M), dtype=fp8_dtype, device=device) if columnwise else None,
            # A per-tensor scale carries over (so slices of a new tensor agree), unless it lives elsewhere.
            "scale_inv": scale_inv.clone()
            if scale_inv is not None and scale_inv.device == device
            else torch.ones((), device=device),
        }

    def _allocation(self) -> dict[str, Any]:
        return {"fp8_dtype": self.fp8_dtype, "scale_inv": self.scale_inv}


@dataclass(frozen=True, kw_only=True)
class Float8Quantizer(Quantizer):
    """Per-tensor FP8 with current scaling: scale = fmax / amax of the tensor being quantized."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    power_2_scales: bool = False
    """Round each scale down to a power of two."""

    tensor_class: ClassVar[type[QuantizedTensor]] = Float8Tensor
    format_name: ClassVar[str] = "per-tensor FP8"
    per_tensor_amax: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_dtype not in _FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}")

    @property
    def dim_multiple(self) -> tuple[int, int]:
        return 16, 16  # torch._scaled_mm's requirement

    @property
    def can_derive_columnwise(self) -> bool:
        return True

    def _allocation(self) -> dict[str, Any]:
        return {"fp8_dtype": self.fp8_dtype}

    def _quantize(self, x, *, out, amax, state, usages):
        if out is None and amax is None and self.amax_group_name is None:  # checked by `quantize`: the hot path
            rowwise_data, columnwise_data, scale_inv, _ = self._quantize_unchecked(x, state, usages, None)
            return self._tensor(x, rowwise_data, columnwise_data, scale_inv)
        amax = self._amax_to_scale_with(x, amax)
        if out is None:
            quantized = self._quantize_fp8(x, amax, state, usages)
            return self._tensor(x, quantized.rowwise_data, quantized.columnwise_data, quantized.scale_inv)
        if out.fp8_dtype != self.fp8_dtype:
            raise ValueError(f"quantize_ into a {out.fp8_dtype} Float8Tensor with a {self.fp8_dtype} quantizer")
        self._quantize_fp8_into(
            x,
            amax,
            state,
            rowwise_out=None if out.rowwise_data is None else _contiguous_target(out.rowwise_data),
            columnwise_out=None if out.columnwise_data is None else _contiguous_target(out.columnwise_data),
            scale_inv_out=out.scale_inv,
        )
        return out

    def _quantize_many(self, srcs, outs, amaxes):
        # Given amaxes, current scaling's scales are one fp8_scale call for all the sources (what
        # each quantize_'s fused operator computes from its amax), then the casts: one
        # cast_to_fp8_many call where every out holds rowwise data only (sharded weights), else
        # one cast per source.
        if amaxes is None or not self.stateless or any(out.fp8_dtype != self.fp8_dtype for out in outs):
            return super()._quantize_many(srcs, outs, amaxes)
        if isinstance(amaxes, torch.Tensor):
            stacked = amaxes.reshape(-1).float()
        else:
            stacked = torch.stack([amax.reshape(()).float() for amax in amaxes])
        scales, scales_inv = quant_core.fp8_scale(stacked, self.fp8_dtype, power_2_scales=self.power_2_scales)
        if all(out.columnwise_data is None for out in outs):
            rowwise_outs = [_contiguous_target(out.rowwise_data) for out in outs]
            quant_core.cast_to_fp8_many(list(srcs), scales, self.fp8_dtype, rowwise_outs)
            torch._foreach_copy_([out.scale_inv for out in outs], list(scales_inv.unbind()))
            return None
        for src, out, scale in zip(srcs, outs, scales.unbind(), strict=True):
            rowwise_out = None if out.rowwise_data is None else _contiguous_target(out.rowwise_data)
            columnwise_out = None if out.columnwise_data is None else _contiguous_target(out.columnwise_data)
            quant_core.cast_to_fp8(
                src,
                scale,
                self.fp8_dtype,
                rowwise=rowwise_out is not None,
                columnwise=columnwise_out is not None,
                rowwise_out=rowwise_out,
                columnwise_out=columnwise_out,
            )
        torch._foreach_copy_([out.scale_inv for out in outs], list(scales_inv.unbind()))
        return None

    @property
    def recasts_columnwise(self) -> bool:
        return True  # with the forward's scale, whatever the amax history did since

    def quantize_recastable(
        self, x: torch.Tensor, *, state: torch.Tensor | None = None
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]]:
        # [Note: weights recast in backward]: the key is the scale (and its inverse) x was cast with.
        self._check_input(x)
        return self._quantize_recastable(x, self._state_for(x, state))

    def _quantize_recastable(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]]:
        """`quantize_recastable` of checked input x with `state` (the one to use, not None for a
        stateful quantizer)."""
        if self.amax_group_name is not None:
            quantized = self._quantize_fp8(x, self._amax_to_scale_with(x, None), state, (True, False))
            rowwise = self._tensor(x, quantized.rowwise_data, None, quantized.scale_inv)
            return rowwise, (quantized.scale, quantized.scale_inv)
        scale = torch.empty(1, dtype=torch.float32, device=x.device).view(())  # as quant-core's `new_scalar`
        rowwise_data, _, scale_inv, scale = self._quantize_unchecked(x, state, (True, False), scale)
        return self._tensor(x, rowwise_data, None, scale_inv), (scale, scale_inv)

    def _recast_columnwise(self, x: torch.Tensor, key: tuple[torch.Tensor, ...]) -> QuantizedTensor:
        scale, scale_inv = key  # made by `_quantize_recastable` with x, on its device
        _, columnwise = quant_core.unchecked.cast_to_fp8(x, scale, self.fp8_dtype, rowwise=False, columnwise=True)
        return self._tensor(x, None, columnwise, scale_inv)

    def _amax_to_scale_with(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor | None:
        """The amax given, or x's agreed over `amax_group`; None lets quant-core's one fused
        operator measure it ([Note: fused FP8 quantize] in quant_core)."""
        return self._measured_amax(x, amax) if amax is not None or self.amax_group is not None else None

    def _tensor(self, x, rowwise_data, columnwise_data, scale_inv) -> Float8Tensor:
        return Float8Tensor.from_buffers(
            x.shape,
            x.dtype,
            x.device,
            rowwise_data=rowwise_data,
            columnwise_data=columnwise_data,
            scale_inv=scale_inv,
            quantizer=self,
        )

    def _quantize_fp8(self, x, amax, state, usages) -> quant_core.Float8Quantized:
        rowwise, columnwise = usages
        return quant_core.quantize_fp8(
            x, self.fp8_dtype, power_2_scales=self.power_2_scales, rowwise=rowwise, columnwise=columnwise, amax=amax
        )

    def _quantize_fp8_into(self, x, amax, state, **buffers) -> None:
        quant_core.quantize_fp8_into(x, self.fp8_dtype, power_2_scales=self.power_2_scales, amax=amax, **buffers)

    def _quantize_unchecked(self, x, state, usages, scale):
        """(rowwise data, columnwise data, scale_inv, scale) of checked input x, scaled with its own
        amax (no amax group bound), from quant-core's unchecked entry point; `scale` (fp32 0-d) is
        filled if given."""
        rowwise, columnwise = usages
        return quant_core.unchecked.quantize_fp8(
            x, None, self.fp8_dtype, self.power_2_scales, rowwise, columnwise, scale=scale
        )


def _contiguous_target(buffer: torch.Tensor) -> torch.Tensor:
    if not buffer.is_contiguous():
        raise ValueError(
            "quantize_ needs contiguous destination buffers; a sliced columnwise view is not (quantize the whole tensor)"
        )
    return buffer


AmaxComputeAlgo = Literal["max", "most_recent"]


@dataclass(frozen=True, kw_only=True)
class Float8DelayedQuantizer(Float8Quantizer):
    """Per-tensor FP8 with delayed scaling: the scale comes from earlier amaxes (the history).

    Each quantize scales with fmax / amax(history) / 2^margin, then pushes the amax it measured.
    The history is the quantizer's state: fp32 (amax_history_len,), newest first, zeros at the
    start (scale 1 until an amax is seen) ([Note: quantizer configuration and bindings]).
    """

    amax_history_len: int = 16
    """Steps of amax kept."""
    amax_compute_algo: AmaxComputeAlgo = "max"
    """How the history becomes one amax: its max or its most recent entry."""
    margin: int = 0
    """Extra headroom: the scale is divided by 2^margin."""

    format_name: ClassVar[str] = "per-tensor FP8 (delayed scaling)"

    @property
    def stateless(self) -> bool:
        return False  # the scale comes from the amax history

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= 127:
            # 2^margin must be an exact fp32 power of two
            raise ValueError(f"margin must be an int in [0, 127], got {self.margin}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        super().__post_init__()

    @property
    def amax_history(self) -> torch.Tensor:
        """The bound amax history (this quantizer's state)."""
        return self.state

    def new_state(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.zeros(self.amax_history_len, dtype=torch.float32, device=device)

    def _quantize_fp8(self, x, amax, state, usages) -> quant_core.Float8Quantized:
        rowwise, columnwise = usages
        return quant_core.quantize_fp8_delayed(
            x, state, self.fp8_dtype, rowwise=rowwise, columnwise=columnwise, amax=amax, **self._delayed_options()
        )

    def _quantize_fp8_into(self, x, amax, state, **buffers) -> None:
        quant_core.quantize_fp8_delayed_into(x, state, self.fp8_dtype, amax=amax, **self._delayed_options(), **buffers)

    def _quantize_unchecked(self, x, state, usages, scale):
        # The history may be any tensor a caller passed as `state=` (or bound): quant-core's checked
        # function takes one that is not quant-core's unchecked contract, and raises naming the problem.
        if (
            state.dtype != torch.float32
            or state.device != x.device
            or state.dim() != 1
            or not state.is_contiguous()
            or state.numel() == 0
        ):
            quantized = self._quantize_fp8(x, None, state, usages)
            return quantized.rowwise_data, quantized.columnwise_data, quantized.scale_inv, quantized.scale
        rowwise, columnwise = usages
        return quant_core.unchecked.quantize_fp8_delayed(
            x,
            None,
            state,
            self.fp8_dtype,
            self.margin,
            self.power_2_scales,
            self.amax_compute_algo,
            rowwise,
            columnwise,
            scale=scale,
        )

    def _delayed_options(self) -> dict[str, Any]:
        return {
            "margin": self.margin,
            "power_2_scales": self.power_2_scales,
            "amax_compute_algo": self.amax_compute_algo,
        }
