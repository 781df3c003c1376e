"""Triton kernels of the multi-tensor FP8 block quantizes (`quantize_mxfp8_many`,
`quantize_fp8_blockwise_many`): many tensors, one launch, each tile's bytes those of the
single-tensor kernel.

[Note: multi-tensor block quantize] FusedAdam requantizes every block-format weight from its
master after each step; one launch per weight costs ~90 us of host time on an H100 VM (quantizer,
operator dispatch, launch), more than the kernel at the sizes of most weights. Here one launch
quantizes a list of tensors: program p reads row p of a program table (tensor t, tile i;
`_triton_tables.program_table`), then tensor t's addresses, (M, K) and strides from a pointer
table ([Note: pointer tables]), and runs the single-tensor kernel's tile body (`_quantize_tile` in
`blocks._triton_quantize`, `_quantize_two_pass_tile` in `blocks._triton_two_pass`) on tile i of
it, with the tiles `_tiles_for` picks for that tensor's single launch: the bytes are the single
kernel's, bit for bit, and both tables are cached by content, so a step whose tensors keep their
storages copies nothing to the device (and a CUDA graph can replay it).
Constexprs must be the same for every program of a launch, so the tensors are grouped by what
the single launch specializes on: input dtype and usages (they pick the tiles), whether a tile
is partial (the two-pass kernel's MASKED), and `ALIGNED`: rows contiguous (stride 1 along K),
every address a multiple of 16 bytes and M, K and the row stride multiples of 16. Triton sees
that of a single launch's arguments and vectorizes loads and stores; values read from a table
carry no such facts, so an ALIGNED launch states them (`tl.multiple_of`). One launch per group:
one for the weights of a model whose dims are multiples of 16 and masters of one dtype.
Large MXFP8 tensors take the single-tensor launch instead (`MXFP8_SINGLE_LAUNCH_NUMEL`): with its
small fp32 tiles (32 x 64, 2 warps) the table reads cost ~2% of the kernel time, measured on an
H100 at 1e9 parameters (FusedAdam MXFP8 12.7-12.8 ms per step in one launch, 12.5 ms with a
launch per weight; docs/benchmarks.md), while a launch's host time is hidden behind a kernel of
that size. Blockwise FP8 ran faster in one launch at every size (12.1 vs 12.3 ms).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from quant_core._library import register_kernel
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._layout import quantize_buffers
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.blocks._triton_quantize import (
    MXFP8_FORMAT,
    _launch_options,
    _launch_quantize,
    _quantize_tile,
    _tile_shape,
    _tiles_for,
    blockwise_format,
)
from quant_core.blocks._triton_two_pass import TwoPassTiles, _quantize_two_pass_tile
from quant_core.shared._triton_launch import cdiv, launch
from quant_core.shared._triton_tables import int_table, program_table

# Rows of a launch's pointer table (one column per tensor): the addresses of the inputs and of
# the four buffers, then M, K and the strides of each input's (M, K) view.
_ROWWISE, _ROWWISE_SCALE, _COLUMNWISE, _COLUMNWISE_SCALE = (tl.constexpr(row) for row in (1, 2, 3, 4))
_M, _K, _STRIDE_M, _STRIDE_K = (tl.constexpr(row) for row in (5, 6, 7, 8))
# MXFP8 tensors of at least this many elements are quantized by their own single-tensor launch
# ([Note: multi-tensor block quantize]); tests set it to route tensors either way.
MXFP8_SINGLE_LAUNCH_NUMEL = 1 << 24


@triton.jit
def _table_pointer(pointers, row, num_tensors, t, like, ALIGNED: tl.constexpr):
    """Tensor t's address in `row` of the pointer table, as a pointer to like's element type."""
    pointer = tl.load(pointers + row * num_tensors + t).to(tl.pointer_type(like.dtype.element_ty))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _table_int(pointers, row, num_tensors, t, ALIGNED: tl.constexpr):
    """Tensor t's value in int `row` of the pointer table (a multiple of 16 when ALIGNED)."""
    value = tl.load(pointers + row * num_tensors + t)
    if ALIGNED:
        value = tl.multiple_of(value, 16)
    return value


@triton.jit
def _program_operands(
    pointers,
    num_tensors,
    programs,
    x_like,
    rowwise_like,
    rowwise_scale_like,
    columnwise_like,
    columnwise_scale_like,
    TILE_K: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """What this program quantizes ([Note: multi-tensor block quantize]): its tensor's pointers,
    M, K, strides, and the coordinates of its tile (row-major over the tensor's tiles)."""
    t = tl.load(programs + 2 * tl.program_id(0))
    tile = tl.load(programs + 2 * tl.program_id(0) + 1)
    M = _table_int(pointers, _M, num_tensors, t, ALIGNED)
    K = _table_int(pointers, _K, num_tensors, t, ALIGNED)
    stride_m = _table_int(pointers, _STRIDE_M, num_tensors, t, ALIGNED)
    if ALIGNED:  # noqa: SIM108  (a constexpr branch: a constant 1 makes the column offsets contiguous)
        stride_k = 1
    else:
        stride_k = tl.load(pointers + _STRIDE_K * num_tensors + t)
    col_tiles = tl.cdiv(K, TILE_K)
    return (
        _table_pointer(pointers, 0, num_tensors, t, x_like, ALIGNED),
        M,
        K,
        stride_m,
        stride_k,
        _table_pointer(pointers, _ROWWISE, num_tensors, t, rowwise_like, ALIGNED),
        _table_pointer(pointers, _ROWWISE_SCALE, num_tensors, t, rowwise_scale_like, ALIGNED),
        _table_pointer(pointers, _COLUMNWISE, num_tensors, t, columnwise_like, ALIGNED),
        _table_pointer(pointers, _COLUMNWISE_SCALE, num_tensors, t, columnwise_scale_like, ALIGNED),
        tile // col_tiles,
        tile % col_tiles,
    )


@triton.jit
def _quantize_blocks_many_kernel(
    pointers,
    num_tensors,
    programs,
    x_like,
    rowwise_like,
    rowwise_scale_like,
    columnwise_like,
    columnwise_scale_like,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO_D: tl.constexpr,
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_K: tl.constexpr,
    HARDWARE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """`_quantize_tile` on this program's tile of its tensor. `*_like`: tensors of the input's and
    the buffers' dtypes (a buffer's usage not asked for: any tensor)."""
    operands = _program_operands(
        pointers, num_tensors, programs, x_like, rowwise_like, rowwise_scale_like, columnwise_like,
        columnwise_scale_like, TILE_K, ALIGNED,
    )  # fmt: skip
    _quantize_tile(*operands, ROWWISE, COLUMNWISE, BLOCK, TWO_D, SCALE_RULE, E4M3, TILE_M, TILE_K, HARDWARE)


@triton.jit
def _quantize_two_pass_many_kernel(
    pointers,
    num_tensors,
    programs,
    x_like,
    rowwise_like,
    rowwise_scale_like,
    columnwise_like,
    columnwise_scale_like,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE_RULE: tl.constexpr,
    E4M3: tl.constexpr,
    BLOCKS_M: tl.constexpr,
    TILE_K: tl.constexpr,
    CHUNK_M: tl.constexpr,
    STORE_M: tl.constexpr,
    UNROLL: tl.constexpr,
    HARDWARE: tl.constexpr,
    MASKED: tl.constexpr,
    EARLY_NAN: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """`_quantize_two_pass_tile` on this program's tile of its tensor (`*_like` as above)."""
    operands = _program_operands(
        pointers, num_tensors, programs, x_like, rowwise_like, rowwise_scale_like, columnwise_like,
        columnwise_scale_like, TILE_K, ALIGNED,
    )  # fmt: skip
    _quantize_two_pass_tile(
        *operands, ROWWISE, COLUMNWISE, BLOCK, SCALE_RULE, E4M3, BLOCKS_M, TILE_K, CHUNK_M, STORE_M, UNROLL, HARDWARE,
        MASKED, EARLY_NAN,
    )  # fmt: skip


def _launch_quantize_many(
    tensors: Sequence[QuantizeMxfp8Args | QuantizeFp8BlockwiseArgs], tiles_format: str, format_args: dict[str, object]
) -> None:
    """Quantizes the x_MK of each of `tensors` (single-tensor quantize arguments) into its buffers,
    one launch per group ([Note: multi-tensor block quantize])."""
    block = format_args["block"]
    single_from = MXFP8_SINGLE_LAUNCH_NUMEL if tiles_format == MXFP8_FORMAT[0] else None
    # key -> the group's tensors as (x, buffers, its table column, its number of tiles)
    groups: dict[tuple[object, ...], list[tuple[torch.Tensor, tuple, tuple[int, ...], int]]] = {}
    for args in tensors:
        x_MK, buffers = args.x_MK, quantize_buffers(args)
        columnwise = args.columnwise_data is not None
        tiles = _tiles_for(tiles_format, columnwise, x_MK.dtype)
        if single_from is not None and x_MK.numel() >= single_from:
            _launch_quantize(x_MK, buffers, tiles=tiles, **format_args)
            continue
        M, K = x_MK.shape
        stride_m, stride_k = x_MK.stride()
        x_address = x_MK.data_ptr()
        # A usage not asked for: x's address holds its place (the kernel never reads it).
        addresses = [x_address if b is None else b.data_ptr() for b in buffers]
        column = (x_address, *addresses, M, K, stride_m, stride_k)
        # ALIGNED: rows contiguous; addresses, M, K and the row stride multiples of 16 (all are iff their OR is).
        aligned = stride_k == 1 and functools.reduce(operator.or_, column[:-1]) % 16 == 0
        tile_m, tile_k = _tile_shape(tiles, block)
        masked = isinstance(tiles, TwoPassTiles) and (M % tile_m != 0 or K % tile_k != 0)
        key = (x_MK.dtype, args.rowwise_data is not None, columnwise, masked, aligned)
        groups.setdefault(key, []).append((x_MK, buffers, column, cdiv(M, tile_m) * cdiv(K, tile_k)))
    for (dtype, rowwise, columnwise, masked, aligned), members in groups.items():
        tiles = _tiles_for(tiles_format, columnwise, dtype)
        options = _launch_options(tiles, **format_args, rowwise=rowwise, columnwise=columnwise, masked=masked)
        kernel = _quantize_two_pass_many_kernel if isinstance(tiles, TwoPassTiles) else _quantize_blocks_many_kernel
        x_like, buffers_like = members[0][0], members[0][1]
        counts = tuple(member[3] for member in members)
        rows = [value for row in zip(*(member[2] for member in members), strict=True) for value in row]
        launch(
            kernel,
            (sum(counts),),
            int_table(rows, len(members), x_like.device),
            len(members),
            program_table(counts, x_like.device),
            x_like,
            *(x_like if b is None else b for b in buffers_like),
            ALIGNED=aligned,
            **options,
        )


@register_kernel("quantize_fp8_blockwise_many", "triton")
def _quantize_fp8_blockwise_many(tensors: Sequence[QuantizeFp8BlockwiseArgs]) -> None:
    first = tensors[0]  # one format configuration for all of them
    _launch_quantize_many(tensors, *blockwise_format(first.block_rows, first.fp8_dtype, first.power_2_scales))


@register_kernel("quantize_mxfp8_many", "triton")
def _quantize_mxfp8_many(tensors: Sequence[QuantizeMxfp8Args]) -> None:
    _launch_quantize_many(tensors, *MXFP8_FORMAT)
