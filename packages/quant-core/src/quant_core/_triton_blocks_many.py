"""Triton kernels of the multi-tensor FP8 block quantizes (`quantize_mxfp8_many`,
`quantize_fp8_blockwise_many`): many tensors, one launch, each tile's bytes those of the
single-tensor kernel.

[Note: multi-tensor block quantize] FusedAdam requantizes every block-format weight from its
master after each step; one launch per weight costs ~90 us of host time on an H100 VM (quantizer,
operator dispatch, launch), more than the kernel at the sizes of most weights. Here one launch
quantizes a list of tensors: program p reads row p of a program table (tensor t, tile i;
`_triton_tables.program_table`), then tensor t's addresses, (M, K) and strides from a pointer
table ([Note: pointer tables]), and runs the single-tensor kernel's tile body (`_quantize_tile`,
`_quantize_two_pass_tile` in `_triton_blocks`) on tile i of it, with the tiles `_tiles_for` picks
for that tensor's single launch: the bytes are the single kernel's, bit for bit, and both tables
are cached by content, so a step whose tensors keep their storages copies nothing to the device
(and a CUDA graph can replay it).
Constexprs must be the same for every program of a launch, so the tensors are grouped by what
the single launch specializes on: input dtype and usages (they pick the tiles), whether a tile
is partial (the two-pass kernel's MASKED), and `ALIGNED`: rows contiguous (stride 1 along K),
every address a multiple of 16 bytes and M, K and the row stride multiples of 16. Triton sees
that of a single launch's arguments and vectorizes loads and stores; values read from a table
carry no such facts, so an ALIGNED launch states them (`tl.multiple_of`). One launch per group:
one for the weights of a model whose dims are multiples of 16 and masters of one dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from quant_core._backend import register_kernel
from quant_core._triton_blocks import (
    MXFP8_FORMAT,
    TwoPassTiles,
    _launch_options,
    _quantize_tile,
    _quantize_two_pass_tile,
    _tile_shape,
    _tiles_for,
    blockwise_format,
)
from quant_core._triton_launch import cdiv, launch
from quant_core._triton_tables import pointer_table, program_table

# Rows of a launch's pointer table: the addresses of the inputs and of the four buffers, numels
# (unused), then the int rows (`extra`). Kernels read them as constants.
_ROWWISE, _ROWWISE_SCALE, _COLUMNWISE, _COLUMNWISE_SCALE = (tl.constexpr(row) for row in (1, 2, 3, 4))
_M, _K, _STRIDE_M, _STRIDE_K = (tl.constexpr(row) for row in (6, 7, 8, 9))


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


def _aligned(x_MK: torch.Tensor, buffers: Sequence[torch.Tensor | None]) -> bool:
    """Whether an ALIGNED launch may take x ([Note: multi-tensor block quantize])."""
    M, K = x_MK.shape
    stride_m, stride_k = x_MK.stride()
    if stride_k != 1 or M % 16 or K % 16 or stride_m % 16:
        return False
    return all(b is None or b.data_ptr() % 16 == 0 for b in (x_MK, *buffers))


def _launch_quantize_many(
    xs: Sequence[torch.Tensor],
    buffer_lists: Sequence[Sequence[torch.Tensor | None]],
    tiles_format: str,
    format_args: dict[str, object],
) -> None:
    """Quantizes every xs[i] into (rowwise data, rowwise scales, columnwise data, columnwise scales)
    = buffer_lists[0..3][i], one launch per group ([Note: multi-tensor block quantize])."""
    block = format_args["block"]
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, x_MK in enumerate(xs):
        buffers = [buffer_list[i] for buffer_list in buffer_lists]
        columnwise = buffers[2] is not None
        tiles = _tiles_for(tiles_format, columnwise, x_MK.dtype)
        tile_m, tile_k = _tile_shape(tiles, block)
        masked = isinstance(tiles, TwoPassTiles) and (x_MK.shape[0] % tile_m != 0 or x_MK.shape[1] % tile_k != 0)
        key = (x_MK.dtype, buffers[0] is not None, columnwise, masked, _aligned(x_MK, buffers))
        groups.setdefault(key, []).append(i)
    for (dtype, rowwise, columnwise, masked, aligned), indices in groups.items():
        tiles = _tiles_for(tiles_format, columnwise, dtype)
        tile_m, tile_k = _tile_shape(tiles, block)
        options = _launch_options(tiles, **format_args, rowwise=rowwise, columnwise=columnwise, masked=masked)
        kernel = _quantize_two_pass_many_kernel if isinstance(tiles, TwoPassTiles) else _quantize_blocks_many_kernel
        group = [xs[i] for i in indices]
        wanted = (rowwise, rowwise, columnwise, columnwise)
        # A usage not asked for: the inputs' addresses hold its place (the kernel never reads them).
        buffers = [[b[i] for i in indices] if w else group for b, w in zip(buffer_lists, wanted, strict=True)]
        sizes = [x.shape[0] for x in group] + [x.shape[1] for x in group]
        strides = [x.stride(0) for x in group] + [x.stride(1) for x in group]
        counts = tuple(cdiv(x.shape[0], tile_m) * cdiv(x.shape[1], tile_k) for x in group)
        launch(
            kernel,
            (sum(counts),),
            pointer_table(group, *buffers, extra=sizes + strides),
            len(group),
            program_table(counts, group[0].device),
            group[0],
            *(b[0] for b in buffers),
            ALIGNED=aligned,
            **options,
        )


@register_kernel("quantize_fp8_blockwise_many", "triton")
def _quantize_fp8_blockwise_many(
    xs: Sequence[torch.Tensor],
    block_rows: int,
    fp8_dtype: torch.dtype,
    power_2_scales: bool,
    *buffer_lists: Sequence[torch.Tensor | None],
) -> None:
    _launch_quantize_many(xs, buffer_lists, *blockwise_format(block_rows, fp8_dtype, power_2_scales))


@register_kernel("quantize_mxfp8_many", "triton")
def _quantize_mxfp8_many(xs: Sequence[torch.Tensor], *buffer_lists: Sequence[torch.Tensor | None]) -> None:
    _launch_quantize_many(xs, buffer_lists, *MXFP8_FORMAT)
