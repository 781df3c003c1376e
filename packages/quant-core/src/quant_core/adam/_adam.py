"""The Adam/AdamW update over many tensors in one pass, with each result's amax for requantizing.

[Note: Adam numerics] The spec is `adam_step_reference`. Every operation is a single fp32 IEEE
operation rounded to nearest even (no fused multiply-add, no division by a scalar: torch's own
kernels differ between devices and between vectorized and scalar loops there), with the scalars
computed once in float64 and rounded to fp32 (`AdamScalars`), and sqrt correctly rounded:

    p = p * decay                               (AdamW with weight decay; decay = 1 - lr * wd)
    g = g + p * wd                              (Adam with weight decay, L2 form)
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p - (m / (sqrt(v) * inv_bc2_sqrt + eps)) * step_size

with inv_bc2_sqrt = 1 / sqrt(1 - beta2^step) and step_size = lr / (1 - beta1^step), computed in
float64 from the float64 values of lr, the betas, eps and weight_decay by IEEE operations only
(beta^step by squaring: `power`; a correctly rounded sqrt), each result rounded once to fp32, so
every kernel computes them from the step count it reads and gets the same bits ([Note: Adam step
in tensors]). It differs from torch.optim.AdamW by rounding only (a few ulp of the update).
Gradients may be fp32, bf16 or fp16; moments fp32, bf16 (read as fp32, updated in fp32, stored
rounded to nearest even, the update using the fp32 value) or fp8 with a scale per tensor ([Note:
fp8 moments in the Adam pass] in quant_core.adam._fp8_moments: decoded to fp32, updated, encoded
with the scale of an amax the caller gives, the update using the fp32 value); parameters (fp32
masters, bf16/fp16 parameters updated in fp32 and stored rounded to nearest even, or bf16 masters
rounded stochastically: [Note: Adam stochastic rounding]) are updated in place.

[Note: Adam step in tensors] Everything a step decides from is a tensor the kernel reads, so a
caller never reads the device from the host (a training step without host syncs, or one
captured in a CUDA graph and replayed):
- `found_inf` (optional; nonzero: a gradient somewhere was not finite) is read by the kernel,
  which then writes nothing: parameters, moments, step counts, counters, fp8 moments'
  scale_invs and `outs` keep their bytes. The amaxes are still computed (of the parameters as
  they are), so a caller that requantizes from them without knowing the verdict gets the bytes
  it wrote last time ([Note: FusedAdam step] in quant_optim);
- each parameter's step count is an fp32 0-d tensor that the kernel increments (on CUDA once per
  parameter, by the last program that reads it: a ticket counter per tensor);
- the scalars of `AdamScalars.of` are computed inside the kernel, in float64, from that count
  and from lr, which may be a tensor (read by the kernel, no `.item()`); the other
  hyperparameters travel as float64 values, so every bit equals the host's `AdamScalars.of`;
- `outs` (optional) receive each updated parameter rounded to their dtype in the same pass (a
  bf16 parameter written from its fp32 master without a second read of the master; with
  stochastic rounding, the rounded parameter; for a bf16/fp16 parameter rounded to nearest, the
  rounding of its fp32 update).

[Note: Adam stochastic rounding] A bf16 master is read as fp32, takes the fp32 update above
unchanged, and is stored rounded stochastically ([Note: bf16 stochastic rounding] in
quant_core.shared._numerics): element j of parameter i (its flat index in the tensor as given: a
shard counts from its own first element) draws `random16(seed + counters[i], j)` ([Note: counter
RNG], the stream NVFP4's stochastic rounding draws from), where `counters[i]` is the parameter's
0-d int64 counter (its uint64 bits; seed + counter wraps modulo 2^64). Each step increments every
counter it used by one, so no two steps of a parameter share a stream, and a run that saved and
restored the counters continues their streams; a step that is skipped (its verdict) changes no
counter. The amax computed with the step, and the outs, are of the rounded values (what every
later read of the master sees). Parameters whose counters are
equal at a step draw equal bits at equal indices (correlated roundings, each still unbiased): a
caller that wants them independent starts the counters apart (parameter i at i << 32 keeps the
streams of 2^32 parameters apart for 2^32 steps). Resharding changes which bits an element
draws: a run resumed on another layout continues with the same statistics, not the same bits.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, outs, found_inf,
  lr, hyperparameters, adam_w_mode, compute_amax, seed=0, stochastic_rounding_counters=None,
  moment_scale_invs=None, moment_amaxes=None) -> Tensor`: non-empty lists of equal length of
  tensors on one device; params contiguous of one dtype out of fp32/bf16/fp16; grads of one dtype
  out of fp32/bf16/fp16 (any strides); each moment list contiguous of one dtype out of
  `MOMENT_DTYPES` and the fp8 dtypes; steps fp32 0-d tensors; outs empty or one contiguous tensor
  per param, of one float dtype; the i-th tensors of every list have equal numels; found_inf None
  or an fp32 tensor (its first element is read); lr a tensor of one element (fp32, fp64, bf16 or
  fp16) on the same device, or None; hyperparameters [lr (used when lr is None), beta1, beta2,
  eps, weight_decay]; seed an int in int64 range (`signed64`); stochastic_rounding_counters None,
  or (with bf16 params) one 0-d int64 tensor per param on their device; with fp8 moments,
  moment_scale_invs and moment_amaxes in the layout of [Note: fp8 moments in the Adam pass], else
  None. Updates params, moments, step counts, outs, counters and the fp8 moments' scale_invs in
  place unless found_inf is set; returns the (len(params),) fp32 amaxes with compute_amax, else
  an empty tensor. Tensor subclasses that wrap a plain tensor (quant_fsdp's
  QuantizeOnGatherTensor) reach the kernels through their `__torch_dispatch__`, unwrapped.
- `torch.ops.quant_core.has_non_finite(tensors) -> Tensor`: a non-empty list of fp32/bf16/fp16
  tensors on one device, any strides. Returns fp32 0-d 1.0 if any element is NaN or +-Inf.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel
from quant_core.adam._fp8_moments import (
    FP8_MOMENT_DTYPES,
    MOMENT_CODES,
    check_fp8_moments,
    decode_moment,
    encode_moment_,
    fp8_rows,
)
from quant_core.fp8._fp8 import amax_reference
from quant_core.shared._checks import FLOAT_DTYPES, check_float_input
from quant_core.shared._cpp import _C, DTYPE_CODES, pointer
from quant_core.shared._numerics import random16, round_to_bfloat16_stochastic, signed64

MOMENT_DTYPES = (torch.float32, torch.bfloat16)
MOMENT_AND_FP8_DTYPES = (*MOMENT_DTYPES, *FP8_MOMENT_DTYPES)
LR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""The dtypes of an lr tensor the kernels read."""


@dataclass(frozen=True)
class AdamScalars:
    """The fp32 scalars of one Adam step, each computed in float64 and rounded once to fp32."""

    decay: float
    """AdamW: multiplies the parameter before the update (1.0 when there is no decoupled decay)."""
    weight_decay: float
    """Adam (L2): g + p * weight_decay (0.0 when there is none)."""
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bias_correction2_sqrt: float
    eps: float
    step_size: float

    @classmethod
    def of(
        cls,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
        adam_w_mode: bool,
    ) -> AdamScalars:
        if step < 1:
            raise ValueError(f"step counts from 1 (the first update), got {step}")

        def fp32(value: float) -> float:  # round to nearest even, as torch casts a Python scalar
            return struct.unpack("f", struct.pack("f", value))[0]

        decoupled = weight_decay if adam_w_mode else 0.0
        return cls(
            decay=fp32(1.0 - lr * decoupled),
            weight_decay=fp32(0.0 if adam_w_mode else weight_decay),
            beta1=fp32(beta1),
            one_minus_beta1=fp32(1.0 - beta1),
            beta2=fp32(beta2),
            one_minus_beta2=fp32(1.0 - beta2),
            inv_bias_correction2_sqrt=fp32(1.0 / math.sqrt(1.0 - power(beta2, step))),
            eps=fp32(eps),
            step_size=fp32(lr / (1.0 - power(beta1, step))),
        )

    @classmethod
    def for_moments(cls, *, beta1: float, beta2: float, weight_decay: float, adam_w_mode: bool) -> AdamScalars:
        """The scalars of any step as far as the moments' update reads them (the betas, their
        complements and L2 weight decay: `adam_moment_amaxes`), for a caller whose lr is a device
        tensor; the other fields are those of lr 0 at step 1."""
        return cls.of(
            lr=0.0, beta1=beta1, beta2=beta2, eps=0.0, weight_decay=weight_decay, step=1, adam_w_mode=adam_w_mode
        )


def power(base: float, exponent: int) -> float:
    """base ** exponent (exponent >= 0) in float64 by squaring: a fixed sequence of IEEE
    multiplications, which the Triton kernel repeats bit for bit (`**` calls the C library's pow,
    whose last bit a GPU's pow need not match)."""
    result = 1.0
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


def adam_step_(
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
    """Updates `params` and their moments in place by one Adam step ([Note: Adam numerics],
    [Note: Adam step in tensors]).

    All tensors of one list share a dtype and a device; the i-th of each list have the same
    number of elements. Unless `found_inf` is nonzero, each `steps[i]` (fp32 0-d) is incremented
    and `params[i]` and its moments take the step of `AdamScalars.of(lr=lr, ..., step=steps[i] + 1)`.

    Args:
        params: fp32 masters; bf16/fp16 parameters (updated in fp32, stored rounded to nearest
            even); or bf16 masters with `stochastic_rounding_counters`.
        steps: one fp32 0-d step count per parameter (the steps taken so far), on its device.
        lr: a float, or a one-element tensor read by the kernel (fp32, fp64, bf16 or fp16).
        found_inf: nonzero skips the step (nothing written; a tensor, read by the kernel).
        outs: receive each updated parameter rounded to their dtype (one per parameter).
        compute_amax: also return an fp32 tensor of shape (len(params),) holding max |p| over the
            finite elements of each updated parameter (what per-tensor requantizing needs; of the
            parameters as they are when skipped), computed in the same pass.
        stochastic_rounding_counters: one 0-d int64 tensor per parameter, on its device: the bf16
            params are stored rounded stochastically with the stream `seed + counters[i]`, and
            each counter is incremented in place ([Note: Adam stochastic rounding]). Keep them as
            optimizer state (saved and restored with it).
        seed: the streams' base, an int (its low 64 bits count).
        moment_scale_invs, moment_amaxes: with fp8 moments ([Note: fp8 moments in the Adam pass]):
            their 0-d fp32 scale_invs (decoded with, then set to the new ones) and the fp32
            (rows, len(params)) amaxes their new scales are made from (`adam_moment_amaxes`,
            agreed over shards), a row per fp8 moment list, exp_avgs' first.
    """
    _check_adam_inputs(
        params, grads, exp_avgs, exp_avg_sqs, steps, outs or [], found_inf, lr, stochastic_rounding_counters
    )
    scale_invs = check_fp8_moments(params, exp_avgs, exp_avg_sqs, moment_scale_invs, moment_amaxes)
    if not params:
        return torch.zeros(0, dtype=torch.float32) if compute_amax else None
    if isinstance(lr, torch.Tensor) and lr.device != params[0].device:  # a CPU tensor: reading it syncs nothing
        lr = lr.item()
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    amaxes = call(
        "adam_step",
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(steps),
        list(outs or []),
        found_inf,
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


class AdamStepArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.adam_step` ([Note: operator arguments]), those of
    `adam_step_reference` too."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    outs: list[torch.Tensor]
    found_inf: torch.Tensor | None
    lr: torch.Tensor | None
    hyperparameters: list[float]
    adam_w_mode: bool
    compute_amax: bool
    seed: int = 0
    stochastic_rounding_counters: list[torch.Tensor] | None = None
    moment_scale_invs: list[torch.Tensor] | None = None
    moment_amaxes: torch.Tensor | None = None


def _amaxes_fake(args: AdamStepArgs) -> torch.Tensor:
    return args.params[0].new_empty(len(args.params) if args.compute_amax else 0, dtype=torch.float32)


@define_op(
    "adam_step",
    AdamStepArgs,
    mutates_args=(
        "params",
        "exp_avgs",
        "exp_avg_sqs",
        "steps",
        "outs",
        "stochastic_rounding_counters",
        "moment_scale_invs",
    ),
    fake=_amaxes_fake,
)
def _adam_step_op(kernel: Kernel, args: AdamStepArgs) -> torch.Tensor:
    """Kernels take the arguments with contiguous grads and return the amaxes (empty without
    compute_amax)."""
    return kernel(args._replace(grads=[g if g.is_contiguous() else g.contiguous() for g in args.grads]))


@register_kernel("adam_step", "reference")
def _adam_step_reference_kernel(args: AdamStepArgs) -> torch.Tensor:
    return adam_step_reference(*args)


def has_non_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of `tensors` is NaN or +-Inf, else 0.0 (an fp32 0-d tensor on their
    device, ready for an all-reduce with MAX). One pass over all of them; dtypes may differ."""
    for i, t in enumerate(tensors):
        check_float_input(t, f"tensors[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] is on {tensors[0].device}")
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return call("has_non_finite", list(tensors))


class HasNonFiniteArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.has_non_finite` ([Note: operator arguments])."""

    tensors: list[torch.Tensor]


def _has_non_finite_fake(args: HasNonFiniteArgs) -> torch.Tensor:
    return args.tensors[0].new_empty((), dtype=torch.float32)


@define_op("has_non_finite", HasNonFiniteArgs, fake=_has_non_finite_fake)
def _has_non_finite_op(kernel: Kernel, args: HasNonFiniteArgs) -> torch.Tensor:
    """Kernels take the arguments with the non-empty tensors only, made contiguous."""
    nonempty = [t if t.is_contiguous() else t.contiguous() for t in args.tensors if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.float32, device=args.tensors[0].device)
    return kernel(HasNonFiniteArgs(nonempty))


@register_kernel("has_non_finite", "reference")
def _has_non_finite_reference_kernel(args: HasNonFiniteArgs) -> torch.Tensor:
    return has_non_finite_reference(args.tensors)


def has_non_finite_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Plain-torch check: 1.0 if some element of some tensor is not finite."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    found = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any()  # no host sync
    return found.to(torch.float32)


_PARAM_DTYPE_HINT = (
    "; bf16 params rounded stochastically take stochastic_rounding_counters (one 0-d int64 tensor per parameter)"
)


def check_per_parameter(
    op: str,
    lists: dict[str, Sequence[torch.Tensor]],
    allowed: dict[str, tuple[torch.dtype, ...]],
    needs: str,
    *,
    hint: str = "",
    params_hint: str = "",
) -> None:
    """Checks the tensor lists an Adam operator takes, one tensor per parameter in each: equal
    lengths (`needs` says what each parameter takes, for the error), one dtype per list out of
    `allowed[name]` (`hint` appended to that error, `params_hint` too for params), every tensor on
    params[0]'s device, with its parameter's number of elements and contiguous (grads may have any
    strides; a list named `steps` holds 0-d tensors)."""
    lengths = {name: len(tensors) for name, tensors in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{op} needs {needs} per parameter, got lengths {lengths}")
    params = lists["params"]
    device = params[0].device if params else None
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if t.dtype != tensors[0].dtype or t.dtype not in allowed[name]:
                raise TypeError(
                    f"{name}[{i}] has dtype {t.dtype}; every tensor of {name} must share one dtype out of "
                    f"{', '.join(str(d) for d in allowed[name])}{hint}" + (params_hint if name == "params" else "")
                )
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but params[0] is on {device}; move it there")
            if name == "steps":
                if t.dim() != 0:
                    raise ValueError(f"steps[{i}] must be a 0-d tensor (the parameter's step count), got {t.shape}")
                continue
            if t.numel() != params[i].numel():
                raise ValueError(f"{name}[{i}] has {t.numel()} elements but params[{i}] has {params[i].numel()}")
            if name != "grads" and not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous (the kernels read and write it flat)")


def _check_adam_inputs(
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
    """Checks adam_step_'s arguments."""
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    check_per_parameter(
        "adam_step_",
        lists | {"outs": outs} if outs else lists,
        {
            "params": FLOAT_DTYPES if counters is None else (torch.bfloat16,),
            "grads": FLOAT_DTYPES,
            "exp_avgs": MOMENT_AND_FP8_DTYPES,
            "exp_avg_sqs": MOMENT_AND_FP8_DTYPES,
            "steps": (torch.float32,),
            "outs": FLOAT_DTYPES,
        },
        "one grad, two moments, a step count (and an out, if any)",
        hint=" (call adam_step_ once per dtype combination)",
        params_hint=_PARAM_DTYPE_HINT,
    )
    device = params[0].device if params else None
    if found_inf is not None and (
        found_inf.dtype != torch.float32 or found_inf.numel() < 1 or found_inf.device != device
    ):
        raise ValueError(
            f"found_inf must be a float32 tensor of at least one element on {device} (nonzero skips the step), got "
            f"{found_inf.dtype} {tuple(found_inf.shape)} on {found_inf.device}; pass found_inf.float()"
        )
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.dtype not in LR_DTYPES):
        raise ValueError(
            f"lr must be a float or a one-element tensor of one of {', '.join(str(d) for d in LR_DTYPES)}, got "
            f"{lr.dtype} {tuple(lr.shape)}; pass lr.float()"
        )
    if counters is not None:
        check_counters(counters, params)


def check_counters(counters: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    """Checks stochastic-rounding counters ([Note: Adam stochastic rounding]): one 0-d int64
    tensor per parameter, on the parameters' device."""
    if len(counters) != len(params):
        raise ValueError(
            f"stochastic rounding needs one counter per parameter, got {len(counters)} counters for {len(params)} params"
        )
    for i, counter in enumerate(counters):
        if counter.dtype != torch.int64 or counter.dim() != 0 or counter.device != params[i].device:
            raise ValueError(
                f"stochastic_rounding_counters[{i}] must be a 0-d int64 tensor on {params[i].device}, got "
                f"{counter.dtype} {tuple(counter.shape)} on {counter.device} "
                f"(make it with torch.zeros((), dtype=torch.int64, device={str(params[i].device)!r}))"
            )


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root. torch's own fp32 sqrt on CPU is not: with torch
    2.13 (AVX-512) about 15% of results are one ulp off. The float64 root rounded to fp32 is
    exact (float64 carries more than twice fp32's precision, so the double rounding is harmless)."""
    return v.double().sqrt_().float()


def adam_step_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    found_inf: torch.Tensor | None,
    lr: torch.Tensor | None,
    hyperparameters: Sequence[float],
    adam_w_mode: bool,
    compute_amax: bool = False,
    seed: int = 0,
    stochastic_rounding_counters: Sequence[torch.Tensor] | None = None,
    moment_scale_invs: Sequence[torch.Tensor] | None = None,
    moment_amaxes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch Adam step, the arguments of `torch.ops.quant_core.adam_step`: the spec of
    [Note: Adam numerics], [Note: Adam step in tensors], [Note: Adam stochastic rounding] and
    [Note: fp8 moments in the Adam pass], one tensor at a time (reads the verdict, lr and step
    counts on the host). Returns every parameter's amax with `compute_amax`, else an empty tensor."""
    skip = found_inf is not None and bool(found_inf.reshape(-1)[0] != 0)
    lr_value = float(lr.reshape(-1)[0]) if lr is not None else hyperparameters[0]
    _, beta1, beta2, eps, weight_decay = hyperparameters
    counters = stochastic_rounding_counters or [None] * len(params)
    rows = {which: row for row, which in enumerate(fp8_rows(exp_avgs, exp_avg_sqs))}
    count = len(params)
    amaxes = []
    for i, (param, grad, exp_avg, exp_avg_sq, counter) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs, counters, strict=True)
    ):
        p = param.view(-1).float()  # a view of an fp32 param, else a copy
        if not skip:
            s = AdamScalars.of(
                lr=lr_value,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                step=int(steps[i]) + 1,
                adam_w_mode=adam_w_mode,
            )
            g = grad.reshape(-1).float()
            # Views of fp32 states, else copies (fp8 moments decoded with their scale_invs)
            scale_invs = {which: moment_scale_invs[row * count + i] for which, row in rows.items()}  # type: ignore[index]
            m = decode_moment(exp_avg, scale_invs[0]) if 0 in rows else exp_avg.view(-1).float()
            v = decode_moment(exp_avg_sq, scale_invs[1]) if 1 in rows else exp_avg_sq.view(-1).float()
            if s.decay != 1.0:
                p.mul_(s.decay)
            if s.weight_decay != 0.0:
                g = g + p * s.weight_decay
            m.mul_(s.beta1).add_(g * s.one_minus_beta1)
            v.mul_(s.beta2).add_(g * g * s.one_minus_beta2)
            denom = _sqrt(v).mul_(s.inv_bias_correction2_sqrt).add_(s.eps)
            p.sub_(m.div(denom).mul_(s.step_size))
            for which, (moment, value) in enumerate(((exp_avg, m), (exp_avg_sq, v))):
                if which in rows:
                    encode_moment_(moment, value, moment_amaxes[rows[which], i], scale_invs[which])  # type: ignore[index]
                elif moment.dtype != torch.float32:
                    moment.view(-1).copy_(value)  # round to nearest even
            if counter is not None:
                draws = random16(counter + seed, torch.arange(p.numel(), device=p.device))
                param.view(-1).copy_(round_to_bfloat16_stochastic(p, draws))
                counter.add_(1)
                p = param.view(-1).float()  # the value stored, for outs and the amax
            elif param.dtype != torch.float32:
                param.view(-1).copy_(p)  # round to nearest even
            steps[i].add_(1)
            if outs:
                outs[i].view(-1).copy_(p)
        if compute_amax:
            amaxes.append(amax_reference(p))
    return torch.stack(amaxes) if amaxes else torch.zeros(0, dtype=torch.float32, device=params[0].device)


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----

# lr's dtype as the C++ kernel reads it: DTYPE_CODES, and float64.
_LR_CODES = {**DTYPE_CODES, torch.float64: 3}


@register_kernel("adam_step", "cpp")
def _adam_step_cpp(args: AdamStepArgs) -> torch.Tensor:
    params, outs = args.params, args.outs
    amax = torch.zeros(len(params) if args.compute_amax else 0, dtype=torch.float32)
    counters = args.stochastic_rounding_counters or []
    scale_invs = args.moment_scale_invs or []
    _C.adam_step(
        [p.data_ptr() for p in params],
        [g.data_ptr() for g in args.grads],
        [m.data_ptr() for m in args.exp_avgs],
        [v.data_ptr() for v in args.exp_avg_sqs],
        [s.data_ptr() for s in args.steps],
        [o.data_ptr() for o in outs],
        [p.numel() for p in params],
        DTYPE_CODES[params[0].dtype],
        DTYPE_CODES[args.grads[0].dtype],
        MOMENT_CODES[args.exp_avgs[0].dtype],
        MOMENT_CODES[args.exp_avg_sqs[0].dtype],
        DTYPE_CODES[outs[0].dtype] if outs else 0,
        pointer(args.found_inf),
        pointer(args.lr),
        _LR_CODES[args.lr.dtype] if args.lr is not None else 0,
        list(args.hyperparameters),
        args.adam_w_mode,
        pointer(amax) if args.compute_amax else 0,
        [c.data_ptr() for c in counters],
        args.seed,
        [s.data_ptr() for s in scale_invs],
        pointer(args.moment_amaxes),
        torch.get_num_threads(),
    )
    return amax


@register_kernel("has_non_finite", "cpp")
def _has_non_finite_cpp(args: HasNonFiniteArgs) -> torch.Tensor:
    tensors = args.tensors
    found = _C.has_non_finite(
        [t.data_ptr() for t in tensors],
        [DTYPE_CODES[t.dtype] for t in tensors],
        [t.numel() for t in tensors],
        torch.get_num_threads(),
    )
    return torch.tensor(float(found))
