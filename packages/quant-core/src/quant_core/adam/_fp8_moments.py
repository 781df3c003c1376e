"""FP8 moments of the Adam step: how they are decoded, updated and encoded, shared by the Adam
operators and the pre-pass that finds their amaxes (quant_core.adam._moment_amaxes).

[Note: fp8 moments in the Adam pass] A moment kept in FP8 (E4M3 or E5M2) is its codes plus one
fp32 scale_inv per tensor (0-d). Its update is [Note: Adam numerics] on the fp32 value
`fl(code * scale_inv)` (a NaN code gives the canonical NaN: what `dequantize_fp8` returns), and the
updated value m' is stored as `fp8(m' * scale)` (what `cast_to_fp8` stores), with the scale that
`fp8_scale` makes (margin 0, no power of two) from the amax of m' over the whole moment, all of its
shards; the moment's scale_inv becomes that scale's. The codes of one element depend on every
updated element, so a step takes two passes over the moments, and no fp32 copy of a moment exists:
1. `adam_moment_amaxes` computes the amax of each updated fp8 moment with the fp32 operations of
   the Adam kernels, in their order (so bit for bit `amax_many` of the values they compute), and
   writes nothing;
2. the caller agrees the amaxes over the shards (an all-reduce with MAX), then `adam_step`
   updates the parameters and moments in one pass, decoding with the stored scale_invs and
   encoding with the scales of the agreed amaxes, and sets the scale_invs. A step skipped by its
   verdict writes neither codes nor scale_invs.
Layout, shared by every operator that takes fp8 moments: a row per list of fp8 moments, exp_avgs'
first when they are fp8, then exp_avg_sqs'. `moment_scale_invs` is a list of 0-d fp32 tensors,
row after row (len(params) per row: row r's scale_inv of tensor i at r * len(params) + i), and
`moment_amaxes` an fp32 (rows, len(params)) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quant_core.fp8._fp8 import dequantize_fp8_reference
from quant_core.fp8._scale import fp8_scale_reference
from quant_core.shared._numerics import encode_fp8

FP8_MOMENT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Moment storage as the C++ kernels take it (csrc/adam.cpp `Moment`).
MOMENT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def fp8_rows(exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]) -> list[int]:
    """Which moment lists are fp8, in row order ([Note: fp8 moments in the Adam pass]): 0 for
    exp_avgs, 1 for exp_avg_sqs."""
    return [
        which
        for which, tensors in enumerate((exp_avgs, exp_avg_sqs))
        if tensors and tensors[0].dtype in FP8_MOMENT_DTYPES
    ]


def decode_moment(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The flat fp32 values of an fp8 moment, as `dequantize_fp8` gives them."""
    return dequantize_fp8_reference(codes.view(-1), scale_inv, torch.float32)


def encode_moment_(codes: torch.Tensor, values: torch.Tensor, amax: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Stores an fp8 moment's updated fp32 `values` into `codes` with the scale of `amax`, as
    `cast_to_fp8` with `fp8_scale` stores them, and sets `scale_inv` to that scale's."""
    scale, new_scale_inv = fp8_scale_reference(amax, codes.dtype)
    codes.view(torch.uint8).view(-1).copy_(encode_fp8(values * scale, codes.dtype).view(torch.uint8))
    scale_inv.copy_(new_scale_inv)


def check_fp8_moments(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    moment_scale_invs: Sequence[torch.Tensor] | None,
    moment_amaxes: torch.Tensor | None,
    *,
    amaxes_needed: bool = True,
) -> list[torch.Tensor] | None:
    """Checks the scale_invs (and, when `amaxes_needed`, the amaxes) that fp8 moments need
    ([Note: fp8 moments in the Adam pass]); returns the scale_invs as the operators take them."""
    rows = len(fp8_rows(exp_avgs, exp_avg_sqs))
    device = params[0].device if params else None
    if not rows:
        if moment_scale_invs is not None or moment_amaxes is not None:
            raise ValueError("moment_scale_invs and moment_amaxes are for fp8 moments; these moments are not fp8")
        return None
    if moment_scale_invs is None or len(moment_scale_invs) != rows * len(params):
        raise ValueError(
            f"fp8 moments need moment_scale_invs: one 0-d fp32 scale_inv per parameter for each of the {rows} fp8 "
            f"moment lists ({rows * len(params)}), got {None if moment_scale_invs is None else len(moment_scale_invs)}"
        )
    for i, scale_inv in enumerate(moment_scale_invs):
        if scale_inv.dtype != torch.float32 or scale_inv.dim() != 0 or scale_inv.device != device:
            raise ValueError(
                f"moment_scale_invs[{i}] must be a 0-d float32 tensor on {device}, got {scale_inv.dtype} "
                f"{tuple(scale_inv.shape)} on {scale_inv.device}"
            )
    if amaxes_needed and (
        moment_amaxes is None
        or moment_amaxes.dtype != torch.float32
        or tuple(moment_amaxes.shape) != (rows, len(params))
        or moment_amaxes.device != device
        or not moment_amaxes.is_contiguous()
    ):
        got = "None" if moment_amaxes is None else f"{moment_amaxes.dtype} {tuple(moment_amaxes.shape)}"
        raise ValueError(
            f"fp8 moments need moment_amaxes: a contiguous float32 ({rows}, {len(params)}) tensor on {device} (the "
            f"agreed amaxes adam_moment_amaxes computes), got {got}"
        )
    return list(moment_scale_invs)
