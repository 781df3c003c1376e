"""The pre-pass of an Adam step with fp8 moments: the amax of each updated fp8 moment, nothing
written ([Note: fp8 moments in the Adam pass] in quant_core.adam._fp8_moments).

Operator ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.adam_moment_amaxes(params, grads, exp_avgs, exp_avg_sqs, moment_scale_invs,
  scalars) -> Tensor`: non-empty lists of equal length of plain tensors on one device; params
  contiguous fp32/bf16/fp16 (read only with L2 weight decay), grads as for `adam_step`, each moment
  list contiguous of one dtype out of `MOMENT_DTYPES` and the fp8 dtypes, at least one of them fp8;
  the i-th tensors of the lists have equal numels; moment_scale_invs the fp8 moments' 0-d fp32
  scale_invs in the Note's layout; scalars the fields of `AdamScalars` in order (decay,
  weight_decay and the betas are read). Returns the (rows, len(params)) fp32 amaxes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.adam._adam import MOMENT_AND_FP8_DTYPES, AdamScalars, check_per_parameter
from quant_core.adam._fp8_moments import MOMENT_CODES, check_fp8_moments, decode_moment, fp8_rows
from quant_core.fp8._fp8 import amax_reference
from quant_core.shared._checks import FLOAT_DTYPES
from quant_core.shared._cpp import _C, DTYPE_CODES, pointer


def adam_moment_amaxes(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    moment_scale_invs: Sequence[torch.Tensor],
    scalars: AdamScalars,
) -> torch.Tensor:
    """The amaxes (max |x| over the finite elements) of the fp8 moments an Adam step with
    `scalars` would write, without writing anything ([Note: fp8 moments in the Adam pass]).

    Args:
        params: the masters (fp32, bf16 or fp16), read only for Adam's L2 weight decay.
        grads, exp_avgs, exp_avg_sqs: as `adam_step_` takes them; at least one moment list fp8.
        moment_scale_invs: the fp8 moments' 0-d fp32 scale_invs, a row per fp8 moment list
            (exp_avgs' first when they are fp8), len(params) per row.
        scalars: the step's; only decay, weight_decay and the betas enter the moments (any step
            count and lr give the same amaxes, `AdamScalars.for_moments`).
    Returns:
        fp32 (rows, len(params)): row r holds the amaxes of the r-th fp8 moment list.
    """
    check_per_parameter(
        "adam_moment_amaxes",
        {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        {
            "params": FLOAT_DTYPES,
            "grads": FLOAT_DTYPES,
            "exp_avgs": MOMENT_AND_FP8_DTYPES,
            "exp_avg_sqs": MOMENT_AND_FP8_DTYPES,
        },
        "one grad and two moments",
    )
    if params and not fp8_rows(exp_avgs, exp_avg_sqs):
        raise ValueError(
            "adam_moment_amaxes computes the amaxes of fp8 moments; neither exp_avgs nor exp_avg_sqs is fp8"
        )
    scale_invs = check_fp8_moments(params, exp_avgs, exp_avg_sqs, moment_scale_invs, None, amaxes_needed=False)
    if not params:
        return torch.zeros(0, 0, dtype=torch.float32)
    values = list(dataclasses.astuple(scalars))
    return call("adam_moment_amaxes", list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), scale_invs, values)


class AdamMomentAmaxesArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.adam_moment_amaxes` ([Note: operator arguments])."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    moment_scale_invs: list[torch.Tensor]
    scalars: list[float]


def _fake(args: AdamMomentAmaxesArgs) -> torch.Tensor:
    rows = len(fp8_rows(args.exp_avgs, args.exp_avg_sqs))
    return args.params[0].new_empty((rows, len(args.params)), dtype=torch.float32)


@define_op("adam_moment_amaxes", AdamMomentAmaxesArgs, fake=_fake)
def _adam_moment_amaxes_op(kernel: Kernel, args: AdamMomentAmaxesArgs) -> torch.Tensor:
    """Kernels take (args with contiguous grads, the scalars as `AdamScalars`) and return the amaxes."""
    args = args._replace(grads=[g if g.is_contiguous() else g.contiguous() for g in args.grads])
    return kernel(args, AdamScalars(*args.scalars))


@register_kernel("adam_moment_amaxes", "reference")
def _reference_kernel(args: AdamMomentAmaxesArgs, scalars: AdamScalars) -> torch.Tensor:
    return adam_moment_amaxes_reference(
        args.params, args.grads, args.exp_avgs, args.exp_avg_sqs, args.moment_scale_invs, scalars
    )


def adam_moment_amaxes_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    moment_scale_invs: Sequence[torch.Tensor],
    scalars: AdamScalars,
) -> torch.Tensor:
    """Plain-torch `adam_moment_amaxes`: the moments' lines of `adam_step_reference`, one tensor
    at a time."""
    rows = fp8_rows(exp_avgs, exp_avg_sqs)
    count = len(params)
    amaxes = torch.zeros(len(rows), count, dtype=torch.float32, device=params[0].device if params else None)
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        p, g = param.view(-1).float(), grad.reshape(-1).float()
        if scalars.decay != 1.0:
            p = p * scalars.decay
        if scalars.weight_decay != 0.0:
            g = g + p * scalars.weight_decay
        for row, which in enumerate(rows):
            if which == 0:
                m = decode_moment(exp_avgs[i], moment_scale_invs[row * count + i])
                updated = m.mul_(scalars.beta1).add_(g * scalars.one_minus_beta1)
            else:
                v = decode_moment(exp_avg_sqs[i], moment_scale_invs[row * count + i])
                updated = v.mul_(scalars.beta2).add_(g * g * scalars.one_minus_beta2)
            amaxes[row, i] = amax_reference(updated)
    return amaxes


@register_kernel("adam_moment_amaxes", "cpp")
def _cpp_kernel(args: AdamMomentAmaxesArgs, scalars: AdamScalars) -> torch.Tensor:
    params, exp_avgs, exp_avg_sqs = args.params, args.exp_avgs, args.exp_avg_sqs
    amaxes = torch.zeros(len(fp8_rows(exp_avgs, exp_avg_sqs)), len(params), dtype=torch.float32)
    _C.adam_moment_amaxes(
        [p.data_ptr() for p in params],
        [g.data_ptr() for g in args.grads],
        [m.data_ptr() for m in exp_avgs],
        [v.data_ptr() for v in exp_avg_sqs],
        [p.numel() for p in params],
        DTYPE_CODES[params[0].dtype],
        DTYPE_CODES[args.grads[0].dtype],
        MOMENT_CODES[exp_avgs[0].dtype],
        MOMENT_CODES[exp_avg_sqs[0].dtype],
        _C.AdamScalars(**dataclasses.asdict(scalars)),
        [s.data_ptr() for s in args.moment_scale_invs],
        pointer(amaxes),
        torch.get_num_threads(),
    )
    return amaxes
