"""Triton kernels of the Adam step (CUDA tensors): the step, the amaxes of updated fp8 moments and
the non-finite check.

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
from quant_core.adam._adam import AdamScalars, AdamStepArgs, HasNonFiniteArgs
from quant_core.adam._fp8_moments import fp8_rows
from quant_core.adam._moment_amaxes import AdamMomentAmaxesArgs
from quant_core.fp8._triton_scale import scale_of
from quant_core.shared._triton_launch import launch
from quant_core.shared._triton_numerics import (
    HARDWARE_FP8,
    as_bytes,
    decode_fp8,
    encode_fp8,
    finite_abs,
    round_to_bfloat16_stochastic,
    splitmix64,
    store_bytes,
)
from quant_core.shared._triton_tables import CHUNK, CHUNK_BLOCK, chunk_table, pointer_table

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Weight decay variants, as the Adam kernel takes them (a compile-time constant).
_NO_DECAY, _DECOUPLED, _L2 = 0, 1, 2
# How a moment is stored, as the kernels take it (a compile-time constant per moment list).
_FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # 0: not fp8 (fp32 or bf16)


def _fp8_kind(moments: list[torch.Tensor]) -> int:
    return _FP8_KINDS.get(moments[0].dtype, 0)


@triton.jit
def _adam_update(
    p, g, m, v, decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias_correction2_sqrt, eps,
    step_size, DECAY: tl.constexpr,
):  # fmt: skip
    """[Note: Adam numerics] on fp32 values: the updated (p, m, v). DECAY 1 decays p (AdamW), 2
    adds weight_decay * p to the gradient (Adam with L2)."""
    if DECAY == 1:
        p = p * decay
    m, v = _updated_moments(p, g, m, v, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, DECAY)
    denom = tl.sqrt_rn(v) * inv_bias_correction2_sqrt + eps
    return p - tl.div_rn(m, denom) * step_size, m, v


@triton.jit
def _updated_moments(p, g, m, v, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, DECAY: tl.constexpr):
    """The moments' lines of `_adam_update` (shared with the fp8 moments' amax pass, so both make
    the same values bit for bit)."""
    if DECAY == 2:
        g = g + p * weight_decay
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    return m, v


@triton.jit
def _load_moment(ptr, offsets, mask, scale_inv, FP8: tl.constexpr, HARDWARE: tl.constexpr):
    """A moment as fp32: fp8 codes (FP8 1: E4M3, 2: E5M2) decoded as dequantize_fp8 decodes them
    (code * scale_inv, canonical NaN), other dtypes read as they are."""
    if FP8 > 0:
        values = decode_fp8(as_bytes(tl.load(ptr + offsets, mask=mask, other=0.0)), FP8 == 1, HARDWARE) * scale_inv
        values = tl.where(values != values, float("nan"), values)
    else:
        values = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return values


@triton.jit
def _store_moment(ptr, offsets, mask, values, scale, FP8: tl.constexpr, HARDWARE: tl.constexpr):
    """Stores an updated moment: fp8 codes of values * scale (as cast_to_fp8), else rounded to its dtype."""
    if FP8 > 0:
        store_bytes(ptr, offsets, encode_fp8(values * scale, FP8 == 1, HARDWARE), mask)
    else:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_moment_scales(pointers, row, num_tensors, t, amax_ptr, amax_row, FP8: tl.constexpr):
    """(pointer to its scale_inv, the stored scale_inv, the new scale, the new scale_inv) of tensor
    t's fp8 moment whose scale_invs are at row `row` of the pointer table and whose amax is at
    row `amax_row` of the amaxes."""
    scale_inv_ptr = tl.load(pointers + row * num_tensors + t).to(tl.pointer_type(tl.float32))
    fmax = 448.0 if FP8 == 1 else 57344.0
    scale, new_scale_inv = scale_of(tl.load(amax_ptr + amax_row * num_tensors + t), fmax, 1.0, False)
    return scale_inv_ptr, tl.load(scale_inv_ptr), scale, new_scale_inv


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
def _adam_kernel(
    pointers,
    num_tensors,
    chunks,
    tickets,
    found_ptr,
    lr_ptr,
    amax_ptr,
    moment_amax_ptr,
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
    FOUND: tl.constexpr,
    LR_TENSOR: tl.constexpr,
    OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    AMAX: tl.constexpr,
    M_FP8: tl.constexpr,
    V_FP8: tl.constexpr,
    HARDWARE: tl.constexpr,
    EXACT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of one tensor of [Note: Adam step in tensors]. `pointers` ([Note: pointer
    tables]): rows of parameters, gradients, moments, step counts, outs (when OUT), counters (when
    STOCHASTIC: bf16 params rounded stochastically, [Note: Adam stochastic rounding]), the fp8
    moments' scale_invs (a row per fp8 moment list: M_FP8, V_FP8 1 for E4M3, 2 for E5M2; their
    amaxes in the rows of moment_amax_ptr, [Note: fp8 moments in the Adam pass]) and numels;
    `tickets` int32 (num_tensors,) zeros, restored to zero by the last program of each tensor.
    Scalars as AdamScalars.of computes them, in float64 from the hyperparameters' bits. FOUND:
    found_ptr holds the verdict (nonzero: skip), else it is not read."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    scale_row: tl.constexpr = 5 + OUT + STOCHASTIC  # the first fp8 moment list's scale_invs
    m_rows: tl.constexpr = 1 if M_FP8 > 0 else 0
    v_rows: tl.constexpr = 1 if V_FP8 > 0 else 0
    n = tl.load(pointers + (scale_row + m_rows + v_rows) * num_tensors + t)
    p_ptr = tl.load(pointers + t).to(tl.pointer_type(p_like.dtype.element_ty))
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    skipped = False
    if FOUND:
        skipped = tl.load(found_ptr) != 0.0
    if skipped:  # skipped: nothing is written; the amaxes of the parameters as they are
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
        count = tl.load(step_ptr)
        step = count.to(tl.int32) + 1
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
            # seed is typed int32 or int64 by its value (a Python int where Inductor holds it constant):
            # widened first; the sum wraps modulo 2^64.
            stream = tl.cast(tl.cast(seed, tl.int64), tl.uint64, bitcast=True) + counter.to(tl.uint64, bitcast=True)
        # fp8 moments: every program reads the stored scale_invs here, the last one sets the new ones.
        m_scale_inv, m_scale, v_scale_inv, v_scale = 1.0, 1.0, 1.0, 1.0
        if M_FP8 > 0:
            m_scale_inv_ptr, m_scale_inv, m_scale, m_new_scale_inv = _fp8_moment_scales(
                pointers, scale_row, num_tensors, t, moment_amax_ptr, 0, M_FP8
            )
        if V_FP8 > 0:
            v_scale_inv_ptr, v_scale_inv, v_scale, v_new_scale_inv = _fp8_moment_scales(
                pointers, scale_row + m_rows, num_tensors, t, moment_amax_ptr, m_rows, V_FP8
            )
        for start in range(0, CHUNK, BLOCK):
            offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
            mask = offsets < n
            p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            m = _load_moment(m_ptr, offsets, mask, m_scale_inv, M_FP8, HARDWARE)
            v = _load_moment(v_ptr, offsets, mask, v_scale_inv, V_FP8, HARDWARE)
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
            _store_moment(m_ptr, offsets, mask, m, m_scale, M_FP8, HARDWARE)
            _store_moment(v_ptr, offsets, mask, v, v_scale, V_FP8, HARDWARE)
            if OUT:
                tl.store(o_ptr + offsets, p.to(o_ptr.dtype.element_ty), mask=mask)
            if AMAX:
                largest = tl.maximum(largest, tl.where(mask, finite_abs(p), 0.0))
        # Every program of tensor t read its step count (and counter) above; the last one to get
        # here writes them (acq_rel atomics order those reads before these writes) and resets the ticket.
        if tl.atomic_add(tickets + t, 1) == tl.cdiv(tl.maximum(n, 1), CHUNK) - 1:
            tl.store(step_ptr, count + 1.0)
            if STOCHASTIC:
                tl.store(counter_ptr, counter + 1)
            if M_FP8 > 0:
                tl.store(m_scale_inv_ptr, m_new_scale_inv)
            if V_FP8 > 0:
                tl.store(v_scale_inv_ptr, v_new_scale_inv)
            tl.store(tickets + t, 0)
    if AMAX:
        tl.atomic_max(amax_ptr + t, tl.max(largest, axis=0))


@register_kernel("adam_step", "triton")
def _adam_step(args: AdamStepArgs) -> torch.Tensor:
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
        *((args.moment_scale_invs,) if args.moment_scale_invs else ()),  # a row per fp8 moment list
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
        _adam_kernel,
        (len(chunks),),
        pointers,
        len(params),
        chunks,
        tickets,
        found_inf if found_inf is not None else args.steps[0],  # never read without FOUND
        lr if lr is not None else args.steps[0],  # never read without LR_TENSOR
        amax if compute_amax else args.steps[0],  # never touched without AMAX
        args.moment_amaxes if args.moment_amaxes is not None else args.steps[0],  # read only with fp8 moments
        params[0],
        args.grads[0],
        args.exp_avgs[0],
        args.exp_avg_sqs[0],
        outs[0] if outs else params[0],
        *(_bits(value) for value in (lr_value, beta1, beta2, eps, weight_decay)),
        args.seed,
        DECAY=decay,
        FOUND=found_inf is not None,
        LR_TENSOR=lr is not None,
        OUT=bool(outs),
        STOCHASTIC=bool(counters),
        AMAX=compute_amax,
        M_FP8=_fp8_kind(args.exp_avgs),
        V_FP8=_fp8_kind(args.exp_avg_sqs),
        HARDWARE=HARDWARE_FP8,
        EXACT=not _INTERPRETED,
        CHUNK=CHUNK,
        BLOCK=CHUNK_BLOCK,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )
    return amax


_tickets: WeakIdKeyDictionary = WeakIdKeyDictionary()  # pointer table -> its tickets


@triton.jit
def _moment_amaxes_kernel(
    pointers, num_tensors, chunks, amax_ptr, p_like, g_like, m_like, v_like, weight_decay, beta1, one_minus_beta1,
    beta2, one_minus_beta2, DECAY: tl.constexpr, M_FP8: tl.constexpr, V_FP8: tl.constexpr, HARDWARE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The amaxes of one chunk of one tensor's updated fp8 moments ([Note: fp8 moments in the Adam
    pass]), atomically maxed into row r of amax_ptr for the r-th fp8 moment list; the moments'
    arithmetic of `_adam_kernel` (`_updated_moments`), nothing written. `pointers`:
    rows of parameters (read with DECAY 2, L2), gradients, moments, the fp8 moments' scale_invs
    and numels."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    m_rows: tl.constexpr = 1 if M_FP8 > 0 else 0
    v_rows: tl.constexpr = 1 if V_FP8 > 0 else 0
    n = tl.load(pointers + (4 + m_rows + v_rows) * num_tensors + t)
    p_ptr = tl.load(pointers + t).to(tl.pointer_type(p_like.dtype.element_ty))
    g_ptr = tl.load(pointers + num_tensors + t).to(tl.pointer_type(g_like.dtype.element_ty))
    m_ptr = tl.load(pointers + 2 * num_tensors + t).to(tl.pointer_type(m_like.dtype.element_ty))
    v_ptr = tl.load(pointers + 3 * num_tensors + t).to(tl.pointer_type(v_like.dtype.element_ty))
    m_scale_inv, v_scale_inv = 1.0, 1.0
    if M_FP8 > 0:
        m_scale_inv = tl.load(tl.load(pointers + 4 * num_tensors + t).to(tl.pointer_type(tl.float32)))
    if V_FP8 > 0:
        v_scale_inv = tl.load(tl.load(pointers + (4 + m_rows) * num_tensors + t).to(tl.pointer_type(tl.float32)))
    m_largest = tl.zeros((BLOCK,), dtype=tl.float32)
    v_largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        p = g * 0.0
        if DECAY == 2:
            p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = g * 0.0  # moments that are not fp8 are not read (their values go unused)
        v = g * 0.0
        if M_FP8 > 0:
            m = _load_moment(m_ptr, offsets, mask, m_scale_inv, M_FP8, HARDWARE)
        if V_FP8 > 0:
            v = _load_moment(v_ptr, offsets, mask, v_scale_inv, V_FP8, HARDWARE)
        m, v = _updated_moments(p, g, m, v, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, DECAY)
        m_largest = tl.maximum(m_largest, tl.where(mask, finite_abs(m), 0.0))
        v_largest = tl.maximum(v_largest, tl.where(mask, finite_abs(v), 0.0))
    if M_FP8 > 0:
        tl.atomic_max(amax_ptr + t, tl.max(m_largest, axis=0))
    if V_FP8 > 0:
        tl.atomic_max(amax_ptr + m_rows * num_tensors + t, tl.max(v_largest, axis=0))


@register_kernel("adam_moment_amaxes", "triton")
def _adam_moment_amaxes(args: AdamMomentAmaxesArgs, scalars: AdamScalars) -> torch.Tensor:
    params, exp_avgs, exp_avg_sqs = args.params, args.exp_avgs, args.exp_avg_sqs
    device = params[0].device
    amaxes = torch.zeros(len(fp8_rows(exp_avgs, exp_avg_sqs)), len(params), dtype=torch.float32, device=device)
    pointers = pointer_table(params, args.grads, exp_avgs, exp_avg_sqs, args.moment_scale_invs)
    chunks = chunk_table(tuple(p.numel() for p in params), device)
    if len(chunks) == 0:  # every tensor empty: the amaxes are 0
        return amaxes
    launch(
        _moment_amaxes_kernel,
        (len(chunks),),
        pointers,
        len(params),
        chunks,
        amaxes,
        params[0],
        args.grads[0],
        exp_avgs[0],
        exp_avg_sqs[0],
        scalars.weight_decay,
        scalars.beta1,
        scalars.one_minus_beta1,
        scalars.beta2,
        scalars.one_minus_beta2,
        DECAY=_L2 if scalars.weight_decay != 0.0 else _NO_DECAY,  # as adam_moment_amaxes_reference
        M_FP8=_fp8_kind(exp_avgs),
        V_FP8=_fp8_kind(exp_avg_sqs),
        HARDWARE=HARDWARE_FP8,
        CHUNK=CHUNK,
        BLOCK=CHUNK_BLOCK,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )
    return amaxes


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
