"""Triton kernel of `amax_many` (CUDA tensors): the amaxes of many tensors in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.fp8._amax_many import AmaxManyArgs
from quant_core.shared._checks import FLOAT_DTYPES
from quant_core.shared._triton_launch import launch
from quant_core.shared._triton_numerics import finite_abs
from quant_core.shared._triton_tables import CHUNK, CHUNK_BLOCK, chunk_table, pointer_table


@triton.jit
def _chunk_amax(x_ptr, chunk, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """max |x| over the finite elements of chunk `chunk` of the n elements at x_ptr (0 if none)."""
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, finite_abs(tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)))
    return tl.max(largest, axis=0)


@triton.jit
def _amax_many_kernel(pointers, num_tensors, chunks, amax_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of tensor t merged into amax_ptr[t] (one atomic; amaxes are >= 0, so the float
    atomic max is exact). `pointers` ([Note: pointer tables]): rows of addresses, numbers of
    elements and dtype codes (the index in FLOAT_DTYPES: fp32, bf16, fp16), so tensors of every
    dtype share the launch."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    address = tl.load(pointers + t)
    n = tl.load(pointers + num_tensors + t)
    dtype_code = tl.load(pointers + 2 * num_tensors + t)
    if dtype_code == 0:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.float32)), chunk, n, CHUNK, BLOCK)
    elif dtype_code == 1:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.bfloat16)), chunk, n, CHUNK, BLOCK)
    else:
        largest = _chunk_amax(address.to(tl.pointer_type(tl.float16)), chunk, n, CHUNK, BLOCK)
    tl.atomic_max(amax_ptr + t, largest)


@register_kernel("amax_many", "triton")
def _amax_many(args: AmaxManyArgs) -> torch.Tensor:
    tensors = args.tensors
    device = tensors[0].device
    amax = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]  # the kernel reads flat memory
    chunks = chunk_table(tuple(t.numel() for t in flat), device)
    if len(chunks) == 0:  # every tensor is empty
        return amax
    pointers = pointer_table(flat, extra=[FLOAT_DTYPES.index(t.dtype) for t in flat])
    # Nothing to fuse (abs and max only); stated because Triton 3.9 warns when it is left unset.
    launch(
        _amax_many_kernel,
        (len(chunks),),
        pointers,
        len(flat),
        chunks,
        amax,
        CHUNK=CHUNK,
        BLOCK=CHUNK_BLOCK,
        enable_fp_fusion=False,
    )
    return amax
