"""Triton kernels of the blockwise FP8 chunks ([Note: FP8 chunk rows] in quant_core.blocks._chunks):
the quantize of world_size chunks into byte rows (one program per tile of a row) and the
dequantize-and-sum of received rows (one program per tile of the chunk, looping over the rows in
rank order). The tiles of a row run along the grid's first axis, whose size may reach 2^31 - 1
(the second axis stops at 65535 programs: 64 Mi elements of 1024-element tiles); positions are
computed in int64, so a chunk may exceed 2^31 elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._chunks import DequantizeSumFp8ChunksArgs, QuantizeFp8ChunksArgs
from quant_core.blocks._triton_scales import _power_of_two_scale
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_numerics import (
    EXACT,
    FLOAT32_MAX,
    HARDWARE_FP8,
    decode_fp8,
    encode_fp8,
    encode_fp8_stochastic,
    finite_abs,
    splitmix64,
    store_values,
)

TILE = 1024  # elements per program: whole blocks of every block size
NUM_WARPS = 4


@triton.jit(do_not_specialize=["seed"])
def _quantize_chunks_kernel(
    x_ptr,
    residual_ptr,
    counter_ptr,
    out_ptr,
    chunk,
    padded,
    row_bytes,
    seed,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    E4M3: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    COUNTER: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    blocks = tl.program_id(0).to(tl.int64) * (TILE // BLOCK) + tl.arange(0, TILE // BLOCK)
    positions = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # in the padded row
    valid = positions < chunk
    index = row * chunk + positions  # x's element index (padding: never read)
    y = tl.load(x_ptr + index, mask=valid, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = y + tl.load(residual_ptr + index, mask=valid, other=0.0)
    multiplier, scale_inv = _power_of_two_scale(tl.max(finite_abs(y), axis=1), 1, E4M3)
    v = y * multiplier[:, None]
    if STOCHASTIC:
        # tl.cast, not .to: Inductor passes a seed that is constant in the graph as a Python int.
        stream = tl.cast(tl.cast(seed, tl.int64), tl.uint64, bitcast=True)  # the sum wraps modulo 2^64
        if COUNTER:
            stream = stream + tl.load(counter_ptr).to(tl.uint64, bitcast=True)
        random16 = (splitmix64(stream, index.to(tl.uint64, bitcast=True)) >> 48).to(tl.int32)
        codes = encode_fp8_stochastic(v, random16, E4M3, HARDWARE)
    else:
        codes = encode_fp8(v, E4M3, HARDWARE)
    if RESIDUAL:
        left = y - decode_fp8(codes, E4M3, HARDWARE) * scale_inv[:, None]
        tl.store(residual_ptr + index, tl.where(tl.abs(y) <= FLOAT32_MAX, left, 0.0), mask=valid)
    row_ptr = out_ptr + row * row_bytes
    tl.store(row_ptr + positions, codes, mask=positions < padded)
    bits = scale_inv.to(tl.int32, bitcast=True)
    in_row = blocks < padded // BLOCK
    for byte in tl.static_range(4):  # the fp32 scale_inv's bytes, little-endian
        tl.store(row_ptr + padded + 4 * blocks + byte, ((bits >> (8 * byte)) & 0xFF).to(tl.uint8), mask=in_row)


@register_kernel("quantize_fp8_chunks", "triton", traceable=True)
def _quantize_fp8_chunks(args: QuantizeFp8ChunksArgs) -> None:
    out = args.out
    world_size = out.shape[0]
    chunk = args.x.numel() // world_size
    padded = cdiv(chunk, args.block_size) * args.block_size
    counter = args.counter if args.stochastic_rounding else None
    launch(
        _quantize_chunks_kernel,
        (cdiv(padded, TILE), world_size),
        args.x,
        out if args.residual is None else args.residual,  # not read without a residual
        out if counter is None else counter,  # not read without a counter
        out,
        chunk,
        padded,
        out.shape[1],
        args.seed,
        BLOCK=args.block_size,
        TILE=TILE,
        E4M3=args.fp8_dtype == torch.float8_e4m3fn,
        STOCHASTIC=args.stochastic_rounding,
        COUNTER=counter is not None,
        RESIDUAL=args.residual is not None,
        HARDWARE=HARDWARE_FP8,
        num_warps=NUM_WARPS,
        **EXACT,
    )


@triton.jit
def _dequantize_sum_kernel(
    received_ptr,
    out_ptr,
    world_size,
    chunk,
    padded,
    row_bytes,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    E4M3: tl.constexpr,
    AVERAGE: tl.constexpr,
    HARDWARE: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * (TILE // BLOCK) + tl.arange(0, TILE // BLOCK)
    positions = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = positions < chunk
    in_row = blocks < padded // BLOCK
    total = _dequantized_row(received_ptr, positions, valid, blocks, in_row, padded, E4M3, HARDWARE)
    for rank in range(1, world_size):  # rank order; row 0 starts the sum (0 + v would turn -0 into +0)
        row_ptr = received_ptr + tl.cast(rank, tl.int64) * row_bytes
        total = total + _dequantized_row(row_ptr, positions, valid, blocks, in_row, padded, E4M3, HARDWARE)
    if AVERAGE:
        total = tl.div_rn(total, tl.zeros_like(total) + world_size)  # one IEEE division
    store_values(out_ptr, positions, total, valid)


@triton.jit
def _dequantized_row(row_ptr, positions, valid, blocks, in_row, padded, E4M3: tl.constexpr, HARDWARE: tl.constexpr):
    """fp32(code) * scale_inv of one row's elements at `positions` (blocks, BLOCK)."""
    codes = tl.load(row_ptr + positions, mask=valid, other=0)
    bits = tl.zeros(blocks.shape, tl.int32)
    for byte in tl.static_range(4):
        part = tl.load(row_ptr + padded + 4 * blocks + byte, mask=in_row, other=0).to(tl.int32)
        bits = bits | (part << (8 * byte))
    return decode_fp8(codes, E4M3, HARDWARE) * bits.to(tl.float32, bitcast=True)[:, None]


@register_kernel("dequantize_sum_fp8_chunks", "triton", traceable=True)
def _dequantize_sum_fp8_chunks(args: DequantizeSumFp8ChunksArgs) -> None:
    received, out = args.received, args.out
    chunk = out.numel()
    padded = cdiv(chunk, args.block_size) * args.block_size
    launch(
        _dequantize_sum_kernel,
        (cdiv(chunk, TILE),),
        received,
        out,
        received.shape[0],
        chunk,
        padded,
        received.shape[1],
        BLOCK=args.block_size,
        TILE=TILE,
        E4M3=args.fp8_dtype == torch.float8_e4m3fn,
        AVERAGE=args.average,
        HARDWARE=HARDWARE_FP8,
        num_warps=NUM_WARPS,
        **EXACT,
    )
