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
a GPU kernel that computes them from a step count held on the device gets the same bits ([Note:
capturable Adam step] in quant_core.adam._capturable). It differs from torch.optim.AdamW by
rounding only (a few ulp of the update). Gradients may be fp32, bf16 or fp16; moments fp32,
bf16 (read as fp32, updated in fp32, stored rounded to nearest even, the update using the fp32
value) or fp8 with a scale per tensor ([Note: fp8 moments in the Adam pass] in
quant_core.adam._fp8_moments: decoded to fp32, updated, encoded with the scale of an amax the
caller gives, the update using the fp32 value); parameters (fp32 masters, or bf16 masters rounded stochastically: [Note: Adam stochastic
rounding]) are updated in place.

[Note: Adam stochastic rounding] A bf16 master is read as fp32, takes the fp32 update above
unchanged, and is stored rounded stochastically ([Note: bf16 stochastic rounding] in
quant_core.shared._numerics): element j of parameter i (its flat index in the tensor as given: a
shard counts from its own first element) draws `random16(seed + counters[i], j)` ([Note: counter
RNG], the stream NVFP4's stochastic rounding draws from), where `counters[i]` is the parameter's
0-d int64 counter (its uint64 bits; seed + counter wraps modulo 2^64). Each step increments every
counter it used by one, so no two steps of a parameter share a stream, and a run that saved and
restored the counters continues their streams; a step that is skipped (the capturable step's
verdict) changes no counter. The amax computed with the step, and the capturable step's outs, are
of the rounded values (what every later read of the master sees). Parameters whose counters are
equal at a step draw equal bits at equal indices (correlated roundings, each still unbiased): a
caller that wants them independent starts the counters apart (parameter i at i << 32 keeps the
streams of 2^32 parameters apart for 2^32 steps). Resharding changes which bits an element
draws: a run resumed on another layout continues with the same statistics, not the same bits.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.adam_step(params, grads, exp_avgs, exp_avg_sqs, scalars, compute_amax,
  seed=0, stochastic_rounding_counters=None, moment_scale_invs=None, moment_amaxes=None) ->
  Tensor`: non-empty lists of equal length of plain tensors on one device; params contiguous fp32
  (without counters) or bf16 (with counters), grads of one dtype out of fp32/bf16/fp16 (any
  strides), each moment list contiguous of one dtype out of `MOMENT_DTYPES` and the fp8 dtypes;
  the i-th tensors of the lists have equal numels; scalars the fields of `AdamScalars` in order
  (`dataclasses.astuple`); seed an int in int64 range (`signed64`); stochastic_rounding_counters
  None or one 0-d int64 tensor per param on params' device; with fp8 moments, moment_scale_invs
  and moment_amaxes in the layout of [Note: fp8 moments in the Adam pass], else None. Updates
  params, moments, counters and the fp8 moments' scale_invs in place; returns the (len(params),)
  fp32 amaxes with compute_amax, else an empty tensor.
- `torch.ops.quant_core.has_non_finite(tensors) -> Tensor`: a non-empty list of plain fp32/bf16/
  fp16 tensors on one device, any strides. Returns fp32 0-d 1.0 if any element is NaN or +-Inf.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

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

if TYPE_CHECKING:
    from quant_core.adam._capturable import AdamStepCapturableArgs

MOMENT_DTYPES = (torch.float32, torch.bfloat16)
MOMENT_AND_FP8_DTYPES = (*MOMENT_DTYPES, *FP8_MOMENT_DTYPES)


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
    scalars: AdamScalars,
    *,
    compute_amax: bool = False,
    stochastic_rounding_counters: Sequence[torch.Tensor] | None = None,
    seed: int = 0,
    moment_scale_invs: Sequence[torch.Tensor] | None = None,
    moment_amaxes: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Updates `params` and their moments in place by one Adam step ([Note: Adam numerics]).

    All tensors of one list share a dtype and a device; the i-th of each list have the same
    number of elements.

    Args:
        params: fp32 masters, or bf16 masters with `stochastic_rounding_counters`.
        compute_amax: also return an fp32 tensor of shape (len(params),) holding max |p| over the
            finite elements of each updated parameter (what per-tensor requantizing needs),
            computed in the same pass.
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
    counters = _check_adam_inputs(params, grads, exp_avgs, exp_avg_sqs, stochastic_rounding_counters)
    scale_invs = check_fp8_moments(params, exp_avgs, exp_avg_sqs, moment_scale_invs, moment_amaxes)
    if not params:
        return torch.zeros(0, dtype=torch.float32) if compute_amax else None
    args = (params, grads, exp_avgs, exp_avg_sqs)
    if not all(map(_is_plain, (*params, *grads, *exp_avgs, *exp_avg_sqs, *(counters or ())))):  # see _is_plain
        with torch.no_grad():
            return adam_step_reference(
                *args, scalars, compute_amax, signed64(seed), counters, scale_invs, moment_amaxes
            )
    scalar_values = list(dataclasses.astuple(scalars))
    amaxes = call("adam_step", *args, scalar_values, compute_amax, signed64(seed), counters, scale_invs, moment_amaxes)
    return amaxes if compute_amax else None


class AdamStepArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.adam_step` ([Note: operator arguments])."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    scalars: list[float]
    compute_amax: bool
    seed: int = 0
    stochastic_rounding_counters: list[torch.Tensor] | None = None
    moment_scale_invs: list[torch.Tensor] | None = None
    moment_amaxes: torch.Tensor | None = None


def amaxes_fake(args: AdamStepArgs | AdamStepCapturableArgs) -> torch.Tensor:
    """The fake of both Adam operators: the (len(params),) amaxes with compute_amax, else empty."""
    return args.params[0].new_empty(len(args.params) if args.compute_amax else 0, dtype=torch.float32)


@define_op(
    "adam_step",
    AdamStepArgs,
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "stochastic_rounding_counters", "moment_scale_invs"),
    fake=amaxes_fake,
)
def _adam_step_op(kernel: Kernel, args: AdamStepArgs) -> torch.Tensor:
    """Kernels take (args with contiguous grads, the scalars as `AdamScalars`) and return the
    amaxes with compute_amax, else None."""
    args = args._replace(grads=[g if g.is_contiguous() else g.contiguous() for g in args.grads])
    amaxes = kernel(args, AdamScalars(*args.scalars))
    return amaxes if amaxes is not None else args.params[0].new_empty(0, dtype=torch.float32)


@register_kernel("adam_step", "reference")
def _adam_step_reference_kernel(args: AdamStepArgs, scalars: AdamScalars) -> torch.Tensor | None:
    counters = args.stochastic_rounding_counters
    lists = (args.params, args.grads, args.exp_avgs, args.exp_avg_sqs)
    return adam_step_reference(
        *lists, scalars, args.compute_amax, args.seed, counters, args.moment_scale_invs, args.moment_amaxes
    )


def has_non_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of `tensors` is NaN or +-Inf, else 0.0 (an fp32 0-d tensor on their
    device, ready for an all-reduce with MAX). One pass over all of them; dtypes may differ."""
    for i, t in enumerate(tensors):
        check_float_input(t, f"tensors[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] is on {tensors[0].device}")
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    if not all(map(_is_plain, tensors)):
        return has_non_finite_reference(tensors)
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


def _is_plain(t: torch.Tensor) -> bool:
    """Whether t's memory is its own: compiled kernels read and write raw memory, which a tensor
    subclass that wraps another tensor (quant_fsdp's QuantizeOnGatherTensor) does not have, so
    such inputs run the reference, whose torch ops reach them through `__torch_dispatch__`."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


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
    "; fp32 params step without stochastic_rounding_counters, bf16 params with them (one 0-d int64 tensor per "
    "parameter)"
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
    counters: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor] | None:
    """Checks adam_step_'s arguments; returns the counters as the operator takes them."""
    check_per_parameter(
        "adam_step_",
        {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        {
            "params": (torch.float32,) if counters is None else (torch.bfloat16,),
            "grads": FLOAT_DTYPES,
            "exp_avgs": MOMENT_AND_FP8_DTYPES,
            "exp_avg_sqs": MOMENT_AND_FP8_DTYPES,
        },
        "one grad and two moments",
        hint=" (call adam_step_ once per dtype combination)",
        params_hint=_PARAM_DTYPE_HINT,
    )
    if counters is None:
        return None
    check_counters(counters, params)
    return list(counters)


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
    scalars: AdamScalars,
    compute_amax: bool = False,
    seed: int = 0,
    stochastic_rounding_counters: Sequence[torch.Tensor] | None = None,
    moment_scale_invs: Sequence[torch.Tensor] | None = None,
    moment_amaxes: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Plain-torch Adam step: the spec of [Note: Adam numerics], [Note: Adam stochastic
    rounding] and [Note: fp8 moments in the Adam pass], one tensor at a time."""
    amaxes = []
    counters = stochastic_rounding_counters or [None] * len(params)
    rows = {which: row for row, which in enumerate(fp8_rows(exp_avgs, exp_avg_sqs))}
    count = len(params)
    for i, (param, grad, exp_avg, exp_avg_sq, counter) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs, counters, strict=True)
    ):
        # Flat views: the i-th tensors of the lists share a size, not necessarily a shape.
        p, g = param.view(-1).float(), grad.reshape(-1).float()  # p: a view of an fp32 master, else a copy
        # Views of fp32 states, else copies (fp8 moments decoded with their scale_invs)
        scale_invs = {which: moment_scale_invs[row * count + i] for which, row in rows.items()}  # type: ignore[index]
        m = decode_moment(exp_avg, scale_invs[0]) if 0 in rows else exp_avg.view(-1).float()
        v = decode_moment(exp_avg_sq, scale_invs[1]) if 1 in rows else exp_avg_sq.view(-1).float()
        if scalars.decay != 1.0:
            p.mul_(scalars.decay)
        if scalars.weight_decay != 0.0:
            g = g + p * scalars.weight_decay
        m.mul_(scalars.beta1).add_(g * scalars.one_minus_beta1)
        v.mul_(scalars.beta2).add_(g * g * scalars.one_minus_beta2)
        denom = _sqrt(v).mul_(scalars.inv_bias_correction2_sqrt).add_(scalars.eps)
        p.sub_(m.div(denom).mul_(scalars.step_size))
        for which, (moment, value) in enumerate(((exp_avg, m), (exp_avg_sq, v))):
            if which in rows:
                encode_moment_(moment, value, moment_amaxes[rows[which], i], scale_invs[which])  # type: ignore[index]
            elif moment.dtype != torch.float32:
                moment.view(-1).copy_(value)  # round to nearest even
        if counter is not None:
            draws = random16(counter + seed, torch.arange(p.numel(), device=p.device))
            param.view(-1).copy_(round_to_bfloat16_stochastic(p, draws))
            counter.add_(1)
            p = param.view(-1).float()  # the amax of the value stored
        if compute_amax:
            amaxes.append(amax_reference(p))
    if not compute_amax:
        return None
    return torch.stack(amaxes) if amaxes else torch.zeros(0, dtype=torch.float32)


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("adam_step", "cpp")
def _adam_step_cpp(args: AdamStepArgs, scalars: AdamScalars) -> torch.Tensor | None:
    params, grads, exp_avgs, exp_avg_sqs = args.params, args.grads, args.exp_avgs, args.exp_avg_sqs
    amax = torch.zeros(len(params), dtype=torch.float32) if args.compute_amax else None
    counters = args.stochastic_rounding_counters or []
    scale_invs = args.moment_scale_invs or []
    _C.adam_step(
        [p.data_ptr() for p in params],
        [g.data_ptr() for g in grads],
        [m.data_ptr() for m in exp_avgs],
        [v.data_ptr() for v in exp_avg_sqs],
        [p.numel() for p in params],
        DTYPE_CODES[grads[0].dtype],
        MOMENT_CODES[exp_avgs[0].dtype],
        MOMENT_CODES[exp_avg_sqs[0].dtype],
        _C.AdamScalars(**dataclasses.asdict(scalars)),
        pointer(amax),
        [c.data_ptr() for c in counters],
        args.seed,
        [s.data_ptr() for s in scale_invs],
        pointer(args.moment_amaxes),
        torch.get_num_threads(),
    )
    for t in (*params, *exp_avgs, *exp_avg_sqs, *counters, *scale_invs):  # written through pointers: tell autograd
        torch.autograd.graph.increment_version(t)
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
