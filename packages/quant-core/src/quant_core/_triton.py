"""The Triton backend (CUDA tensors): Adam, the non-finite check and the amaxes of many tensors
here; importing this module also registers the quantize, dequantize and transpose kernels of
every format (`_triton_fp8`, `_triton_blocks`, `_triton_nvfp4`, sharing `_triton_numerics`), so
every op has a Triton kernel.

[Note: exact Triton arithmetic] By default Triton contracts `a * b + c` into a fused
multiply-add and lowers `/` and `sqrt` to approximate instructions; libdevice's explicitly
rounded functions (`mul_rn`, ...) flush subnormals to zero (Triton builds libdevice with FTZ).
Kernels that must equal the reference bit for bit are therefore launched with
`enable_fp_fusion=False` and use plain `*`, `+`, `-` with `tl.div_rn` and `tl.sqrt_rn`
(IEEE round to nearest even, subnormals kept).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

import quant_core._triton_scale  # noqa: F401  (registers the FP8 scale kernels)
from quant_core import _triton_blocks, _triton_fp8, _triton_nvfp4  # noqa: F401  (register their kernels)
from quant_core._adam import AdamScalars
from quant_core._backend import register_kernel
from quant_core._checks import FLOAT_DTYPES
from quant_core._triton_launch import cdiv, launch
from quant_core._triton_numerics import finite_abs

_CHUNK = 16384  # elements per program: BLOCK-sized steps over one chunk of one tensor
_BLOCK = 1024
# Weight decay variants, as the Adam kernel takes them (a compile-time constant).
_NO_DECAY, _DECOUPLED, _L2 = 0, 1, 2


def _chunk_table(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(tensor index, chunk index) of every program of a multi-tensor launch, as int32 (n, 2)."""
    key = (numels, device)
    table = _chunk_tables.get(key)
    if table is None:
        rows = [(t, c) for t, n in enumerate(numels) for c in range(cdiv(n, _CHUNK))]
        table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2).to(device)
        if len(_chunk_tables) > 64:  # shapes of one model: a handful of keys; bound it anyway
            _chunk_tables.clear()
        _chunk_tables[key] = table
    return table


_chunk_tables: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _pointer_table(*lists: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 (len(lists[0]), len(lists) + 1): row t holds the data pointers of tensor t of each
    list, then its number of elements (one host-to-device copy per launch)."""
    rows = [[t.data_ptr() for t in tensors] + [tensors[0].numel()] for tensors in zip(*lists, strict=True)]
    return torch.tensor(rows, dtype=torch.int64).to(lists[0][0].device)


@triton.jit
def _adam_kernel(
    pointers,
    chunks,
    amax_ptr,
    p_like,
    g_like,
    m_like,
    v_like,
    decay,
    weight_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    inv_bias_correction2_sqrt,
    eps,
    step_size,
    DECAY: tl.constexpr,
    AMAX: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of one tensor of [Note: Adam numerics]. Row t of `pointers` holds the addresses
    of parameter, gradient and moments t and their size; `*_like` are tensors of each list, for
    their dtypes.
    Moments are stored in their dtype (fp32, or bf16 rounded to nearest even); with AMAX, max |p|
    over finite updated values is merged into amax_ptr[t]."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    n = tl.load(pointers + 5 * t + 4)
    p_ptr = tl.load(pointers + 5 * t).to(tl.pointer_type(p_like.dtype.element_ty))
    g_ptr = tl.load(pointers + 5 * t + 1).to(tl.pointer_type(g_like.dtype.element_ty))
    m_ptr = tl.load(pointers + 5 * t + 2).to(tl.pointer_type(m_like.dtype.element_ty))
    v_ptr = tl.load(pointers + 5 * t + 3).to(tl.pointer_type(v_like.dtype.element_ty))
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(p_ptr + offsets, mask=mask, other=0.0)
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if DECAY == 1:
            p = p * decay
        if DECAY == 2:
            g = g + p * weight_decay
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        denom = tl.sqrt_rn(v) * inv_bias_correction2_sqrt + eps
        p = p - tl.div_rn(m, denom) * step_size
        tl.store(p_ptr + offsets, p, mask=mask)
        tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            magnitude = tl.abs(p)
            largest = tl.maximum(largest, tl.where(mask & (magnitude < float("inf")), magnitude, 0.0))
    if AMAX:
        tl.atomic_max(amax_ptr + t, tl.max(largest, axis=0))


@register_kernel("adam_step", "triton")
def _adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: AdamScalars,
    compute_amax: bool,
) -> torch.Tensor | None:
    device = params[0].device
    amax = torch.zeros(len(params), dtype=torch.float32, device=device) if compute_amax else None
    numels = tuple(p.numel() for p in params)
    chunks = _chunk_table(numels, device)
    if len(chunks) == 0:
        return amax
    decay = _DECOUPLED if scalars.decay != 1.0 else _L2 if scalars.weight_decay != 0.0 else _NO_DECAY
    launch(
        _adam_kernel,
        (len(chunks),),
        _pointer_table(params, grads, exp_avgs, exp_avg_sqs),
        chunks,
        amax if amax is not None else chunks,  # never touched without AMAX
        params[0],
        grads[0],
        exp_avgs[0],
        exp_avg_sqs[0],
        scalars.decay,
        scalars.weight_decay,
        scalars.beta1,
        scalars.one_minus_beta1,
        scalars.beta2,
        scalars.one_minus_beta2,
        scalars.inv_bias_correction2_sqrt,
        scalars.eps,
        scalars.step_size,
        DECAY=decay,
        AMAX=compute_amax,
        CHUNK=_CHUNK,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,  # [Note: exact Triton arithmetic]
    )
    return amax


@triton.jit
def _non_finite_kernel(pointers, chunks, found_ptr, x_like, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sets *found_ptr to 1.0 if the chunk holds a NaN or +-Inf (pointers: address, size)."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    n = tl.load(pointers + 2 * t + 1)
    x_ptr = tl.load(pointers + 2 * t).to(tl.pointer_type(x_like.dtype.element_ty))
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        bad = bad | (tl.abs(x) == float("inf")).to(tl.int32) | (x != x).to(tl.int32)
    if tl.max(bad, axis=0) > 0:
        tl.store(found_ptr, 1.0)


@register_kernel("has_non_finite", "triton")
def _has_non_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        numels = tuple(t.numel() for t in same)
        chunks = _chunk_table(numels, found.device)
        launch(
            _non_finite_kernel,
            (len(chunks),),
            _pointer_table(same),
            chunks,
            found,
            same[0],
            CHUNK=_CHUNK,
            BLOCK=_BLOCK,
        )
    return found


@triton.jit
def _chunk_amax(x_ptr, chunk, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """max |x| over the finite elements of chunk `chunk` of the n elements at x_ptr (0 if none)."""
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, finite_abs(tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)))
    return tl.max(largest, axis=0)


@triton.jit
def _amax_many_kernel(pointers, chunks, amax_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of tensor t merged into amax_ptr[t] (one atomic; amaxes are >= 0, so the float
    atomic max is exact). Row t of `pointers`: address, number of elements, dtype code (the index
    in FLOAT_DTYPES: fp32, bf16, fp16), so tensors of every dtype share the launch."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    address = tl.load(pointers + 3 * t)
    n = tl.load(pointers + 3 * t + 1)
    dtype_code = tl.load(pointers + 3 * t + 2)
    if dtype_code == 0:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.float32)), chunk, n, CHUNK, BLOCK)
    elif dtype_code == 1:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.bfloat16)), chunk, n, CHUNK, BLOCK)
    else:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.float16)), chunk, n, CHUNK, BLOCK)
    tl.atomic_max(amax_ptr + t, largest)


@register_kernel("amax_many", "triton")
def _amax_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    device = tensors[0].device
    amax = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # the kernel reads flat memory
    chunks = _chunk_table(tuple(t.numel() for t in flat), device)
    if len(chunks) == 0:  # every tensor is empty
        return amax
    rows = [[t.data_ptr(), t.numel(), FLOAT_DTYPES.index(t.dtype)] for t in flat]
    pointers = torch.tensor(rows, dtype=torch.int64).to(device)
    # Nothing to fuse (abs and max only); stated because Triton 3.9 warns when it is left unset.
    launch(
        _amax_many_kernel, (len(chunks),), pointers, chunks, amax, CHUNK=_CHUNK, BLOCK=_BLOCK, enable_fp_fusion=False
    )
    return amax
