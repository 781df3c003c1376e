"""The Adam step with its decisions in tensors: step counts, lr and the skip verdict on the device.

[Note: capturable Adam step] `adam_step_capturable_` is `adam_step_` ([Note: Adam numerics] in
quant_core.adam._adam) for a caller that must not read the device from the host (a training step
without host syncs, or one captured in a CUDA graph and replayed):
- `found_inf` (nonzero: a gradient somewhere was not finite) is read by the kernel, which then
  writes nothing: parameters, moments, step counts and `outs` keep their bytes. The amaxes are
  still computed (of the parameters as they are), so a caller that requantizes from them without
  knowing the verdict gets the bytes it wrote last time ([Note: FusedAdam step] in quant_optim);
- each parameter's step count is an fp32 0-d tensor that the kernel increments (once per
  parameter, by the last program that reads it: a ticket counter per tensor);
- the scalars of `AdamScalars.of` are computed inside the kernel, in float64, from that count
  and from lr, which may be a device tensor (read by the kernel, no `.item()`); the other
  hyperparameters travel as the bits of their float64 values, so every bit of the result equals
  the host's `AdamScalars.of` (IEEE operations only; `power` squares as the kernel does);
- params may be the fp32 masters or low-precision parameters themselves (bf16/fp16, updated in
  fp32 and stored rounded to nearest even; bf16 rounded stochastically with per-parameter
  counters, [Note: Adam stochastic rounding] in quant_core.adam._adam, each counter incremented
  like the step count, by the same last program), and `outs` (optional) receive each updated
  parameter rounded to their dtype in the same pass (a bf16 parameter written from its fp32
  master without a second read of the master; with stochastic rounding, the rounded parameter).
Gradients are read as `adam_step_` reads them; moments fp32, bf16 or fp8 ([Note: fp8 moments in
the Adam pass] in quant_core.adam._fp8_moments: a skipped step writes neither their codes nor
their scale_invs; otherwise each scale_inv is set by the last program that reads it, as step
counts are).

Operator (unchecked; [Note: custom ops]): `torch.ops.quant_core.adam_step_capturable(params,
grads, exp_avgs, exp_avg_sqs, steps, outs, found_inf, lr, hyperparameters, adam_w_mode,
compute_amax, seed=0, stochastic_rounding_counters=None, moment_scale_invs=None,
moment_amaxes=None) -> Tensor`: non-empty lists of equal
length of plain tensors on one device; params contiguous of one dtype out of fp32/bf16/fp16;
grads and moments as for `adam_step`; steps fp32 0-d tensors; outs empty or one contiguous tensor
per param, of one float dtype; the i-th tensors of every list have equal numels; found_inf an
fp32 tensor (its first element is read); lr a tensor of one element on the same device, or None;
hyperparameters [lr (used when lr is None), beta1, beta2, eps, weight_decay]; seed an int in
int64 range; stochastic_rounding_counters None, or (with bf16 params) one 0-d int64 tensor per
param on their device; moment_scale_invs and moment_amaxes as for `adam_step`. Returns the
(len(params),) fp32 amaxes with compute_amax, else an empty tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.adam._adam import (
    MOMENT_AND_FP8_DTYPES,
    AdamScalars,
    adam_step_reference,
    amaxes_fake,
    check_counters,
    check_per_parameter,
)
from quant_core.adam._fp8_moments import check_fp8_moments, fp8_rows
from quant_core.fp8._fp8 import amax_reference
from quant_core.shared._checks import FLOAT_DTYPES
from quant_core.shared._numerics import signed64


def adam_step_capturable_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    found_inf: torch.Tensor | None = None,
    outs: Sequence[torch.Tensor] | None = None,
    compute_amax: bool = False,
    stochastic_rounding_counters: Sequence[torch.Tensor] | None = None,
    seed: int = 0,
    moment_scale_invs: Sequence[torch.Tensor] | None = None,
    moment_amaxes: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One Adam step whose step counts, lr and skip verdict are tensors ([Note: capturable Adam step]).

    Unless `found_inf` is nonzero: each `steps[i]` (fp32 0-d) is incremented and `params[i]`
    (fp32, or bf16/fp16 updated in fp32) and its moments take the step of
    `AdamScalars.of(lr=lr, ..., step=steps[i])`, bit for bit `adam_step_`'s; `outs[i]` (optional)
    receives the updated parameter rounded to its dtype. With `found_inf` nonzero nothing is
    written (counters included). With `compute_amax`, returns the (len(params),) fp32 max |param|
    over finite values, after the update (or of the parameters as they are, when skipped).

    `stochastic_rounding_counters` (bf16 params only): one 0-d int64 tensor per parameter on the
    parameters' device; the params are stored rounded stochastically with the stream
    `seed + counters[i]` and each counter is incremented, as `adam_step_` does ([Note: Adam
    stochastic rounding]). `seed`: an int (its low 64 bits count). `moment_scale_invs`,
    `moment_amaxes`: with fp8 moments, as `adam_step_` takes them ([Note: fp8 moments in the Adam
    pass]); a skipped step leaves the scale_invs as they are.
    """
    _check_inputs(params, grads, exp_avgs, exp_avg_sqs, steps, outs or [], found_inf, lr, stochastic_rounding_counters)
    scale_invs = check_fp8_moments(params, exp_avgs, exp_avg_sqs, moment_scale_invs, moment_amaxes)
    if not params:
        return torch.zeros(0, dtype=torch.float32) if compute_amax else None
    device = params[0].device
    if isinstance(lr, torch.Tensor) and lr.device != device:  # a CPU tensor: reading it syncs nothing
        lr = lr.item()
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    amaxes = call(
        "adam_step_capturable",
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(steps),
        list(outs or []),
        found_inf if found_inf is not None else _zero(device),
        lr_tensor,
        [0.0 if lr_tensor is not None else float(lr), beta1, beta2, eps, weight_decay],
        adam_w_mode,
        compute_amax,
        signed64(seed),
        list(stochastic_rounding_counters) if stochastic_rounding_counters is not None else None,
        scale_invs,
        moment_amaxes,
    )
    return amaxes if compute_amax else None


_zeros: dict[torch.device, torch.Tensor] = {}


def _zero(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 zero on `device`, made once (the verdict of a caller that checked nothing)."""
    zero = _zeros.get(device)
    if zero is None:
        zero = _zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
    return zero


class AdamStepCapturableArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.adam_step_capturable` ([Note: operator arguments]),
    those of `adam_step_capturable_reference` too."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    outs: list[torch.Tensor]
    found_inf: torch.Tensor
    lr: torch.Tensor | None
    hyperparameters: list[float]
    adam_w_mode: bool
    compute_amax: bool
    seed: int = 0
    stochastic_rounding_counters: list[torch.Tensor] | None = None
    moment_scale_invs: list[torch.Tensor] | None = None
    moment_amaxes: torch.Tensor | None = None


@define_op(
    "adam_step_capturable",
    AdamStepCapturableArgs,
    mutates_args=(
        "params",
        "exp_avgs",
        "exp_avg_sqs",
        "steps",
        "outs",
        "stochastic_rounding_counters",
        "moment_scale_invs",
    ),
    fake=amaxes_fake,
)
def _adam_step_capturable_op(kernel: Kernel, args: AdamStepCapturableArgs) -> torch.Tensor:
    """Kernels take the arguments with contiguous grads."""
    return kernel(args._replace(grads=[g if g.is_contiguous() else g.contiguous() for g in args.grads]))


@register_kernel("adam_step_capturable", "reference")
def _adam_step_capturable_reference_kernel(args: AdamStepCapturableArgs) -> torch.Tensor:
    return adam_step_capturable_reference(*args)


def adam_step_capturable_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    lr: torch.Tensor | None,
    hyperparameters: Sequence[float],
    adam_w_mode: bool,
    compute_amax: bool = True,
    seed: int = 0,
    stochastic_rounding_counters: Sequence[torch.Tensor] | None = None,
    moment_scale_invs: Sequence[torch.Tensor] | None = None,
    moment_amaxes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec of [Note: capturable Adam step] through `adam_step_reference`, one tensor at a
    time (reads the verdict, lr and step counts on the host). Returns every parameter's amax
    with `compute_amax`, else an empty tensor."""
    skip = bool(found_inf.reshape(-1)[0] != 0)
    lr_value = float(lr.reshape(-1)[0]) if lr is not None else hyperparameters[0]
    _, beta1, beta2, eps, weight_decay = hyperparameters
    stochastic = stochastic_rounding_counters is not None
    rows, count = len(fp8_rows(exp_avgs, exp_avg_sqs)), len(params)
    amaxes = []
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        value = param.view(-1).float()  # a view of an fp32 param, else a copy
        if not skip:
            scalars = AdamScalars.of(
                lr=lr_value,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                step=int(steps[i]) + 1,
                adam_w_mode=adam_w_mode,
            )
            # This tensor's fp8 moments: its scale_inv and amax of each row.
            fp8 = (
                ([moment_scale_invs[row * count + i] for row in range(rows)], moment_amaxes[:, i : i + 1])  # type: ignore[index]
                if rows
                else (None, None)
            )
            if stochastic:  # the bf16 param updated and rounded in place, its counter incremented
                counter = [stochastic_rounding_counters[i]]
                adam_step_reference([param], [grad], [exp_avg], [exp_avg_sq], scalars, False, seed, counter, *fp8)
                value = param.view(-1).float()
            else:
                adam_step_reference([value], [grad], [exp_avg], [exp_avg_sq], scalars, False, 0, None, *fp8)
            steps[i].add_(1)
            if param.dtype != torch.float32 and not stochastic:
                param.view(-1).copy_(value)  # round to nearest even
            if outs:
                outs[i].view(-1).copy_(value)
        if compute_amax:
            amaxes.append(amax_reference(value))
    return torch.stack(amaxes) if amaxes else torch.zeros(0, dtype=torch.float32, device=params[0].device)


def _check_inputs(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    found_inf: torch.Tensor | None,
    lr: float | torch.Tensor,
    counters: Sequence[torch.Tensor] | None,
) -> None:
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    check_per_parameter(
        "adam_step_capturable_",
        lists | {"outs": outs} if outs else lists,
        {
            "params": FLOAT_DTYPES,
            "grads": FLOAT_DTYPES,
            "exp_avgs": MOMENT_AND_FP8_DTYPES,
            "exp_avg_sqs": MOMENT_AND_FP8_DTYPES,
            "steps": (torch.float32,),
            "outs": FLOAT_DTYPES,
        },
        "one grad, two moments, a step count (and an out, if any)",
    )
    device = params[0].device if params else None
    if found_inf is not None and (
        found_inf.dtype != torch.float32 or found_inf.numel() < 1 or found_inf.device != device
    ):
        raise ValueError(
            f"found_inf must be a float32 tensor of at least one element on {device} (nonzero skips the step), got "
            f"{found_inf.dtype} {tuple(found_inf.shape)} on {found_inf.device}; pass found_inf.float()"
        )
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or not lr.dtype.is_floating_point):
        raise ValueError(f"lr must be a float or a one-element floating-point tensor, got {lr.dtype} {tuple(lr.shape)}")
    if counters is not None:
        if params and params[0].dtype != torch.bfloat16:
            raise TypeError(
                f"stochastic rounding rounds bf16 params, got {params[0].dtype} params; pass "
                "stochastic_rounding_counters only with bf16 params (masters kept in bf16)"
            )
        check_counters(counters, params)
