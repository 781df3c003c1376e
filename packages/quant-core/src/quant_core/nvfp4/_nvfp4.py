"""NVFP4 (docs/design.md, 'Numerics'): E2M1 codes, two per byte, with an E4M3 scale per 1 x 16 block or 16 x 16 tile.

Tensor scale S = 448 * 6 / global_amax (1 if 0, clamped to the largest fp32), global_amax over
the whole unsharded tensor (pass it in when quantizing a shard). Per block:
s = e4m3(block_amax / 6 * S), enc = S / fp32(s) (clamped to the largest fp32, like every scale),
q = e2m1(x * enc) (q = 0 where s = 0),
dequantized fp32(q) * (fp32(s) / S). Codes pack along the last dim, even element in the low
nibble, so the packed dim must be even. Optional stochastic rounding draws from the counter RNG
([Note: counter RNG]); `hadamard_transform_16` is the 16 x 16 random Hadamard transform, which
`quantize_nvfp4(..., hadamard_seed=...)` applies to the columnwise (wgrad) usage
([Note: NVFP4 random Hadamard transform]).

[Note: NVFP4 random Hadamard transform] With an int `hadamard_seed`, the columnwise usage of a
1 x 16 quantization holds the codes of T(x^T) instead of x^T. x^T is (K, M); T maps each run of
16 along M (rows 16 g .. 16 g + 15 of one column of x) to v -> (1/4) H_16 D v, D = diag of
`hadamard_signs(seed)`, H_16 the 16 x 16 Sylvester Hadamard matrix, computed in fp32 exactly as
`hadamard_transform_16_reference` computes it (signs, the 4-stage butterfly, times 1/4) and not
rounded to x's dtype before the encode. Its tensor scale is its own: S_c =
`nvfp4_tensor_scale(columnwise_amax)` with columnwise_amax = amax(T(x^T)) over the finite
elements (|T v| can reach 4 max|v|); blocks, block scales and stochastic-rounding counters are
those of the untransformed columnwise usage, with T(x^T) in place of x^T and S_c in place of S.
Rowwise data and its S (from amax(x)) are unchanged. M must be a multiple of 16, so every run
is whole (a partial run zero-padded would not be invertible, and dW would change). T is
orthonormal: when both wgrad operands use the same seed, T(dY^T) T(X^T)^T = dY^T X, and
T^-1 = T^T: v = D (1/4) H_16 y (`hadamard_inverse_16_reference`). `hadamard_amaxes` gives
amax(x) and amax(T(x^T)) in one read.

Operators ([Note: custom ops]; unchecked: the caller guarantees what is listed):
- `torch.ops.quant_core.quantize_nvfp4(x_MK, block_rows, global_amax, stochastic_rounding, seed,
  columnwise_amax, hadamard_seed, rowwise_data, rowwise_scale_inv, columnwise_data,
  columnwise_scale_inv) -> ()`: [Note: block operators] with block_rows 1 or 16, uint8 data (two
  codes per byte: K even, and M even when columnwise data is given) and E4M3 scales;
  global_amax the fp32 one-element amax on x's device, from which every kernel computes S
  (`nvfp4_tensor_scale`) itself, so a quantize is one launch with no scale ops around it;
  columnwise_amax the columnwise usage's (the same tensor without the transform; with 16 x 16
  tiles it is not read); seed a 0-d int64 tensor on any device (read only with
  stochastic rounding; one on neither the CPU nor x's device costs a copy); hadamard_seed None
  or an int in int64 range (`signed64`): the columnwise usage is then T(x^T), which needs
  block_rows 1 and M a multiple of 16 ([Note: NVFP4 random Hadamard transform]).
- `torch.ops.quant_core.dequantize_nvfp4(data_2d, scale_inv, block_rows, global_amax, dtype)`:
  [Note: block operators], packed data (R, C/2), E4M3 scales, global_amax as above or None (the
  block values without the tensor scale).
- `torch.ops.quant_core.dequantize_nvfp4_pair(a_data_2d, a_scale_inv, b_data_2d, b_scale_inv,
  a_block_rows, a_global_amax, b_block_rows, b_global_amax, dtype) -> (Tensor, Tensor)`: each
  operand as `dequantize_nvfp4`'s, one device ([Note: dequantizing two operands]).
- `torch.ops.quant_core.nvfp4_gemm_output(product, a_global_amax, b_global_amax, bias, dtype)
  -> Tensor`: [Note: NVFP4 GEMM output]; see `_nvfp4_gemm_output_op` for its contract.
- `torch.ops.quant_core.transpose_nvfp4(packed_MK, scale_inv) -> (Tensor, Tensor)`: rowwise
  16 x 16 data (M, K/2) uint8 with M even, any strides, and its (M/16, K/16) scales. Returns the
  packed codes of x^T, contiguous (K, M/2), and the scales transposed, contiguous.
- the Hadamard operators' contracts are in quant_core.nvfp4._hadamard.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from quant_core._library import Kernel, call, define_op, register_kernel, with_contiguous
from quant_core.blocks._layout import (
    QUANTIZE_BUFFERS,
    BlockQuantized,
    BlockShape,
    block_amax,
    check_block_shape,
    check_pair_device,
    check_quantize_input,
    checked_dequantize_operand,
    copy_into,
    dequantize_blocks,
    dequantize_body,
    dequantize_fake,
    dequantize_pair_body,
    dequantize_pair_fake,
    element_index,
    expand_blocks,
    pair_of,
    quantize_blocks,
    quantize_blocks_reference,
    quantize_body,
    quantize_buffers,
)
from quant_core.fp8._fp8 import amax, amax_reference
from quant_core.nvfp4._hadamard import hadamard_amaxes, hadamard_amaxes_reference, hadamard_transform_16_reference
from quant_core.shared._checks import as_2d, check_output_dtype, check_scalar, with_shape
from quant_core.shared._cpp import _C, out_dtype_code, outputs, x_args
from quant_core.shared._numerics import (
    E2M1_MAX,
    E4M3_MAX,
    FLOAT32_MAX,
    decode_e2m1,
    divide,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_fp8,
    pack_nibbles,
    random24,
    seed_tensor,
    signed64,
    to_output_dtype,
    unpack_nibbles,
)

NVFP4_BLOCK = 16
NVFP4_SHAPES: tuple[BlockShape, ...] = ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK))


def nvfp4_tensor_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """S = 448 * 6 / global_amax as fp32 0-d (1 if global_amax is 0; clamped to the largest fp32)."""
    global_amax = global_amax.float().reshape(())
    return torch.where(global_amax > 0, divide(E4M3_MAX * E2M1_MAX, global_amax), 1.0).clamp(max=FLOAT32_MAX)


def _check_input(x: torch.Tensor, block_shape: object, columnwise: bool) -> BlockShape:
    """Checks x and block_shape for NVFP4 quantization (packable dims included); returns the block shape."""
    check_quantize_input(x, "NVFP4")
    checked = check_block_shape(block_shape, NVFP4_SHAPES, "NVFP4")
    _check_packable(tuple(as_2d(x).shape), columnwise)
    return checked


def _check_packable(x_MK_shape: tuple[int, int], columnwise: bool) -> None:
    M, K = x_MK_shape
    if M * K == 0:
        return  # nothing to pack
    if K % 2:
        raise ValueError(
            f"NVFP4 packs two codes per byte along the last dim, which must be even; got K={K}. Pad K to a multiple of 2 (of 16 for the quantized GEMM)"
        )
    if columnwise and M % 2:
        raise ValueError(
            f"NVFP4 columnwise data packs two codes per byte along dim 0 of the (M, K) view, which must be even; got M={M}"
        )


def _check_hadamard(
    x: torch.Tensor,
    block_shape: BlockShape,
    columnwise: bool,
    hadamard_seed: int | None,
    columnwise_amax: torch.Tensor | None,
) -> bool:
    """Checks the transform's arguments; returns whether the columnwise usage is transformed."""
    if hadamard_seed is None:
        if columnwise_amax is not None:
            raise ValueError(
                "columnwise_amax is amax(T(x^T)), the tensor scale's amax of a Hadamard-transformed columnwise usage; "
                "pass hadamard_seed too (without the transform the columnwise usage shares global_amax)"
            )
        return False
    if block_shape != (1, NVFP4_BLOCK):
        raise ValueError(
            f"the random Hadamard transform applies to NVFP4's 1 x 16 columnwise blocks, got block_shape {block_shape}: "
            "16 x 16 tiles (weights) take their columnwise usage by a lossless transpose; quantize them without "
            "hadamard_seed"
        )
    M = as_2d(x).shape[0]
    if columnwise and M % NVFP4_BLOCK:
        raise ValueError(
            f"the random Hadamard transform of NVFP4's columnwise usage mixes runs of 16 rows of the (M, K) view, so M "
            f"must be a multiple of 16; got M={M} (shape {tuple(x.shape)}). Pad the tokens to a multiple of 16, or "
            "quantize without hadamard_seed"
        )
    return columnwise


def quantize_nvfp4_reference(
    x: torch.Tensor,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    *,
    global_amax: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
    stochastic_rounding: bool = False,
    seed: int | torch.Tensor = 0,
    hadamard_seed: int | None = None,
    columnwise_amax: torch.Tensor | None = None,
) -> BlockQuantized:
    """Plain-torch NVFP4 quantization (the spec in code; the transform: [Note: NVFP4 random Hadamard transform])."""
    block_shape = _check_input(x, block_shape, columnwise)
    transform = _check_hadamard(x, block_shape, columnwise, hadamard_seed, columnwise_amax)
    global_amax = amax_reference(x) if global_amax is None else global_amax.float().reshape(())
    S = nvfp4_tensor_scale(global_amax)
    S_columnwise = S
    if transform:
        if columnwise_amax is None:
            columnwise_amax = hadamard_amaxes_reference(x, hadamard_seed)[1]
        columnwise_amax = columnwise_amax.float().reshape(())
        S_columnwise = nvfp4_tensor_scale(columnwise_amax)
    result = _quantize_with_tensor_scale_reference(
        x,
        block_shape,
        S,
        rowwise,
        columnwise,
        stochastic_rounding,
        seed_tensor(seed),
        S_columnwise,
        signed64(int(hadamard_seed)) if transform else None,
    )
    return dataclasses.replace(result, amax=global_amax, columnwise_amax=columnwise_amax if transform else None)


def _quantize_with_tensor_scale_reference(
    x: torch.Tensor,
    block_shape: BlockShape,
    S: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    stochastic_rounding: bool,
    seed: torch.Tensor,
    S_columnwise: torch.Tensor,
    hadamard_seed: int | None,
) -> BlockQuantized:
    """The NVFP4 reference given the tensor scales, the seed tensor and the transform's seed (what
    the kernels receive)."""

    def encode(x_MK: torch.Tensor, index_offset: int, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        M, K = x_MK.shape
        s = encode_fp8(block_amax(x_MK, block_shape) / E2M1_MAX * S, torch.float8_e4m3fn)
        s_f32 = s.float()
        # enc is a scale like any other: clamped to the largest fp32 (S may already be, and s < 1).
        enc = torch.where(s_f32 > 0, S / s_f32, 0.0).clamp(max=FLOAT32_MAX)
        v = x_MK * expand_blocks(enc, block_shape, M, K)
        if stochastic_rounding:
            codes = encode_e2m1_stochastic(v, random24(seed, element_index((M, K), index_offset, x_MK.device)))
        else:
            codes = encode_e2m1(v)
        codes = torch.where(expand_blocks(s_f32 == 0, block_shape, M, K), 0, codes).to(torch.uint8)
        return codes, s

    def columnwise_fn(x_KM: torch.Tensor, index_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        if hadamard_seed is not None:  # T(x^T) in fp32, never rounded to x's dtype
            x_KM = hadamard_transform_16_reference(x_KM, hadamard_seed)
        return encode(x_KM, index_offset, S_columnwise)

    return quantize_blocks_reference(
        x,
        block_shape,
        lambda x_MK, index_offset: encode(x_MK, index_offset, S),
        rowwise=rowwise,
        columnwise=columnwise,
        pack=pack_nibbles,
        columnwise_fn=columnwise_fn,
    )


def quantize_nvfp4(
    x: torch.Tensor,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    *,
    global_amax: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
    stochastic_rounding: bool = False,
    seed: int | torch.Tensor = 0,
    hadamard_seed: int | None = None,
    columnwise_amax: torch.Tensor | None = None,
    out: BlockQuantized | None = None,
) -> BlockQuantized:
    """NVFP4 codes (uint8, two per byte) and E4M3 block scales for the usages asked for, in one pass.

    Args:
        x: fp32/bf16/fp16 tensor with at least one dim; the packed dims must be even.
        block_shape: (1, 16) for activations and gradients, (16, 16) for weights.
        global_amax: amax of the whole (unsharded) tensor; computed from x when None.
        stochastic_rounding: round E2M1 stochastically with the counter RNG keyed by `seed` and
            the element index (rowwise: m * K + k; columnwise: M * K + k * M + m).
        seed: an int, or a 0-d int64 tensor on any device holding the uint64 bits (a per-step
            counter kept as a tensor: no host sync, no torch.compile specialization).
        hadamard_seed: an int: the columnwise usage (1 x 16 blocks, M a multiple of 16) holds
            T(x^T), the 16 x 16 random Hadamard transform with this seed's signs along M, scaled
            by its own amax ([Note: NVFP4 random Hadamard transform]); None: x^T.
        columnwise_amax: with hadamard_seed, amax(T(x^T)) of the whole (unsharded) tensor;
            computed from x when None (with global_amax, in one read: `hadamard_amaxes`).
        out: a previous result whose buffers are refilled in place.
    """
    block_shape = _check_input(x, block_shape, columnwise)
    transform = _check_hadamard(x, block_shape, columnwise, hadamard_seed, columnwise_amax)
    if transform and columnwise_amax is None:
        both = hadamard_amaxes(x, hadamard_seed)
        global_amax = both[0] if global_amax is None else global_amax
        columnwise_amax = both[1]
    if global_amax is None:
        global_amax = amax(x)
    check_scalar(global_amax, "global_amax", x.device)
    global_amax = global_amax.reshape(())
    if transform:
        check_scalar(columnwise_amax, "columnwise_amax", x.device)
        columnwise_amax = columnwise_amax.reshape(())
    result = quantize_blocks(
        "quantize_nvfp4",
        x,
        block_shape,
        rowwise=rowwise,
        columnwise=columnwise,
        data_dtype=torch.uint8,
        scale_dtype=torch.float8_e4m3fn,
        codes_per_byte=2,
        format_args=(
            block_shape[0],
            global_amax,
            stochastic_rounding,
            seed_tensor(seed),
            columnwise_amax if transform else global_amax,
            signed64(int(hadamard_seed)) if transform else None,
        ),
        amax=global_amax,
        out=out,
    )
    return dataclasses.replace(result, columnwise_amax=columnwise_amax) if transform else result


class QuantizeNvfp4Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.quantize_nvfp4` ([Note: operator arguments])."""

    x_MK: torch.Tensor
    block_rows: int
    global_amax: torch.Tensor
    stochastic_rounding: bool
    seed: torch.Tensor
    columnwise_amax: torch.Tensor
    hadamard_seed: int | None
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None


define_op("quantize_nvfp4", QuantizeNvfp4Args, mutates_args=QUANTIZE_BUFFERS, recomputable=True)(quantize_body)


@register_kernel("quantize_nvfp4", "reference")
def _quantize_nvfp4_reference_kernel(args: QuantizeNvfp4Args) -> None:
    result = _quantize_with_tensor_scale_reference(
        args.x_MK,
        (args.block_rows, NVFP4_BLOCK),
        nvfp4_tensor_scale(args.global_amax),
        args.rowwise_data is not None,
        args.columnwise_data is not None,
        args.stochastic_rounding,
        args.seed,
        nvfp4_tensor_scale(args.columnwise_amax),
        args.hadamard_seed,
    )
    copy_into(result, *quantize_buffers(args))


# ---- dequantize and transpose -------------------------------------------------------------------


def dequantize_nvfp4_reference(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    global_amax: torch.Tensor | None,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch NVFP4 dequantize: fp32(q) * (fp32(s) / S) with S from global_amax; the block
    values fp32(q) * fp32(s) alone (S = 1) when global_amax is None."""
    packed = as_2d(data)
    S = None if global_amax is None else nvfp4_tensor_scale(global_amax)
    values = _dequantize_with_tensor_scale_reference(packed, scale_inv, S, block_shape)
    return to_output_dtype(values, dtype).reshape(*data.shape[:-1], values.shape[1])


def _dequantize_with_tensor_scale_reference(
    packed: torch.Tensor, scale_inv: torch.Tensor, S: torch.Tensor | None, block_shape: BlockShape
) -> torch.Tensor:
    codes = unpack_nibbles(packed)
    factor = scale_inv.float() if S is None else scale_inv.float() / S
    return decode_e2m1(codes) * expand_blocks(factor, block_shape, *codes.shape)


def dequantize_nvfp4(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    global_amax: torch.Tensor | None,
    block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 values of rowwise (last dim K/2) or columnwise ((K, M/2)) data; the last dim doubles.

    With global_amax None: the block values without the tensor scale, fp32(q) * fp32(s), which
    bf16 holds exactly (what the emulated GEMM multiplies: `nvfp4_gemm_output` applies 1 / S).
    """
    block_shape = check_block_shape(block_shape, NVFP4_SHAPES, "NVFP4")
    if global_amax is not None:
        global_amax = check_scalar(global_amax, "global_amax", data.device).reshape(())
    return dequantize_blocks(
        "dequantize_nvfp4",
        data,
        scale_inv,
        dtype,
        block_shape=block_shape,
        data_dtype=torch.uint8,
        scale_dtype=torch.float8_e4m3fn,
        codes_per_byte=2,
        format_args=(block_shape[0], global_amax),
        format_name="NVFP4",
    )


class DequantizeNvfp4Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_nvfp4` ([Note: operator arguments])."""

    data_2d: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int
    global_amax: torch.Tensor | None
    dtype: torch.dtype


define_op("dequantize_nvfp4", DequantizeNvfp4Args, fake=dequantize_fake(codes_per_byte=2))(dequantize_body(2))


@register_kernel("dequantize_nvfp4", "reference")
def _dequantize_nvfp4_reference_kernel(args: DequantizeNvfp4Args, out_2d: torch.Tensor) -> None:
    S = None if args.global_amax is None else nvfp4_tensor_scale(args.global_amax)
    values = _dequantize_with_tensor_scale_reference(args.data_2d, args.scale_inv, S, (args.block_rows, NVFP4_BLOCK))
    out_2d.copy_(to_output_dtype(values, args.dtype))


def dequantize_nvfp4_pair(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_global_amax: torch.Tensor | None,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_global_amax: torch.Tensor | None,
    *,
    a_block_shape: BlockShape = (1, NVFP4_BLOCK),
    b_block_shape: BlockShape = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize_nvfp4` of two operands (e.g. a GEMM's) in one call, one launch on CUDA ([Note:
    dequantizing two operands]): the same values as two calls."""
    check_output_dtype(dtype)
    operands = []
    for data, scale_inv, global_amax, block_shape in (
        (a_data, a_scale_inv, a_global_amax, a_block_shape),
        (b_data, b_scale_inv, b_global_amax, b_block_shape),
    ):
        block_shape = check_block_shape(block_shape, NVFP4_SHAPES, "NVFP4")
        if global_amax is not None:
            global_amax = check_scalar(global_amax, "global_amax", data.device).reshape(())
        data_2d = checked_dequantize_operand(data, scale_inv, block_shape, torch.uint8, torch.float8_e4m3fn, 2, "NVFP4")
        operands.append((data_2d, scale_inv, block_shape[0], global_amax))
    (a_2d, a_scale, a_rows, a_amax), (b_2d, b_scale, b_rows, b_amax) = operands
    check_pair_device(a_data, b_data)
    a_out, b_out = call("dequantize_nvfp4_pair", a_2d, a_scale, b_2d, b_scale, a_rows, a_amax, b_rows, b_amax, dtype)
    a_values = with_shape(a_out, (*a_data.shape[:-1], a_out.shape[1]))
    return a_values, with_shape(b_out, (*b_data.shape[:-1], b_out.shape[1]))


class DequantizeNvfp4PairArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.dequantize_nvfp4_pair` ([Note: operator arguments])."""

    a_data_2d: torch.Tensor
    a_scale_inv: torch.Tensor
    b_data_2d: torch.Tensor
    b_scale_inv: torch.Tensor
    a_block_rows: int
    a_global_amax: torch.Tensor | None
    b_block_rows: int
    b_global_amax: torch.Tensor | None
    dtype: torch.dtype

    def operands(self) -> tuple[DequantizeNvfp4Args, DequantizeNvfp4Args]:
        """Each operand's arguments of `dequantize_nvfp4`."""
        return (
            DequantizeNvfp4Args(self.a_data_2d, self.a_scale_inv, self.a_block_rows, self.a_global_amax, self.dtype),
            DequantizeNvfp4Args(self.b_data_2d, self.b_scale_inv, self.b_block_rows, self.b_global_amax, self.dtype),
        )


define_op("dequantize_nvfp4_pair", DequantizeNvfp4PairArgs, fake=dequantize_pair_fake(codes_per_byte=2))(
    dequantize_pair_body(2)
)
register_kernel("dequantize_nvfp4_pair", "reference")(pair_of(_dequantize_nvfp4_reference_kernel))


# ---- the output of an emulated GEMM ---------------------------------------------------------------


def nvfp4_gemm_output_reference(
    product: torch.Tensor,
    a_global_amax: torch.Tensor,
    b_global_amax: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain-torch [Note: NVFP4 GEMM output]: dtype(product * (1/S_a * 1/S_b) + fp32(bias))."""
    factor = torch.reciprocal(nvfp4_tensor_scale(a_global_amax)) * torch.reciprocal(nvfp4_tensor_scale(b_global_amax))
    values = product * factor
    if bias is not None:
        values = values + bias.float()
    return to_output_dtype(values, dtype)


def nvfp4_gemm_output(
    product: torch.Tensor,
    a_global_amax: torch.Tensor,
    b_global_amax: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The output of an emulated NVFP4 GEMM from the fp32 product of its operands' block values.

    [Note: NVFP4 GEMM output] A @ B^T of two NVFP4 operands is (A_b @ B_b^T) / (S_a S_b), A_b and
    B_b the block values (`dequantize_nvfp4(..., None)`: exact in bf16, so bf16 tensor cores with
    fp32 accumulation multiply them). Given that fp32 (M, N) product, this returns
    dtype(product * f + fp32(bias)) with f = fp32(1 / S_a) * fp32(1 / S_b), S from each operand's
    global amax (`nvfp4_tensor_scale`), bias (N,) optional: one fp32 multiply, one fp32 add, one
    rounding (no fused multiply-add). On CUDA one kernel, which computes f itself from the two
    amaxes (no scale ops on the host's stream).
    """
    if not isinstance(product, torch.Tensor) or product.dtype != torch.float32 or product.dim() != 2:
        got = f"{product.dtype} of shape {tuple(product.shape)}" if isinstance(product, torch.Tensor) else type(product)
        raise ValueError(f"product must be a 2-D float32 tensor (the fp32 GEMM product), got {got}")
    check_scalar(a_global_amax, "a_global_amax", product.device)
    check_scalar(b_global_amax, "b_global_amax", product.device)
    if bias is not None and (bias.shape != product.shape[1:] or bias.device != product.device):
        raise ValueError(
            f"bias must have shape ({product.shape[1]},) on {product.device} (one per output column), got "
            f"shape {tuple(bias.shape)} on {bias.device}"
        )
    check_output_dtype(dtype)
    return call(
        "nvfp4_gemm_output", product.contiguous(), a_global_amax.reshape(()), b_global_amax.reshape(()), bias, dtype
    )


class Nvfp4GemmOutputArgs(NamedTuple):
    """The arguments of `torch.ops.quant_core.nvfp4_gemm_output` ([Note: operator arguments])."""

    product: torch.Tensor
    a_global_amax: torch.Tensor
    b_global_amax: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype


def _nvfp4_gemm_output_fake(args: Nvfp4GemmOutputArgs) -> torch.Tensor:
    return args.product.new_empty(args.product.shape, dtype=args.dtype)


@define_op("nvfp4_gemm_output", Nvfp4GemmOutputArgs, fake=_nvfp4_gemm_output_fake)
def _nvfp4_gemm_output_op(kernel: Kernel, args: Nvfp4GemmOutputArgs) -> torch.Tensor:
    """Contract: product contiguous 2-D fp32, amaxes 0-d fp32 and bias None or (N,), all on one
    device. Kernels take (args, out: the new output of args.dtype)."""
    out = torch.empty(args.product.shape, dtype=args.dtype, device=args.product.device)
    if out.numel() > 0:
        kernel(args, out)
    return out


@register_kernel("nvfp4_gemm_output", "reference")
def _nvfp4_gemm_output_reference_kernel(args: Nvfp4GemmOutputArgs, out: torch.Tensor) -> None:
    out.copy_(nvfp4_gemm_output_reference(*args))


def transpose_nvfp4(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless columnwise from rowwise for 16 x 16 tiles: codes transposed and repacked, scales transposed.

    `data` is rowwise packed data (viewed as (M, K/2)); M must be even. The result equals the
    columnwise usage of quantizing the same tensor with 16 x 16 tiles, bit for bit.
    """
    if data.dim() == 0 or data.dtype != torch.uint8:
        raise ValueError(
            f"data must be NVFP4 rowwise data (uint8) with at least one dim, got {data.dtype} of shape {tuple(data.shape)}"
        )
    packed = as_2d(data)
    M, K = packed.shape[0], packed.shape[1] * 2
    if M % 2:
        raise ValueError(f"NVFP4 transpose repacks codes in pairs along dim 0, which must be even; got M={M}")
    expected = (-(-M // NVFP4_BLOCK), -(-K // NVFP4_BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv of 16 x 16 tiles for data of shape {tuple(data.shape)} must have shape {expected}, got "
            f"{tuple(scale_inv.shape)} (1 x 16 data cannot be transposed losslessly: quantize x^T instead)"
        )
    return call("transpose_nvfp4", packed, scale_inv)


def _transposed_packed_shape(packed_MK: torch.Tensor) -> tuple[int, int]:
    """(K, M/2): the packed shape of x^T for packed (M, K/2) codes."""
    return packed_MK.shape[1] * 2, packed_MK.shape[0] // 2


class TransposeNvfp4Args(NamedTuple):
    """The arguments of `torch.ops.quant_core.transpose_nvfp4` ([Note: operator arguments])."""

    packed_MK: torch.Tensor
    scale_inv: torch.Tensor


def _transpose_nvfp4_fake(args: TransposeNvfp4Args) -> tuple[torch.Tensor, torch.Tensor]:
    packed_MK, scale_inv = args.packed_MK, args.scale_inv
    return packed_MK.new_empty(_transposed_packed_shape(packed_MK)), scale_inv.new_empty(scale_inv.shape[::-1])


@define_op("transpose_nvfp4", TransposeNvfp4Args, fake=_transpose_nvfp4_fake, recomputable=True)
def _transpose_nvfp4_op(kernel: Kernel, args: TransposeNvfp4Args) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels take (args with packed_MK contiguous, out_KM: the new packed codes of x^T)."""
    # The scales are transposed here, not by the caller, so that torch.compile recomputes them in
    # the backward with the codes ([Note: recomputed quantizations] in quant_core._recompute).
    out_KM = torch.empty(_transposed_packed_shape(args.packed_MK), dtype=torch.uint8, device=args.packed_MK.device)
    if out_KM.numel() > 0:
        kernel(with_contiguous(args, "packed_MK"), out_KM)
    return out_KM, args.scale_inv.t().clone(memory_format=torch.contiguous_format)


@register_kernel("transpose_nvfp4", "reference")
def _transpose_nvfp4_reference(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    out_KM.copy_(pack_nibbles(unpack_nibbles(args.packed_MK).t()))


# ---- C++ kernels (CPU tensors; [Note: C++ kernel arguments] in quant_core.shared._cpp) ----


@register_kernel("quantize_nvfp4", "cpp")
def _quantize_nvfp4_cpp(args: QuantizeNvfp4Args) -> None:
    seed, hadamard_seed = args.seed, args.hadamard_seed
    seed = seed if seed.device.type == "cpu" else seed.cpu()  # read through its pointer
    _C.quantize_nvfp4(
        *x_args(args.x_MK),
        args.block_rows,
        args.global_amax.data_ptr(),
        args.stochastic_rounding,
        seed.data_ptr(),
        args.columnwise_amax.data_ptr(),
        hadamard_seed is not None,
        (hadamard_seed or 0) & 0xFFFFFFFFFFFFFFFF,
        *outputs(*quantize_buffers(args)),
        torch.get_num_threads(),
    )


@register_kernel("dequantize_nvfp4", "cpp")
def _dequantize_nvfp4_cpp(args: DequantizeNvfp4Args, out_2d: torch.Tensor) -> None:
    R, C = out_2d.shape
    global_amax = args.global_amax
    if global_amax is None:  # the block values alone: the amax whose tensor scale S is exactly 1
        global_amax = torch.full((), E4M3_MAX * E2M1_MAX)
    _C.dequantize_nvfp4(
        args.data_2d.data_ptr(),
        R,
        C,
        args.block_rows,
        args.scale_inv.data_ptr(),
        global_amax.data_ptr(),
        out_2d.data_ptr(),
        out_dtype_code(out_2d),
        torch.get_num_threads(),
    )


register_kernel("dequantize_nvfp4_pair", "cpp")(pair_of(_dequantize_nvfp4_cpp))


@register_kernel("transpose_nvfp4", "cpp")
def _transpose_nvfp4_cpp(args: TransposeNvfp4Args, out_KM: torch.Tensor) -> None:
    packed_MK = args.packed_MK
    R, C = packed_MK.shape[0], packed_MK.shape[1] * 2
    _C.transpose_nvfp4(packed_MK.data_ptr(), R, C, out_KM.data_ptr(), torch.get_num_threads())
