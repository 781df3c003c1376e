"""Triton kernel of `cast_to_fp8_many` (CUDA tensors): many tensors cast to FP8 in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.fp8._cast_many import CastToFp8ManyArgs
from quant_core.shared._checks import FLOAT_DTYPES
from quant_core.shared._triton_launch import launch
from quant_core.shared._triton_numerics import EXACT, HARDWARE_FP8, encode_fp8, store_bytes
from quant_core.shared._triton_tables import CHUNK, CHUNK_BLOCK, chunk_table, pointer_table


@triton.jit
def _cast_chunk(
    x_ptr,
    out_ptr,
    scale,
    chunk,
    n,
    E4M3: tl.constexpr,
    HARDWARE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """codes = fp8(x * scale) of chunk `chunk` of the n elements at x_ptr, as the single cast
    kernel computes each element (`fp8/_triton.py`)."""
    for start in range(0, CHUNK, BLOCK):
        offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        store_bytes(out_ptr, offsets, encode_fp8(x.to(tl.float32) * scale, E4M3, HARDWARE), mask)


@triton.jit
def _cast_many_kernel(
    pointers,
    num_tensors,
    chunks,
    scales,
    E4M3: tl.constexpr,
    HARDWARE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of tensor t cast with scales[t]. `pointers` ([Note: pointer tables]): rows of the
    inputs' and outputs' addresses, numbers of elements and dtype codes (the index in
    FLOAT_DTYPES: fp32, bf16, fp16), so tensors of every dtype share the launch."""
    t = tl.load(chunks + 2 * tl.program_id(0))
    chunk = tl.load(chunks + 2 * tl.program_id(0) + 1).to(tl.int64)
    x_address = tl.load(pointers + t)
    out_ptr = tl.load(pointers + num_tensors + t).to(tl.pointer_type(tl.uint8))
    n = tl.load(pointers + 2 * num_tensors + t)
    dtype_code = tl.load(pointers + 3 * num_tensors + t)
    scale = tl.load(scales + t)
    if dtype_code == 0:
        _cast_chunk(x_address.to(tl.pointer_type(tl.float32)), out_ptr, scale, chunk, n, E4M3, HARDWARE, CHUNK, BLOCK)
    elif dtype_code == 1:
        _cast_chunk(x_address.to(tl.pointer_type(tl.bfloat16)), out_ptr, scale, chunk, n, E4M3, HARDWARE, CHUNK, BLOCK)
    else:
        _cast_chunk(x_address.to(tl.pointer_type(tl.float16)), out_ptr, scale, chunk, n, E4M3, HARDWARE, CHUNK, BLOCK)


@register_kernel("cast_to_fp8_many", "triton")
def _cast_to_fp8_many(args: CastToFp8ManyArgs) -> None:
    flat = [x if x.is_contiguous() else x.contiguous() for x in args.xs]  # the kernel reads flat memory
    chunks = chunk_table(tuple(x.numel() for x in flat), flat[0].device)
    if len(chunks) == 0:  # every tensor is empty
        return
    pointers = pointer_table(flat, args.outs, extra=[FLOAT_DTYPES.index(x.dtype) for x in flat])
    launch(
        _cast_many_kernel,
        (len(chunks),),
        pointers,
        len(flat),
        chunks,
        args.scales,
        E4M3=args.fp8_dtype == torch.float8_e4m3fn,
        HARDWARE=HARDWARE_FP8,
        CHUNK=CHUNK,
        BLOCK=CHUNK_BLOCK,
        **EXACT,
    )
