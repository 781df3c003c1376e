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
- the dequantize operators' contracts (`dequantize_nvfp4`, `dequantize_nvfp4_pair`,
  `nvfp4_gemm_output`) are in quant_core.nvfp4._dequantize, `transpose_nvfp4`'s in
  quant_core.nvfp4._transpose, the Hadamard operators' in quant_core.nvfp4._hadamard.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from quant_core._library import define_op, register_kernel
from quant_core.blocks._layout import (
    QUANTIZE_BUFFERS,
    BlockQuantized,
    BlockShape,
    block_amax,
    check_block_shape,
    check_quantize_input,
    copy_into,
    element_index,
    expand_blocks,
    quantize_blocks,
    quantize_blocks_reference,
    quantize_body,
    quantize_buffers,
)
from quant_core.fp8._fp8 import amax, amax_reference, amax_torch_ops
from quant_core.nvfp4._hadamard import hadamard_amaxes, hadamard_amaxes_reference, hadamard_transform_16_reference
from quant_core.shared._checks import as_2d, check_scalar
from quant_core.shared._compile import compiling
from quant_core.shared._cpp import _C, outputs, x_args
from quant_core.shared._numerics import (
    E2M1_MAX,
    E4M3_MAX,
    FLOAT32_MAX,
    divide,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_fp8,
    pack_nibbles,
    random24,
    seed_tensor,
    signed64,
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
    if global_amax is None:  # under torch.compile as torch ops, fused into x's producer
        global_amax = amax_torch_ops(x) if compiling() else amax(x)
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
