"""Blockwise FP8 chunks for a quantized reduce-scatter: quantize a flat buffer of `world_size`
equal chunks into one byte row per chunk, and dequantize-and-sum the rows a rank receives.

[Note: FP8 chunk rows] x (fp32/bf16/fp16, read flat) holds `world_size` equal chunks of `chunk`
elements. Each chunk, zero-padded to `padded` = a multiple of `block_size` (16, 32, 64 or 128),
is quantized in 1 x block_size blocks with blockwise FP8's power-of-two scales (docs/design.md,
'Numerics': the scale is the largest power of two with block_amax * scale <= fmax, 1 for an
all-zero block; codes fp8(v * scale); stored scale_inv = 1 / scale, fp32), bit for bit the
codes and scales of `quantize_fp8_blockwise` on the padded chunk's blocks. Row i of the uint8
output (world_size, padded + 4 * padded / block_size) is chunk i's codes, then its fp32
scale_invs' bytes in the machine's byte order: what quant-fsdp's FP8 reduce-scatter sends to
rank i. Options of the quantize:
- stochastic rounding ([Note: FP8 stochastic rounding] in quant_core.shared._numerics): element
  j of x (j = i * chunk + position in chunk) draws random16(seed + counter, j) ([Note: counter
  RNG]); `counter` a 0-d int64 tensor on x's device (its uint64 bits; seed + counter wraps
  modulo 2^64), read and left as it is, so a caller advances it between calls without a sync.
  Padding elements are zeros, which no draw rounds away from 0.
- error feedback: `residual` (fp32, x's numel) is added to x first, y = fp32(x) + residual (one
  fp32 add), y is quantized, and residual is overwritten with y - fp32(code) * scale_inv, the part
  of y the codes do not carry (0 where y is NaN or +-Inf, so one non-finite gradient does not
  poison every later step).
The dequantize-and-sum reads rows of that layout (its world_size rows: row i from rank i) and
writes out[k] = the fp32 sum in rank order ((v0 + v1) + v2 ...) of v_i = fp32(code_i[k]) *
scale_inv_i of k's block, divided by world_size for AVG (one IEEE fp32 division), rounded once
to out's dtype (fp32/bf16/fp16, nearest even, canonical NaN).

Operators ([Note: custom ops]; kernels take the arguments tuple):
- `torch.ops.quant_core.quantize_fp8_chunks(x, block_size, fp8_dtype, stochastic_rounding, seed,
  counter, residual, out) -> ()`: x contiguous, numel a multiple of out.shape[0]; out uint8
  (world_size, row bytes) contiguous; residual None or contiguous fp32 of x's numel; counter None
  or a 0-d int64 tensor on x's device (read only with stochastic rounding); seed an int in int64
  range. Fills out (and residual).
- `torch.ops.quant_core.dequantize_sum_fp8_chunks(received, block_size, fp8_dtype, average,
  out) -> ()`: received uint8 (world_size, row bytes of out.numel() elements) contiguous; out
  contiguous fp32/bf16/fp16. Fills out.
C++ in csrc/chunks.cpp, Triton in `_triton_chunks`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from quant_core._library import call, define_op, register_kernel
from quant_core.blocks._blockwise import _block_scale
from quant_core.shared._checks import check_float_input, check_fp8_dtype, check_output_dtype, output_buffer
from quant_core.shared._cpp import _C, DTYPE_CODES, FP8_FORMAT_CODES, pointer
from quant_core.shared._numerics import (
    encode_fp8,
    encode_fp8_stochastic,
    finite_abs,
    random16,
    signed64,
    to_output_dtype,
)

CHUNK_BLOCK_SIZES = (16, 32, 64, 128)
SCALE_BYTES = 4  # one fp32 scale_inv per block


def chunk_row_bytes(chunk: int, block_size: int) -> int:
    """Bytes of one row of [Note: FP8 chunk rows]: the padded chunk's codes and its blocks' fp32 scales."""
    blocks = -(-chunk // block_size)
    return blocks * (block_size + SCALE_BYTES)


def _check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in CHUNK_BLOCK_SIZES:
        raise ValueError(
            f"block_size must divide 128 and be a multiple of 16 (one of {CHUNK_BLOCK_SIZES}), got {block_size!r}"
        )
    return block_size  # type: ignore[return-value]


def _check_counter(counter: object, device: torch.device) -> torch.Tensor | None:
    if counter is None:
        return None
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int64 or counter.dim() != 0:
        got = (
            f"a {counter.dtype} tensor of shape {tuple(counter.shape)}"
            if isinstance(counter, torch.Tensor)
            else counter
        )
        raise ValueError(
            f"counter must be a 0-d int64 tensor, got {got} (keep it as torch.zeros((), dtype=torch.int64) and add to "
            "it in place between calls)"
        )
    if counter.device != device:
        raise ValueError(f"counter is on {counter.device} but x is on {device}; move it with .to({str(device)!r})")
    return counter


def _check_chunks(x: object, world_size: object, block_size: object) -> tuple[torch.Tensor, int, int]:
    """(x, world_size, chunk) after the checks of the quantize's x, world_size and block_size."""
    check_float_input(x)
    assert isinstance(x, torch.Tensor)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int (the number of chunks), got {world_size!r}")
    if x.numel() % world_size:
        raise ValueError(
            f"x holds world_size ({world_size}) equal chunks, but its {x.numel()} elements do not divide by "
            f"{world_size}: pad it to a multiple of {world_size}"
        )
    _check_block_size(block_size)
    return x, world_size, x.numel() // world_size


def quantize_fp8_chunks_reference(
    x: torch.Tensor,
    world_size: int,
    block_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    counter: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch [Note: FP8 chunk rows] (the spec in code): the (world_size, row bytes) uint8
    rows; `residual`, when given, is updated in place."""
    x, world_size, chunk = _check_chunks(x, world_size, block_size)
    fmax = torch.finfo(check_fp8_dtype(fp8_dtype)).max
    blocks = -(-chunk // block_size)
    padded = blocks * block_size
    y = x.reshape(world_size, chunk).float()
    if residual is not None:
        y = y + residual.reshape(world_size, chunk)
    values = F.pad(y, (0, padded - chunk)).reshape(world_size * blocks, block_size)
    scale = _block_scale(finite_abs(values).amax(dim=1, keepdim=True), fmax, True)
    scaled = values * scale
    if stochastic_rounding:
        stream = torch.tensor(signed64(seed), dtype=torch.int64, device=x.device)
        if counter is not None:
            stream = stream + counter
        rows = torch.arange(world_size, device=x.device)[:, None] * chunk
        index = (rows + torch.arange(padded, device=x.device)[None, :]).reshape(scaled.shape)
        codes = encode_fp8_stochastic(scaled, fp8_dtype, random16(stream, index))
    else:
        codes = encode_fp8(scaled, fp8_dtype)
    scale_inv = torch.reciprocal(scale)
    if residual is not None:
        sent = (codes.float() * scale_inv).reshape(world_size, padded)[:, :chunk]
        residual.copy_(torch.where(torch.isfinite(y), y - sent, 0.0).reshape(residual.shape))
    code_bytes = codes.view(torch.uint8).reshape(world_size, padded)
    scale_bytes = scale_inv.reshape(world_size, blocks).view(torch.uint8)
    return torch.cat((code_bytes, scale_bytes), dim=1)


def quantize_fp8_chunks(
    x: torch.Tensor,
    world_size: int,
    block_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    counter: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 rows of x's `world_size` chunks, one per destination rank ([Note: FP8 chunk rows]).

    Args:
        x: fp32/bf16/fp16, read flat; its numel a multiple of world_size.
        world_size: the number of chunks (and rows).
        block_size: elements per 1 x block_size block: 16, 32, 64 or 128.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        stochastic_rounding: round the codes stochastically, element j drawing from the counter
            RNG stream `seed + counter` at index j.
        seed: the stream's base, an int (its low 64 bits count).
        counter: None or a 0-d int64 tensor on x's device added to seed (read, not changed).
        residual: error feedback: fp32 of x's numel on x's device, added to x before quantizing
            and overwritten with what the codes do not carry.
        out: a (world_size, row bytes) uint8 buffer to fill instead of a new one.

    Returns:
        uint8 (world_size, ceil(chunk / block_size) * (block_size + 4)): row i = chunk i's codes,
        then its blocks' fp32 scale_invs.
    """
    x, world_size, chunk = _check_chunks(x, world_size, block_size)
    check_fp8_dtype(fp8_dtype)
    counter = _check_counter(counter, x.device)
    if residual is not None and (
        not isinstance(residual, torch.Tensor)
        or residual.dtype != torch.float32
        or residual.numel() != x.numel()
        or residual.device != x.device
        or not residual.is_contiguous()
    ):
        got = (
            f"{residual.dtype} of {residual.numel()} elements on {residual.device}"
            if isinstance(residual, torch.Tensor)
            else type(residual).__name__
        )
        raise ValueError(
            f"residual must be a contiguous float32 tensor of x's {x.numel()} elements on {x.device}, got {got}"
        )
    shape = (world_size, chunk_row_bytes(chunk, block_size))
    out = output_buffer(out, "out", shape, torch.uint8, x.device)
    call(
        "quantize_fp8_chunks",
        x.reshape(-1).contiguous(),
        block_size,
        fp8_dtype,
        stochastic_rounding,
        signed64(seed),
        counter,
        residual,
        out,
    )
    return out


def _check_received(received: object, chunk: object, block_size: object) -> tuple[torch.Tensor, int]:
    """(received, chunk) after the checks of the dequantize-and-sum's rows."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int (elements per chunk), got {chunk!r}")
    _check_block_size(block_size)
    row_bytes = chunk_row_bytes(chunk, block_size)  # type: ignore[arg-type]
    if not isinstance(received, torch.Tensor) or received.dtype != torch.uint8 or received.dim() != 2:
        got = (
            f"{received.dtype} of shape {tuple(received.shape)}"
            if isinstance(received, torch.Tensor)
            else type(received).__name__
        )
        raise ValueError(f"received must be a 2-D uint8 tensor (world_size, {row_bytes}), got {got}")
    if received.shape[0] == 0 or received.shape[1] != row_bytes:
        raise ValueError(
            f"received must have one row of {row_bytes} bytes per rank (chunk {chunk}, block_size {block_size}), "
            f"got shape {tuple(received.shape)}"
        )
    return received, chunk  # type: ignore[return-value]


def dequantize_sum_fp8_chunks_reference(
    received: torch.Tensor,
    chunk: int,
    block_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    average: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch dequantize-and-sum of [Note: FP8 chunk rows] (the spec in code)."""
    received, chunk = _check_received(received, chunk, block_size)
    check_fp8_dtype(fp8_dtype)
    check_output_dtype(dtype)
    world_size = received.shape[0]
    if chunk == 0:
        return torch.empty(0, dtype=dtype, device=received.device)
    blocks = -(-chunk // block_size)
    padded = blocks * block_size
    codes = received[:, :padded].contiguous().view(fp8_dtype).reshape(world_size * blocks, block_size)
    scale_inv = received[:, padded:].contiguous().view(torch.float32).reshape(-1, 1)
    values = (codes.float() * scale_inv).reshape(world_size, padded)[:, :chunk]
    total = values[0].clone()
    for rank in range(1, world_size):
        total = total + values[rank]
    if average:
        total = total / torch.full_like(total, world_size)
    return to_output_dtype(total, dtype)


def dequantize_sum_fp8_chunks(
    received: torch.Tensor,
    chunk: int,
    block_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    average: bool = False,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum over ranks, in rank order, of the chunk each row of `received` holds ([Note: FP8
    chunk rows]): fp32, divided by the number of rows with `average`, rounded once to `dtype`.

    Args:
        received: uint8 (world_size, row bytes): row i as `quantize_fp8_chunks` wrote it on rank i.
        chunk: elements per chunk.
        block_size: the block size the rows were quantized with.
        fp8_dtype: the FP8 dtype the rows were quantized with.
        average: divide the sum by world_size (AVG); otherwise SUM.
        dtype: fp32, bf16 or fp16 output (ignored when `out` is given: out's dtype counts).
        out: a buffer of `chunk` elements (contiguous, fp32/bf16/fp16, received's device) to fill.
    """
    received, chunk = _check_received(received, chunk, block_size)
    check_fp8_dtype(fp8_dtype)
    if out is None:
        out = torch.empty(chunk, dtype=check_output_dtype(dtype), device=received.device)
    elif (
        not isinstance(out, torch.Tensor)
        or out.numel() != chunk
        or out.device != received.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous tensor of {chunk} elements on {received.device}, got "
            + (
                f"{out.numel()} elements on {out.device}" + ("" if out.is_contiguous() else ", not contiguous")
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
        )
    else:
        check_output_dtype(out.dtype)
    call("dequantize_sum_fp8_chunks", received.contiguous(), block_size, fp8_dtype, average, out)
    return out


class QuantizeFp8ChunksArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_fp8_chunks` ([Note: operator arguments])."""

    x: torch.Tensor
    block_size: int
    fp8_dtype: torch.dtype
    stochastic_rounding: bool
    seed: int
    counter: torch.Tensor | None
    residual: torch.Tensor | None
    out: torch.Tensor


@define_op("quantize_fp8_chunks", QuantizeFp8ChunksArgs, mutates_args=("residual", "out"))
def _quantize_fp8_chunks_body(kernel, args: QuantizeFp8ChunksArgs) -> None:  # type: ignore[no-untyped-def]
    if args.x.numel() > 0:
        kernel(args)


@register_kernel("quantize_fp8_chunks", "reference")
def _quantize_fp8_chunks_reference_kernel(args: QuantizeFp8ChunksArgs) -> None:
    args.out.copy_(
        quantize_fp8_chunks_reference(
            args.x,
            args.out.shape[0],
            args.block_size,
            args.fp8_dtype,
            stochastic_rounding=args.stochastic_rounding,
            seed=args.seed,
            counter=args.counter,
            residual=args.residual,
        )
    )


class DequantizeSumFp8ChunksArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_sum_fp8_chunks` ([Note: operator arguments])."""

    received: torch.Tensor
    block_size: int
    fp8_dtype: torch.dtype
    average: bool
    out: torch.Tensor


@define_op("dequantize_sum_fp8_chunks", DequantizeSumFp8ChunksArgs, mutates_args=("out",))
def _dequantize_sum_fp8_chunks_body(kernel, args: DequantizeSumFp8ChunksArgs) -> None:  # type: ignore[no-untyped-def]
    if args.out.numel() > 0:
        kernel(args)


@register_kernel("dequantize_sum_fp8_chunks", "reference")
def _dequantize_sum_fp8_chunks_reference_kernel(args: DequantizeSumFp8ChunksArgs) -> None:
    total = dequantize_sum_fp8_chunks_reference(
        args.received,
        args.out.numel(),
        args.block_size,
        args.fp8_dtype,
        average=args.average,
        dtype=args.out.dtype,
    )
    args.out.view(-1).copy_(total)


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("quantize_fp8_chunks", "cpp")
def _quantize_fp8_chunks_cpp(args: QuantizeFp8ChunksArgs) -> None:
    out = args.out
    _C.quantize_fp8_chunks(
        args.x.data_ptr(),
        DTYPE_CODES[args.x.dtype],
        out.shape[0],
        args.x.numel() // out.shape[0],
        args.block_size,
        FP8_FORMAT_CODES[args.fp8_dtype],
        args.stochastic_rounding,
        args.seed & 0xFFFFFFFFFFFFFFFF,
        pointer(args.counter),
        pointer(args.residual),
        out.data_ptr(),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_sum_fp8_chunks", "cpp")
def _dequantize_sum_fp8_chunks_cpp(args: DequantizeSumFp8ChunksArgs) -> None:
    received, out = args.received, args.out
    _C.dequantize_sum_fp8_chunks(
        received.data_ptr(),
        received.shape[0],
        out.numel(),
        args.block_size,
        FP8_FORMAT_CODES[args.fp8_dtype],
        args.average,
        out.data_ptr(),
        DTYPE_CODES[out.dtype],
        torch.get_num_threads(),
    )
