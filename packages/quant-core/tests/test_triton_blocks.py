"""The Triton kernels of blockwise FP8 and MXFP8 equal the reference bit for bit (CUDA only).

References run on CPU copies of the inputs (see test_triton_fp8.py for why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

pytest.importorskip("triton")  # CI machines have no Triton: the kernels' module needs it

from quant_core.blocks import _triton_quantize
from quant_core.blocks._triton_two_pass import TwoPassTiles

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]

CUDA = torch.device("cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
USAGES = [
    dict(rowwise=True, columnwise=False),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True),
]
# Partial edge blocks of every block size, 1-D, 3-D, and several tiles in each direction.
SHAPES = [(7,), (3, 33), (129, 257), (5, 3, 41), (300, 520)]


class Case(NamedTuple):
    quantize: Callable[..., quant_core.BlockQuantized]
    reference: Callable[..., quant_core.BlockQuantized]
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    dequantize_reference: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _blockwise(block_shape, fp8_dtype, power_2_scales) -> Case:
    kwargs = dict(block_shape=block_shape, fp8_dtype=fp8_dtype, power_2_scales=power_2_scales)
    return Case(
        lambda x, **usage: quant_core.quantize_fp8_blockwise(x, **kwargs, **usage),
        lambda x, **usage: quant_core.quantize_fp8_blockwise_reference(x, **kwargs, **usage),
        lambda d, s, dt: quant_core.dequantize_fp8_blockwise(d, s, block_shape, dt),
        lambda d, s, dt: quant_core.dequantize_fp8_blockwise_reference(d, s, block_shape, dt),
    )


CASES = {
    "mxfp8": Case(
        quant_core.quantize_mxfp8,
        quant_core.quantize_mxfp8_reference,
        quant_core.dequantize_mxfp8,
        quant_core.dequantize_mxfp8_reference,
    ),
    "blockwise-1x128-pow2-e4m3": _blockwise((1, 128), E4M3, True),
    "blockwise-1x128-e4m3": _blockwise((1, 128), E4M3, False),
    "blockwise-1x128-pow2-e5m2": _blockwise((1, 128), E5M2, True),
    "blockwise-128x128-pow2-e4m3": _blockwise((128, 128), E4M3, True),
    "blockwise-128x128-e5m2": _blockwise((128, 128), E5M2, False),
}


def views_of(x: torch.Tensor) -> list[torch.Tensor]:
    """x on the GPU and non-contiguous views of it there (the reference reads `view.cpu()`)."""
    x = x.to(CUDA)
    return [x, x.t(), x[::3, 1::2]] if x.dim() == 2 else [x]


def assert_bitwise(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), what
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.cpu().view(width), want.cpu().view(width)), what


@pytest.mark.parametrize(
    "op", ["quantize_mxfp8", "dequantize_mxfp8", "quantize_fp8_blockwise", "dequantize_fp8_blockwise"]
)
def test_triton_runs_every_block_fp8_op(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_and_dequantize_equal_reference(case, dtype):
    quantize, reference, dequantize, dequantize_reference = CASES[case]
    for shape in SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape) + len(case))
        for i, view in enumerate(views_of(x)):
            for usage in USAGES:
                got, want = quantize(view, **usage), reference(view.cpu(), **usage)
                for field in FIELDS:
                    assert_bitwise(getattr(got, field), getattr(want, field), f"{shape} view {i} {usage} {field}")
        # Dequantize both usages of the reference's result, into every output dtype.
        want = reference(x, rowwise=True, columnwise=True)
        for data, scale_inv in (
            (want.rowwise_data, want.rowwise_scale_inv),
            (want.columnwise_data, want.columnwise_scale_inv),
        ):
            for out_dtype in FLOAT_DTYPES:
                got = dequantize(data.to(CUDA), scale_inv.to(CUDA), out_dtype)
                assert_bitwise(got, dequantize_reference(data, scale_inv, out_dtype), f"{shape} {out_dtype}")


@pytest.mark.parametrize("case", [name for name in CASES if "128x128" not in name])
@pytest.mark.parametrize("early_nan", [False, True])
def test_two_pass_kernel_equals_reference(case, early_nan, monkeypatch):
    # Whatever the module constants pick: [Note: two-pass block quantize] with partial tiles (masks),
    # views, every usage and dtype; early_nan relies on the hardware's code for +NaN.
    # Other tiles than the constants' (more chunks for MXFP8, other warps), bf16 only (the test above
    # covers every dtype with the constants' tiles): every dtype x usage x view is its own Triton
    # compile, and with 1 x 128 in 32 unrolled chunks that took ~3 min per case on the H100.
    mxfp8 = case == "mxfp8"
    chunk_m, store_m = (4, 16) if mxfp8 else (16, 64)
    tiles = TwoPassTiles(
        tile_k=64 if mxfp8 else 128, chunk_m=chunk_m, store_m=store_m, num_warps=4, early_nan=early_nan
    )
    for name in ("MXFP8_TILES", "MXFP8_ROWWISE_TILES") if mxfp8 else ("BLOCKWISE_TILES", "BLOCKWISE_ROWWISE_TILES"):
        monkeypatch.setattr(_triton_quantize, name, tiles)
    quantize, reference, _, _ = CASES[case]
    for shape in [*SHAPES, (256, 512)]:
        x = adversarial(shape, torch.bfloat16, seed=sum(shape) + len(case))
        for i, view in enumerate(views_of(x)):
            for usage in USAGES:
                got, want = quantize(view, **usage), reference(view.cpu(), **usage)
                for field in FIELDS:
                    assert_bitwise(getattr(got, field), getattr(want, field), f"{shape} view {i} {usage} {field}")


def test_mxfp8_dequantize_reads_every_scale_byte():
    # All 256 E8M0 bytes (255 gives 2^128 = Inf, 0 gives 2^-127) against all 256 codes.
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(E4M3)
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 8)
    for out_dtype in FLOAT_DTYPES:
        got = quant_core.dequantize_mxfp8(data.to(CUDA), scales.to(CUDA), out_dtype)
        assert_bitwise(got, quant_core.dequantize_mxfp8_reference(data, scales, out_dtype), f"{out_dtype}")


def test_blockwise_128x128_transpose_equals_columnwise():
    x = adversarial((300, 520), torch.bfloat16, seed=5).to(CUDA)
    q = quant_core.quantize_fp8_blockwise(x, (128, 128), rowwise=True, columnwise=True)
    data_t, scale_t = quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)
    assert_bitwise(data_t, q.columnwise_data, "data")
    assert_bitwise(scale_t, q.columnwise_scale_inv, "scale_inv")


def test_quantize_refills_out_buffers_in_place():
    x = adversarial((256, 384), torch.bfloat16, seed=3).to(CUDA)
    first = quant_core.quantize_mxfp8(x, rowwise=True, columnwise=True)
    pointers = [getattr(first, f).data_ptr() for f in FIELDS]
    second = quant_core.quantize_mxfp8(x * 2, rowwise=True, columnwise=True, out=first)
    assert [getattr(second, f).data_ptr() for f in FIELDS] == pointers
    want = quant_core.quantize_mxfp8_reference((x * 2).cpu(), rowwise=True, columnwise=True)
    for field in FIELDS:
        assert_bitwise(getattr(second, field), getattr(want, field), field)
