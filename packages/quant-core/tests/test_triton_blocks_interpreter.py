"""The two-pass block quantize kernel ([Note: two-pass block quantize]) and the two-operand
dequantize kernel in Triton's CPU interpreter.

Checks indexing on every machine: partial tiles (masks), tiles that divide x (no masks), several
blocks of rows per program, rolled loops, a transposed view, each usage alone and both, against
the reference bit for bit. The interpreter encodes FP8 with the integer mirror and flushes bf16
subnormals (NOTES.md), so the inputs are fp32; the GPU's hardware path (and `early_nan`, which
the interpreter never takes) is checked by test_triton_blocks.py and benchmarks/sweep_blocks.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

# Run from a file in a fresh process (`quant_core.testing.TritonInterpreterRun`): the script defines a kernel.
_SCRIPT = """
import torch
import triton
import triton.language as tl

import quant_core
from quant_core.blocks import _triton_dequantize, _triton_scales
from quant_core.blocks import _triton_quantize as tb
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import DequantizeMxfp8PairArgs, QuantizeMxfp8Args
from quant_core.blocks._triton_two_pass import TwoPassTiles
from quant_core.shared._triton_numerics import Tiles
from quant_core.testing import adversarial

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


@triton.jit
def scales_kernel(amax_ptr, out_ptr, N, SCALE_RULE: tl.constexpr, E4M3: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    amax = tl.load(amax_ptr + offsets, mask=mask, other=0.0)
    fast, fast_stored = _triton_scales._power_of_two_scale(amax, SCALE_RULE, E4M3)
    slow, slow_stored = _triton_scales._block_scale(amax, SCALE_RULE, E4M3)
    tl.store(out_ptr + 4 * offsets, fast.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + 4 * offsets + 1, slow.to(tl.int32, bitcast=True), mask=mask)
    if SCALE_RULE == 0:
        fast_bits, slow_bits = fast_stored.to(tl.int32), slow_stored.to(tl.int32)
    else:
        fast_bits, slow_bits = fast_stored.to(tl.int32, bitcast=True), slow_stored.to(tl.int32, bitcast=True)
    tl.store(out_ptr + 4 * offsets + 2, fast_bits, mask=mask)
    tl.store(out_ptr + 4 * offsets + 3, slow_bits, mask=mask)


# Every exponent field with the mantissas around 0.75 (where both rules step), zero, subnormals.
mantissas = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF])
fields = torch.arange(255)
bits = ((fields[:, None] << 23) | mantissas[None, :]).reshape(-1)
amaxes = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor([0.0, 1e-45, 1e-40, 1.1e-38])])
for rule, e4m3 in [(0, True), (1, True), (1, False)]:
    out = torch.empty(len(amaxes), 4, dtype=torch.int32)
    scales_kernel[(triton.cdiv(len(amaxes), 256),)](amaxes, out, len(amaxes), rule, e4m3, 256)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 2], out[:, 3]), (rule, e4m3)


def check(fmt, tiles, x, rowwise, columnwise, **kwargs):
    # The constants fp32 inputs read (`tb._tiles_for`).
    usage = dict(rowwise=rowwise, columnwise=columnwise)
    if fmt == "mxfp8":
        tb.MXFP8_FP32_TILES = tb.MXFP8_ROWWISE_TILES = tiles
        want = quant_core.quantize_mxfp8_reference(x, **usage)
    else:
        tb.BLOCKWISE_FP32_TILES = tb.BLOCKWISE_ROWWISE_FP32_TILES = tiles
        want = quant_core.quantize_fp8_blockwise_reference(x, block_shape=(1, 128), **kwargs, **usage)
    buffers = [None if getattr(want, f) is None else torch.empty(getattr(want, f).shape, dtype=getattr(want, f).dtype) for f in FIELDS]
    if fmt == "mxfp8":
        tb._quantize_mxfp8(QuantizeMxfp8Args(x, *buffers))
    else:
        tb._quantize_fp8_blockwise(QuantizeFp8BlockwiseArgs(x, 1, kwargs["fp8_dtype"], kwargs["power_2_scales"], *buffers))
    assert tb._tiles_for("mxfp8" if fmt == "mxfp8" else "1x128", columnwise, x.dtype) is tiles
    for field, got in zip(FIELDS, buffers):
        expected = getattr(want, field)
        if got is not None:
            assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), (fmt, tiles, x.shape, x.stride(), usage, field)


odd = adversarial((40, 72), seed=1)
even = adversarial((64, 128), seed=2)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=4, store_m=16, num_warps=4), odd, True, True)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=8, store_m=32, num_warps=4), even, True, True)
check("mxfp8", TwoPassTiles(tile_k=32, chunk_m=8, store_m=32, num_warps=2, blocks_m=2, unroll=False), odd.t(), True, True)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=16, store_m=32, num_warps=4), odd, False, True)
check("mxfp8", TwoPassTiles(tile_k=64, chunk_m=16, store_m=32, num_warps=4), odd, True, False)
blockwise = adversarial((129, 140), seed=3)
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
check("blockwise", TwoPassTiles(tile_k=128, chunk_m=32, store_m=64, num_warps=4), blockwise, True, True, fp8_dtype=e4m3, power_2_scales=True)
check("blockwise", TwoPassTiles(tile_k=256, chunk_m=32, store_m=128, num_warps=4, unroll=False), blockwise.t(), True, True, fp8_dtype=e5m2, power_2_scales=True)
check("blockwise", TwoPassTiles(tile_k=128, chunk_m=64, store_m=128, num_warps=4), blockwise, False, True, fp8_dtype=e4m3, power_2_scales=False)
check("blockwise", TwoPassTiles(tile_k=128, chunk_m=32, store_m=128, num_warps=4), adversarial((128, 256), seed=4), True, False, fp8_dtype=e4m3, power_2_scales=True)

# Two operands in one launch ([Note: dequantizing two operands]): A's programs, then B's, with
# partial tiles on both sides and an empty A; the values those of the reference, bit for bit.
_triton_dequantize.DEQUANTIZE_TILES = Tiles(16, 64, 2)
q = quant_core.quantize_mxfp8_reference(adversarial((40, 100), seed=5), rowwise=True, columnwise=True)
empty = quant_core.quantize_mxfp8_reference(torch.empty(0, 64))
buffers = [(q.rowwise_data, q.rowwise_scale_inv), (q.columnwise_data, q.columnwise_scale_inv), (empty.rowwise_data, empty.rowwise_scale_inv)]
operands = [(data.contiguous(), scale.contiguous()) for data, scale in buffers]  # as the operator passes them
for a, b in [(operands[0], operands[1]), (operands[1], operands[0]), (operands[2], operands[1])]:
    outs = [torch.empty(data.shape, dtype=torch.float32) for data, _ in (a, b)]
    _triton_dequantize._dequantize_mxfp8_pair(DequantizeMxfp8PairArgs(*a, *b, torch.float32), *outs)
    for (data, scale), out in zip((a, b), outs):
        want = quant_core.dequantize_mxfp8_reference(data, scale, torch.float32)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (data.shape, out.shape)
"""


@pytest.mark.triton_interpreter(_SCRIPT)
def test_two_pass_kernel_equals_the_reference_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()
