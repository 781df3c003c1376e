"""The both-usages kernel variants of issue #15 in Triton's CPU interpreter: `_quantize_packed_kernel`
([Note: packed columnwise codes]: rows per thread 4/8/16, words stored from registers or through
`tl.trans`, TMA descriptor loads and stores) and the two-pass kernel's packed second pass
(`TwoPassTiles(words=True)`).

Checks indexing against the reference bit for bit: partial tiles (masks), tiles that divide x, M
not a multiple of 4 (byte stores instead of words), several blocks of rows per program, transposed
views, each usage alone and both. fp32 inputs and the integer FP8 encode, as in
test_triton_blocks_interpreter.py; the GPU's codes are checked by test_triton_blocks.py and
`scripts/sweep_blocks.py --cases both-usages`.
"""

from __future__ import annotations

import pytest

from quant_core.testing import run_in_triton_interpreter

pytest.importorskip("triton")

_SCRIPT = """
import torch

import quant_core
from quant_core import _triton_blocks as tb
from quant_core._triton_blocks import PackedTiles, TwoPassTiles
from quant_core.testing import adversarial

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def check(fmt, tiles, x, rowwise, columnwise, **kwargs):
    usage = dict(rowwise=rowwise, columnwise=columnwise)
    if fmt == "mxfp8":
        tb.MXFP8_TILES = tb.MXFP8_ROWWISE_TILES = tiles
        want = quant_core.quantize_mxfp8_reference(x, **usage)
    else:
        tb.BLOCKWISE_TILES = tb.BLOCKWISE_ROWWISE_TILES = tiles
        want = quant_core.quantize_fp8_blockwise_reference(x, block_shape=(1, 128), **kwargs, **usage)
    buffers = [None if getattr(want, f) is None else torch.empty(getattr(want, f).shape, dtype=getattr(want, f).dtype) for f in FIELDS]
    if fmt == "mxfp8":
        tb._quantize_mxfp8(x, *buffers)
    else:
        tb._quantize_fp8_blockwise(x, 1, kwargs["fp8_dtype"], kwargs["power_2_scales"], *buffers)
    for field, got in zip(FIELDS, buffers):
        expected = getattr(want, field)
        if got is not None:
            assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), (fmt, tiles, x.shape, x.stride(), usage, field)


P = PackedTiles
odd = adversarial((40, 72), seed=1)  # partial tiles, M % 4 == 0
odd3 = adversarial((37, 72), seed=5)  # M % 4 != 0: byte stores
even = adversarial((64, 128), seed=2)  # no masks
check("mxfp8", P(64, 64, 4, 4), odd, True, True)
check("mxfp8", P(64, 64, 8, 4, transpose=True), odd, True, True)
check("mxfp8", P(32, 64, 16, 2), odd.t(), True, True)
check("mxfp8", P(64, 128, 4, 4), even, True, True)
check("mxfp8", P(64, 64, 4, 4, load_descriptor=True, store_descriptor=True), even, True, True)
check("mxfp8", P(64, 64, 8, 4, load_descriptor=True), odd, True, True)
check("mxfp8", P(32, 64, 4, 2, store_descriptor=True), adversarial((48, 80), seed=6), True, True)
check("mxfp8", P(32, 32, 4, 2), odd3, True, True)
check("mxfp8", P(32, 64, 4, 2, transpose=True), odd3.t(), False, True)
check("mxfp8", P(32, 64, 4, 2), odd, True, False)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=4, store_m=16, num_warps=4, words=True), odd, True, True)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=8, store_m=32, num_warps=4, words=True), odd3, True, True)
check("mxfp8", TwoPassTiles(tile_k=32, chunk_m=8, store_m=32, num_warps=2, blocks_m=2, words=True), odd.t(), True, True)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=8, store_m=32, num_warps=4, words=True), even, False, True)
blockwise = adversarial((132, 140), seed=3)
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
check("blockwise", P(128, 128, 8, 4), blockwise, True, True, fp8_dtype=e4m3, power_2_scales=True)
check("blockwise", P(128, 256, 16, 4, transpose=True), blockwise.t(), True, True, fp8_dtype=e5m2, power_2_scales=True)
check("blockwise", P(128, 128, 4, 4, load_descriptor=True, store_descriptor=True), adversarial((256, 128), seed=4), True, True, fp8_dtype=e4m3, power_2_scales=False)
check("blockwise", P(128, 128, 4, 4), adversarial((130, 128), seed=7), True, True, fp8_dtype=e4m3, power_2_scales=False)
check("blockwise", TwoPassTiles(tile_k=128, chunk_m=32, store_m=64, num_warps=4, words=True), blockwise, True, True, fp8_dtype=e4m3, power_2_scales=True)
check("blockwise", TwoPassTiles(tile_k=128, chunk_m=32, store_m=128, num_warps=8, words=True), blockwise.t(), True, True, fp8_dtype=e5m2, power_2_scales=False)
"""


def test_both_usages_variants_equal_the_reference_in_the_triton_interpreter():
    run_in_triton_interpreter(_SCRIPT)
