"""Per-tensor FP8 scales (docs/design.md, 'Numerics'): current scaling from an amax, delayed scaling from an
amax history, each an operator with a reference, a C++ and a Triton kernel.

[Note: FP8 scale arithmetic] scale = fmax / amax / 2^margin, each division one IEEE fp32 division
(`_numerics.divide`; 2^margin is an exact power of two for margin in [-126, 127], so dividing by it
rounds once, exactly as multiplying by 2^-margin would), 1 unless amax > 0 (so a NaN or zero amax
gives 1), clamped to the largest finite fp32, with `power_2_scales` rounded down to a power of two
by keeping the exponent bits; scale_inv = 1 / scale. On CUDA this arithmetic is a Triton kernel
with `tl.div_rn` (never Inductor's code for the traced torch ops, whose `/` need not be IEEE) and
one launch instead of six.

Delayed scaling: the scale of step t comes from the history of earlier amaxes (its max, or its
most recent entry, index 0); then the history shifts one step older (the oldest entry drops) and
the amax of step t is written at index 0. `delayed_fp8_scale_` does both in one operator.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.fp8_scale.default(amax, fmax, margin, power_2_scales) -> (Tensor, Tensor)`: amax
  fp32 of any shape, fmax > 0 an fp32 value, margin in [-126, 127]. Returns contiguous
  (scale, scale_inv) of amax's shape, elementwise.
- `torch.ops.quant_core.delayed_fp8_scale.default(amax_history, amax, fmax, margin, power_2_scales,
  amax_compute_algo) -> (Tensor, Tensor)`: amax_history contiguous non-empty 1-D fp32, amax a
  one-element fp32 tensor on its device not aliasing it, amax_compute_algo "max" or "most_recent".
  Returns fp32 0-d (scale, scale_inv) of the history before the call and updates the history.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel, with_contiguous
from quant_core.shared._checks import check_fp8_dtype, check_scalar
from quant_core.shared._cpp import _C
from quant_core.shared._numerics import FLOAT32_MAX, divide

AmaxComputeAlgo = Literal["max", "most_recent"]
# The largest finite value of each FP8 dtype (torch.finfo(dtype).max, looked up without finfo).
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# 2^margin is a normal fp32 power of two in this range ([Note: FP8 scale arithmetic]).
MARGIN_RANGE = (-126, 127)
_FLOAT32_EXPONENT_MASK = 0x7F800000


def check_margin(margin: object) -> int:
    """Checks that `margin` is an int in MARGIN_RANGE; returns it."""
    low, high = MARGIN_RANGE
    if isinstance(margin, bool) or not isinstance(margin, int) or not low <= margin <= high:
        raise ValueError(f"margin must be an int in [{low}, {high}] (the scale is divided by 2^margin), got {margin!r}")
    return margin


def check_amax_history(amax_history: object, *, in_place: bool = False) -> torch.Tensor:
    """Checks that `amax_history` is a non-empty 1-D float32 tensor (contiguous if a kernel updates
    it `in_place`); returns it."""
    if (
        not isinstance(amax_history, torch.Tensor)
        or amax_history.dim() != 1
        or amax_history.numel() == 0
        or amax_history.dtype != torch.float32
    ):
        got = (
            f"{amax_history.dtype} tensor of shape {tuple(amax_history.shape)}"
            if isinstance(amax_history, torch.Tensor)
            else type(amax_history).__name__
        )
        raise ValueError(
            f"amax_history must be a non-empty 1-D float32 tensor, got {got} "
            "(make one with torch.zeros(history_len, dtype=torch.float32))"
        )
    if in_place and not amax_history.is_contiguous():
        raise ValueError("amax_history must be contiguous (kernels update it in place); pass a contiguous tensor")
    return amax_history


def check_amax_compute_algo(amax_compute_algo: object) -> AmaxComputeAlgo:
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
    return amax_compute_algo  # type: ignore[return-value]


# ---- current scaling ------------------------------------------------------------------------------


def fp8_scale_reference(
    amax: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0, power_2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `fp8_scale` ([Note: FP8 scale arithmetic])."""
    return _scale_reference(amax.float(), FP8_MAX[fp8_dtype], margin, power_2_scales)


def _scale_reference(
    amax: torch.Tensor, fmax: float, margin: int, power_2_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    quotient = divide(fmax, amax)
    if margin:
        quotient = quotient / 2.0**margin
    scale = torch.where(amax > 0, quotient, 1.0).clamp(max=FLOAT32_MAX)
    if power_2_scales:
        # Keep the exponent bits only: the largest power of two <= scale (scale is normal here).
        scale = (scale.view(torch.int32) & _FLOAT32_EXPONENT_MASK).view(torch.float32)
    return scale, torch.reciprocal(scale)


def fp8_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0, power_2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv): scale = fmax / amax / 2^margin (1 if amax is 0), elementwise.

    A scale that overflows fp32 (tiny amax) is clamped to the largest finite fp32; with
    `power_2_scales` it is rounded down to a power of two, so scaling is exact. One operator on
    amax's device (no host sync); [Note: FP8 scale arithmetic].

    Args:
        amax: fp32/bf16/fp16 tensor of amaxes (any shape; converted to fp32).
        fp8_dtype: torch.float8_e4m3fn (fmax 448) or torch.float8_e5m2 (fmax 57344).
        margin: int in [-126, 127]; the scale is divided by 2^margin.
    """
    check_fp8_dtype(fp8_dtype)
    check_margin(margin)
    if not isinstance(amax, torch.Tensor):
        raise ValueError(f"amax must be a tensor, got {type(amax).__name__}")
    return call("fp8_scale", amax.float(), FP8_MAX[fp8_dtype], margin, power_2_scales)


class Fp8ScaleArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.fp8_scale` ([Note: operator arguments])."""

    amax: torch.Tensor
    fmax: float
    margin: int
    power_2_scales: bool


def _fp8_scale_fake(args: Fp8ScaleArgs) -> tuple[torch.Tensor, torch.Tensor]:
    return args.amax.new_empty(args.amax.shape), args.amax.new_empty(args.amax.shape)


@define_op("fp8_scale", Fp8ScaleArgs, fake=_fp8_scale_fake)
def _fp8_scale_op(kernel: Kernel, args: Fp8ScaleArgs) -> tuple[torch.Tensor, torch.Tensor]:
    args = with_contiguous(args, "amax")
    scale, scale_inv = torch.empty_like(args.amax), torch.empty_like(args.amax)
    if args.amax.numel() > 0:
        kernel(args, scale, scale_inv)
    return scale, scale_inv


@register_kernel("fp8_scale", "reference")
def _fp8_scale_reference_kernel(args: Fp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Kernel contract: args.amax contiguous fp32; scale and scale_inv contiguous fp32 of its shape."""
    want_scale, want_scale_inv = _scale_reference(args.amax, args.fmax, args.margin, args.power_2_scales)
    scale.copy_(want_scale)
    scale_inv.copy_(want_scale_inv)


# ---- delayed scaling ------------------------------------------------------------------------------


def amax_from_history(amax_history: torch.Tensor, amax_compute_algo: AmaxComputeAlgo = "max") -> torch.Tensor:
    """The amax a delayed scale uses: the history's max, or its most recent entry (index 0)."""
    check_amax_history(amax_history)
    check_amax_compute_algo(amax_compute_algo)
    if amax_compute_algo == "max":
        return amax_history.max()
    return amax_history[0].clone()


def push_amax_(amax_history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Shifts the history one step older (dropping the oldest) and writes `amax` at index 0, in place."""
    check_amax_history(amax_history)
    pushed = amax.reshape(()).to(torch.float32, copy=True)  # read before the history moves
    amax_history.copy_(torch.roll(amax_history, 1))
    amax_history[0] = pushed
    return amax_history


def delayed_fp8_scale_reference(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    power_2_scales: bool = False,
    amax_compute_algo: AmaxComputeAlgo = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `delayed_fp8_scale_`: the scale of the history as it is, then `amax` pushed into it."""
    return _delayed_scale_reference(
        amax_history, amax, FP8_MAX[fp8_dtype], margin, power_2_scales, amax_compute_algo == "most_recent"
    )


def _delayed_scale_reference(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    fmax: float,
    margin: int,
    power_2_scales: bool,
    most_recent: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    history_amax = amax_from_history(amax_history, "most_recent" if most_recent else "max")
    scale, scale_inv = _scale_reference(history_amax, fmax, margin, power_2_scales)
    push_amax_(amax_history, amax)
    return scale, scale_inv


def delayed_fp8_scale_(
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    margin: int = 0,
    power_2_scales: bool = False,
    amax_compute_algo: AmaxComputeAlgo = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling in one operator: (scale, scale_inv) from the history, then `amax` pushed.

    The scale is that of `fp8_scale(amax_from_history(amax_history, amax_compute_algo), ...)` for the
    history as it was before the call; then the history shifts one step older in place (the
    oldest entry drops) and `amax` is written at index 0 (`push_amax_`).

    Args:
        amax_history: contiguous fp32 (history_len,), newest first; updated in place.
        amax: one-element fp32 tensor on the history's device: this step's (all-reduced) amax.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2 (sets fmax).
        margin: int in [-126, 127]; the scale is divided by 2^margin.
        power_2_scales: round the scale down to a power of two.
        amax_compute_algo: "max" (of the history) or "most_recent" (its entry 0).
    Returns:
        fp32 0-d (scale, scale_inv) on the history's device.
    """
    check_amax_history(amax_history, in_place=True)
    check_scalar(amax, "amax", amax_history.device)
    check_fp8_dtype(fp8_dtype)
    check_margin(margin)
    check_amax_compute_algo(amax_compute_algo)
    return call("delayed_fp8_scale", amax_history, amax, FP8_MAX[fp8_dtype], margin, power_2_scales, amax_compute_algo)


class DelayedFp8ScaleArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.delayed_fp8_scale` ([Note: operator arguments])."""

    amax_history: torch.Tensor
    amax: torch.Tensor
    fmax: float
    margin: int
    power_2_scales: bool
    amax_compute_algo: str


def _delayed_fp8_scale_fake(args: DelayedFp8ScaleArgs) -> tuple[torch.Tensor, torch.Tensor]:
    return args.amax_history.new_empty(()), args.amax_history.new_empty(())


@define_op("delayed_fp8_scale", DelayedFp8ScaleArgs, mutates_args=("amax_history",), fake=_delayed_fp8_scale_fake)
def _delayed_fp8_scale_op(kernel: Kernel, args: DelayedFp8ScaleArgs) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.empty((), dtype=torch.float32, device=args.amax_history.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=args.amax_history.device)
    kernel(args, scale, scale_inv)
    return scale, scale_inv


@register_kernel("delayed_fp8_scale", "reference")
def _delayed_fp8_scale_reference_kernel(
    args: DelayedFp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor
) -> None:
    """Kernel contract: the operator's, with scale and scale_inv fp32 0-d (or one-element) buffers."""
    want_scale, want_scale_inv = _delayed_scale_reference(
        args.amax_history,
        args.amax,
        args.fmax,
        args.margin,
        args.power_2_scales,
        args.amax_compute_algo == "most_recent",
    )
    scale.copy_(want_scale.reshape(scale.shape))
    scale_inv.copy_(want_scale_inv.reshape(scale_inv.shape))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("fp8_scale", "cpp")
def _fp8_scale_cpp(args: Fp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    amax = args.amax
    _C.fp8_scale(
        amax.data_ptr(),
        amax.numel(),
        args.fmax,
        args.margin,
        args.power_2_scales,
        scale.data_ptr(),
        scale_inv.data_ptr(),
    )


@register_kernel("delayed_fp8_scale", "cpp")
def _delayed_fp8_scale_cpp(args: DelayedFp8ScaleArgs, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    _C.delayed_fp8_scale(
        args.amax_history.data_ptr(),
        args.amax_history.numel(),
        args.amax.data_ptr(),
        args.fmax,
        args.margin,
        args.power_2_scales,
        args.amax_compute_algo == "most_recent",
        scale.data_ptr(),
        scale_inv.data_ptr(),
    )
