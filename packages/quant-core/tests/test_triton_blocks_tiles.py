"""Which launch choice each block quantize reads, by format, usages and input dtype (no GPU: the
launch is replaced by a recorder)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # CI machines have no Triton: the kernels' module needs it

from quant_core.blocks import _triton_quantize as tb
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.shared._triton_numerics import Tiles

CONSTANTS = (
    "BLOCKWISE_TILES",
    "BLOCKWISE_ROWWISE_TILES",
    "MXFP8_TILES",
    "MXFP8_ROWWISE_TILES",
    "TWO_D_TILES",
    "BLOCKWISE_FP32_TILES",
    "BLOCKWISE_ROWWISE_FP32_TILES",
    "MXFP8_FP32_TILES",
    "TWO_D_FP32_TILES",
)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _mxfp8(x: torch.Tensor, buffers: list[torch.Tensor | None]) -> None:
    tb._quantize_mxfp8(QuantizeMxfp8Args(x, *buffers))


def _blockwise_1x128(x: torch.Tensor, buffers: list[torch.Tensor | None]) -> None:
    tb._quantize_fp8_blockwise(QuantizeFp8BlockwiseArgs(x, 1, torch.float8_e4m3fn, True, *buffers))


def _blockwise_128x128(x: torch.Tensor, buffers: list[torch.Tensor | None]) -> None:
    tb._quantize_fp8_blockwise(QuantizeFp8BlockwiseArgs(x, 128, torch.float8_e4m3fn, True, *buffers))


@pytest.mark.parametrize(
    ("quantize", "columnwise", "dtype", "constant"),
    [
        (_mxfp8, True, FP32, "MXFP8_FP32_TILES"),
        (_mxfp8, True, BF16, "MXFP8_TILES"),
        (_mxfp8, True, FP16, "MXFP8_TILES"),
        (_mxfp8, False, FP32, "MXFP8_ROWWISE_TILES"),
        (_mxfp8, False, BF16, "MXFP8_ROWWISE_TILES"),
        (_blockwise_1x128, True, FP32, "BLOCKWISE_FP32_TILES"),
        (_blockwise_1x128, True, BF16, "BLOCKWISE_TILES"),
        (_blockwise_1x128, False, FP32, "BLOCKWISE_ROWWISE_FP32_TILES"),
        (_blockwise_1x128, False, BF16, "BLOCKWISE_ROWWISE_TILES"),
        (_blockwise_1x128, False, FP16, "BLOCKWISE_ROWWISE_TILES"),
        (_blockwise_128x128, True, FP32, "TWO_D_FP32_TILES"),
        (_blockwise_128x128, True, BF16, "TWO_D_TILES"),
    ],
)
def test_quantize_launches_with_the_constant_of_its_input_dtype(monkeypatch, quantize, columnwise, dtype, constant):
    # A distinct value in every constant: the launch shows which one the quantize read.
    for i, name in enumerate(CONSTANTS):
        monkeypatch.setattr(tb, name, Tiles(i + 1, 128, 4))
    launched = []
    monkeypatch.setattr(tb, "_launch_quantize", lambda x, buffers, *, tiles, **_: launched.append(tiles))
    placeholder = torch.empty(0)
    quantize(torch.zeros(4, 4, dtype=dtype), [placeholder, placeholder, placeholder if columnwise else None, None])
    assert launched == [getattr(tb, constant)], constant
