"""Triton kernels of the Adam step (CUDA tensors): the capturable step and the non-finite check.

[Note: exact Triton arithmetic] By default Triton contracts `a * b + c` into a fused
multiply-add and lowers `/` and `sqrt` to approximate instructions; libdevice's explicitly
rounded functions (`mul_rn`, ...) flush subnormals to zero (Triton builds libdevice with FTZ).
Kernels that must equal the reference bit for bit are therefore launched with
`enable_fp_fusion=False` and use plain `*`, `+`, `-` with `tl.div_rn` and `tl.sqrt_rn`
(IEEE round to nearest even, subnormals kept).
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary
from triton.language.extra import libdevice

from quant_core._library import register_kernel
from quant_core.adam._adam import HasNonFiniteArgs
from quant_core.adam._capturable import AdamStepCapturableArgs
from quant_core.shared._triton_launch import launch
from quant_core.shared._triton_numerics import finite_abs, round_to_bfloat16_stochastic, splitmix64
from quant_core.shared._triton_tables import CHUNK, CHUNK_BLOCK, chunk_table, pointer_table

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Weight decay variants, as the Adam kernel takes them (a compile-time constant).
_NO_DECAY, _DECOUPLED, _L2 = 0, 1, 2


@triton.jit
def _adam_update(
    p, g, m, v, decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps,
    step_size, DECAY: tl.constexpr,
):  # fmt: skip
    """[Note: Adam numerics] on fp32 values: the updated (p, m, v). DECAY 1 decays p (AdamW), 2
    adds weight_decay * p to the gradient (Adam with L2)."""
    if DECAY == 1:
        p = p * decay
    if DECAY == 2:
        g = g + p * weight_decay
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v) * inv_bias_correction2_sqrt + eps
    return p - tl.div_rn(m, denom) * step_size, m, v


@triton.jit
def _f64(bits):
    """The float64 whose bits a scalar int argument carries."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _div64(a, b, EXACT: tl.constexpr):
    # libdevice's division rounds to nearest (IEEE); the interpreter has no libdevice, numpy's is IEEE.
    # libdevice picks its function by the argument types: a literal (fp32) operand is cast first.
    if EXACT:
        return libdevice.div_rn(tl.cast(a, tl.float64), tl.cast(b, tl.float64))
    else:
        return a / b


@triton.jit
def _sqrt64(a, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.sqrt_rn(a)
    else:
        return tl.sqrt(a)


@triton.jit
def _power64(base, exponent):
    """base ** exponent in float64 by the multiplications of quant_core.adam._adam.power."""
    result = base * 0.0 + 1.0
    while exponent > 0:
        result = tl.where(exponent % 2 == 1, result * base, result)
        base = base * base
        exponent = exponent // 2
    return result


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "eps_bits", "weight_decay_bits", "seed"])
def _adam_capturable_kernel(
    pointers,
    num_tensors,
    chunks,
    tickets,
    found_ptr,
    lr_ptr,
    amax_ptr,
    p_like,
    g_like,
    m_like,
    v_like,
    o_like,
    lr_bits,
    beta1_bits,
    beta2_bits,
    eps_bits,
    weight_decay_bits,
    seed,
    DECAY: tl.constexpr,
    LR_TENSOR: tl.constexpr,
    OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    AMAX: tl.constexpr,
    EXACT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of one tensor of [Note: capturable Adam step]. `pointers` ([Note: pointer
    tables]): rows of parameters, gradients, moments, step counts, outs (when OUT), counters (when
    STOCHASTIC: bf16 params rounded stochastically, [Note: Adam stochastic rounding]) and numels;
    `tickets` int32 (num_tensors,) zeros, restored to zero by the last program of each tensor.
    Scalars as AdamScalars.of computes them, in float64 from the hyperparameters' bits."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    n = tl.load(pointers + (5 + OUT + STOCHASTIC) * num_tensors + t)
    p_ptr = tl.load(pointers + t).to(tl.pointer_type(p_like.dtype.element_ty))
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    if tl.load(found_ptr) != 0.0:  # skipped: nothing is written; the amaxes of the parameters as they are
        if AMAX:
            for start in range(0, CHUNK, BLOCK):
                offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
                p = tl.load(p_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
                largest = tl.maximum(largest, finite_abs(p))
    else:
        g_ptr = tl.load(pointers + num_tensors + t).to(tl.pointer_type(g_like.dtype.element_ty))
        m_ptr = tl.load(pointers + 2 * num_tensors + t).to(tl.pointer_type(m_like.dtype.element_ty))
        v_ptr = tl.load(pointers + 3 * num_tensors + t).to(tl.pointer_type(v_like.dtype.element_ty))
        step_ptr = tl.load(pointers + 4 * num_tensors + t).to(tl.pointer_type(tl.float32))
        step = tl.load(step_ptr).to(tl.int32) + 1
        if LR_TENSOR:  # noqa: SIM108  (a constexpr branch: only one side compiles)
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = _f64(lr_bits)
        beta1, beta2 = _f64(beta1_bits), _f64(beta2_bits)
        weight_decay = _f64(weight_decay_bits)
        decay = (1.0 - lr * weight_decay).to(tl.float32)
        l2_weight_decay = weight_decay.to(tl.float32)
        one_minus_beta1 = (1.0 - beta1).to(tl.float32)
        one_minus_beta2 = (1.0 - beta2).to(tl.float32)
        inv_bias_correction2_sqrt = _div64(1.0, _sqrt64(1.0 - _power64(beta2, step), EXACT), EXACT).to(tl.float32)
        step_size = _div64(lr, 1.0 - _power64(beta1, step), EXACT).to(tl.float32)
        eps = _f64(eps_bits).to(tl.float32)
        beta1_32, beta2_32 = beta1.to(tl.float32), beta2.to(tl.float32)
        if OUT:
            o_ptr = tl.load(pointers + 5 * num_tensors + t).to(tl.pointer_type(o_like.dtype.element_ty))
        if STOCHASTIC:
            counter_ptr = tl.load(pointers + (5 + OUT) * num_tensors + t).to(tl.pointer_type(tl.int64))
            counter = tl.load(counter_ptr)
            # seed is typed int32 or int64 by its value: widened first; the sum wraps modulo 2^64.
            stream = seed.to(tl.int64).to(tl.uint64, bitcast=True) + counter.to(tl.uint64, bitcast=True)
        for start in range(0, CHUNK, BLOCK):
            offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
            mask = offsets < n
            p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            p, m, v = _adam_update(
                p, g, m, v, decay, l2_weight_decay, beta1_32, one_minus_beta1, beta2_32, one_minus_beta2,
                inv_bias_correction2_sqrt, eps, step_size, DECAY,
            )  # fmt: skip
            if STOCHASTIC:  # p_ptr is bf16; p becomes the value stored, for outs and the amax
                random16 = (splitmix64(stream, offsets.to(tl.uint64)) >> 48).to(tl.uint32)
                stored = round_to_bfloat16_stochastic(p, random16)
                tl.store(p_ptr + offsets, stored, mask=mask)
                p = stored.to(tl.float32)
            else:
                tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
            tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
            if OUT:
                tl.store(o_ptr + offsets, p.to(o_ptr.dtype.element_ty), mask=mask)
            if AMAX:
                largest = tl.maximum(largest, tl.where(mask, finite_abs(p), 0.0))
        # Every program of tensor t read its step count (and counter) above; the last one to get
        # here writes them (acq_rel atomics order those reads before these writes) and resets the ticket.
        if tl.atomic_add(tickets + t, 1) == tl.cdiv(tl.maximum(n, 1), CHUNK) - 1:
            tl.store(step_ptr, step.to(tl.float32))
            if STOCHASTIC:
                tl.store(counter_ptr, counter + 1)
            tl.store(tickets + t, 0)
    if AMAX:
        tl.atomic_max(amax_ptr + t, tl.max(largest, axis=0))


@register_kernel("adam_step_capturable", "triton")
def _adam_step_capturable(args: AdamStepCapturableArgs) -> torch.Tensor:
    params, outs, found_inf, lr, compute_amax = args.params, args.outs, args.found_inf, args.lr, args.compute_amax
    device = params[0].device
    amax = torch.zeros(len(params) if compute_amax else 0, dtype=torch.float32, device=device)
    counters = args.stochastic_rounding_counters
    lists = (
        params,
        args.grads,
        args.exp_avgs,
        args.exp_avg_sqs,
        args.steps,
        *((outs,) if outs else ()),
        *((counters,) if counters else ()),
    )
    pointers = pointer_table(*lists)
    tickets = _tickets.get(pointers)
    if tickets is None:  # one per table: a table is one call's tensors ([Note: pointer tables])
        tickets = _tickets[pointers] = torch.zeros(len(params), dtype=torch.int32, device=device)
    chunks = chunk_table(tuple(p.numel() for p in params), device, at_least_one=True)
    lr_value, beta1, beta2, eps, weight_decay = args.hyperparameters
    if weight_decay == 0.0 or (_fp32(weight_decay) == 0.0 and not args.adam_w_mode):
        decay = _NO_DECAY  # as AdamScalars' weight_decay == 0.0 or decay == 1.0 skip it
    else:
        decay = _DECOUPLED if args.adam_w_mode else _L2
    launch(
        _adam_capturable_kernel,
        (len(chunks),),
        pointers,
        len(params),
        chunks,
        tickets,
        found_inf,
        lr if lr is not None else found_inf,  # never read without LR_TENSOR
        amax if compute_amax else found_inf,  # never touched without AMAX
        params[0],
        args.grads[0],
        args.exp_avgs[0],
        args.exp_avg_sqs[0],
        outs[0] if outs else params[0],
        *(_bits(value) for value in (lr_value, beta1, beta2, eps, weight_decay)),
        args.seed,
        DECAY=decay,
        LR_TENSOR=lr is not None,
        OUT=bool(outs),
        STOCHASTIC=bool(counters),
        AMAX=compute_amax,
        EXACT=not _INTERPRETED,
        CHUNK=CHUNK,
        BLOCK=CHUNK_BLOCK,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )
    return amax


_tickets: WeakIdKeyDictionary = WeakIdKeyDictionary()  # pointer table -> its tickets


def _bits(value: float) -> int:
    """The bits of a float64, as the kernel's int64 argument."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


@triton.jit
def _non_finite_kernel(pointers, num_tensors, chunks, found_ptr, x_like, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sets *found_ptr to 1.0 if the chunk holds a NaN or +-Inf (pointers: addresses, sizes)."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    n = tl.load(pointers + num_tensors + t)
    x_ptr = tl.load(pointers + t).to(tl.pointer_type(x_like.dtype.element_ty))
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        bad = bad | (tl.abs(x) == float("inf")).to(tl.int32) | (x != x).to(tl.int32)
    if tl.max(bad, axis=0) > 0:
        tl.store(found_ptr, 1.0)


@register_kernel("has_non_finite", "triton")
def _has_non_finite(args: HasNonFiniteArgs) -> torch.Tensor:
    found = torch.zeros((), dtype=torch.float32, device=args.tensors[0].device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in args.tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        numels = tuple(t.numel() for t in same)
        chunks = chunk_table(numels, found.device)
        launch(
            _non_finite_kernel,
            (len(chunks),),
            pointer_table(same),
            len(same),
            chunks,
            found,
            same[0],
            CHUNK=CHUNK,
            BLOCK=CHUNK_BLOCK,
        )
    return found
