"""Blockwise FP8 chunks of a reduce-scatter ([Note: FP8 chunk rows] in quant_core.blocks._chunks).

The reference is pinned by hand-computed rows, sums and stochastic roundings; every other backend
(C++ here, Triton on CUDA, and Triton's CPU interpreter) equals it bit for bit on adversarial
inputs (NaN, +-Inf, denormals, 16 decades), received rows of random bytes included.
"""

from __future__ import annotations

import struct

import pytest
import torch

import quant_core
from quant_core.shared._numerics import encode_fp8_stochastic
from quant_core.testing import adversarial, splitmix64_int

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _row(codes: list[int], block_size: int, scale_invs: list[float]) -> list[int]:
    """A row's bytes: codes zero-padded to whole blocks, then each block's fp32 scale_inv."""
    padded = codes + [0] * (-len(codes) % block_size)
    return padded + [b for s in scale_invs for b in struct.pack("<f", s)]


def test_rows_known_by_hand():
    # Chunk 0: amax 3, scale 2^7 (3 * 2^7 = 384 <= 448 < 768): 128 -> 0x70, -384 -> 0xFC, 64 -> 0x68.
    # Chunk 1: all zero, scale 1.
    x = torch.tensor([1.0, -3.0, 0.5, 0.0, -0.0, 0.0])
    want = torch.tensor(
        [_row([0x70, 0xFC, 0x68], 16, [2.0**-7]), _row([0x00, 0x80, 0x00], 16, [1.0])], dtype=torch.uint8
    )
    assert torch.equal(quant_core.quantize_fp8_chunks(x, 2, 16), want)
    assert torch.equal(quant_core.quantize_fp8_chunks_reference(x.bfloat16(), 2, 16), want)


def test_sums_known_by_hand_in_rank_order():
    # [1, -3, 0.5] and [2, 1, -0.5], both with scale_inv 2^-7: SUM [3, -2, +0], AVG [1.5, -1, +0].
    received = torch.tensor(
        [_row([0x70, 0xFC, 0x68], 16, [2.0**-7]), _row([0x78, 0x70, 0xE8], 16, [2.0**-7])], dtype=torch.uint8
    )
    for fn in (quant_core.dequantize_sum_fp8_chunks, quant_core.dequantize_sum_fp8_chunks_reference):
        assert (
            fn(received, 3, 16).view(torch.int32).tolist() == torch.tensor([3.0, -2.0, 0.0]).view(torch.int32).tolist()
        )
        assert fn(received, 3, 16, average=True).tolist() == [1.5, -1.0, 0.0]
        assert fn(received, 3, 16, average=True, dtype=torch.bfloat16).dtype == torch.bfloat16
    # (1 + 1) + 2^24 = 2^24 + 2, where 2^24 + 1 + 1 would round to 2^24 twice: rank order counts.
    ones = _row([0x38], 16, [1.0])
    big = _row([0x70], 16, [2.0**17])  # 128 * 2^17
    for fn in (quant_core.dequantize_sum_fp8_chunks, quant_core.dequantize_sum_fp8_chunks_reference):
        assert fn(torch.tensor([ones, ones, big], dtype=torch.uint8), 1, 16).item() == 2.0**24 + 2
        assert fn(torch.tensor([big, ones, ones], dtype=torch.uint8), 1, 16).item() == 2.0**24
        # AVG is one division of the sum: (1 + 1) + 3 = 5, 5 / 3 rounded once (5 * fp32(1 / 3) is an ulp above).
        three = _row([0x44], 16, [1.0])
        five_thirds = fn(torch.tensor([ones, ones, three], dtype=torch.uint8), 1, 16, average=True).item()
        assert five_thirds == (torch.tensor(5.0) / torch.tensor(3.0)).item() != (torch.tensor(5.0) * (1 / 3)).item()


# (v, random16, code): [Note: FP8 stochastic rounding] worked by hand.
STOCHASTIC_CASES = {
    E4M3: [
        (1 + 1 / 32, 16383, 0x39),  # a quarter of the step 1/8 above 1.0: up below 2^14
        (1 + 1 / 32, 16384, 0x38),
        (-(1 + 1 / 32), 0, 0xB9),  # negative: the magnitude rounds up
        (2.0**-10, 32767, 0x01),  # half of the subnormal step 2^-9
        (2.0**-10, 32768, 0x00),
        (7.5 * 2**-9, 32767, 0x08),  # between the largest subnormal and 2^-6
        (7.5 * 2**-9, 32768, 0x07),
        (417.0, 2047, 0x7E),  # 1/32 of the step 32 above 416: up to 448 below 2^11
        (417.0, 2048, 0x7D),
        (448.0, 0, 0x7E),  # on the grid: stays, whatever the draw
        (500.0, 0, 0x7E),  # saturates
        (float("inf"), 0, 0x7E),
        (-float("inf"), 65535, 0xFE),
        (-0.0, 0, 0x80),  # -0 keeps its sign
        (float("nan"), 0, 0x7F),
    ],
    E5M2: [
        (1 + 1 / 16, 16383, 0x3D),  # a quarter of the step 1/4
        (1 + 1 / 16, 16384, 0x3C),
        (2.0**-17, 32767, 0x01),  # half of the subnormal step 2^-16
        (2.0**-17, 32768, 0x00),
        (float("inf"), 0, 0x7B),
        (-float("nan"), 0, 0x7F),
    ],
}


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_stochastic_rounding_known_by_hand(fp8_dtype):
    values, draws, codes = zip(*STOCHASTIC_CASES[fp8_dtype], strict=True)
    got = encode_fp8_stochastic(torch.tensor(values), fp8_dtype, torch.tensor(draws))
    assert got.view(torch.uint8).tolist() == list(codes)


def test_element_j_draws_from_the_stream_seed_plus_counter_at_j():
    # 1 + 1/32 in blocks of amax 1 + 1/32: scale 2^8, 264 = 256 + 8 (a quarter of the step 32),
    # so element j is 288 (0x79) iff its draw is below 2^14, else 256 (0x78).
    seed, counter = 2**64 - 3, 5  # the stream is 2: seed + counter wraps modulo 2^64
    x = torch.full((2 * 20,), 1 + 1 / 32)
    draws = [splitmix64_int(2, j) >> 48 for j in range(40)]
    want = [[0x79 if draws[row * 20 + k] < 16384 else 0x78 for k in range(20)] for row in range(2)]
    assert 0 < sum(code == 0x79 for row in want for code in row) < 40
    for fn in (quant_core.quantize_fp8_chunks, quant_core.quantize_fp8_chunks_reference):
        rows = fn(x, 2, 16, stochastic_rounding=True, seed=seed, counter=torch.tensor(counter))
        assert rows[:, :20].tolist() == want


def test_error_feedback_carries_what_was_not_sent():
    # 1 + 1/32 at scale 2^8 is 264: sent as 256 (1.0), residual 1/32; then 1 + 1/16 (272, a tie,
    # to even 256), residual 1/16; then 1 + 3/32 (280): sent as 288 (1.125), residual -1/32.
    # NaN and +-Inf leave a zero residual.
    x = torch.tensor([1 + 1 / 32] * 4 + [float("nan"), float("inf"), -float("inf"), 1.0])
    residual = torch.zeros(8)
    sent = []
    for want in [1 / 32, 1 / 16, -1 / 32]:
        for fn in (quant_core.quantize_fp8_chunks, quant_core.quantize_fp8_chunks_reference):
            trial = residual.clone()
            rows = fn(x, 1, 16, residual=trial)
            assert trial[:4].tolist() == [want] * 4, fn
            assert trial[4:].tolist() == [0.0, 0.0, 0.0, 0.0], fn
        residual = trial
        sent.append(quant_core.dequantize_sum_fp8_chunks(rows, 8, 16)[0].item())
    assert sent == [1.0, 1.0, 1.125]
    assert sum(sent) + residual[0].item() == 3 * (1 + 1 / 32)


CHUNK_LAYOUTS = ((1, 70, 16), (2, 300, 128), (3, 200, 32), (4, 129, 64), (2, 0, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_equals_the_reference_bit_for_bit(backend, dtype):
    for world_size, chunk, block_size in CHUNK_LAYOUTS:
        x = adversarial((world_size * chunk,), dtype, seed=chunk)
        for fp8_dtype in (E4M3, E5M2):
            for stochastic, counter, feedback in (
                (False, None, False),
                (True, torch.tensor(-9), True),
                (True, None, False),
            ):
                start = adversarial((x.numel(),), seed=3).nan_to_num(0.0, 0.0, 0.0) if feedback else None
                residuals = [None if start is None else start.clone() for _ in range(2)]
                options = dict(stochastic_rounding=stochastic, seed=2**63 + 5, counter=counter)
                got = quant_core.quantize_fp8_chunks(
                    x, world_size, block_size, fp8_dtype, residual=residuals[0], **options
                )
                with quant_core.use_backend("reference"):
                    want = quant_core.quantize_fp8_chunks(
                        x, world_size, block_size, fp8_dtype, residual=residuals[1], **options
                    )
                case = (world_size, chunk, block_size, fp8_dtype, stochastic, feedback)
                assert torch.equal(got, want), case
                if feedback:
                    assert torch.equal(residuals[0].view(torch.int32), residuals[1].view(torch.int32)), case
            # Received rows of random bytes: NaN, Inf, subnormal and zero codes and scales.
            generator = torch.Generator().manual_seed(chunk)
            row_bytes = quant_core.chunk_row_bytes(chunk, block_size)
            received = torch.randint(0, 256, (world_size, row_bytes), dtype=torch.uint8, generator=generator)
            for average in (False, True):
                got = quant_core.dequantize_sum_fp8_chunks(
                    received, chunk, block_size, fp8_dtype, average=average, dtype=dtype
                )
                want = quant_core.dequantize_sum_fp8_chunks_reference(
                    received, chunk, block_size, fp8_dtype, average=average, dtype=dtype
                )
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (world_size, chunk, average)


_INTERPRETED = """
import torch

import quant_core
from quant_core.blocks import _triton_chunks
from quant_core.blocks._chunks import DequantizeSumFp8ChunksArgs, QuantizeFp8ChunksArgs
from quant_core.testing import adversarial

_triton_chunks.TILE = 256  # several programs per row, partial last tiles
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
for world_size, chunk, block_size, fp8_dtype in [(2, 300, 128, E4M3), (3, 200, 32, E5M2), (1, 70, 16, E4M3), (4, 513, 64, E5M2)]:
    x = adversarial((world_size * chunk,), seed=chunk)  # fp32: the interpreter flushes bf16 subnormals
    for stochastic, counter, feedback in [(False, None, False), (True, torch.tensor(-5), True), (True, None, False)]:
        residual = torch.randn(x.numel(), generator=torch.Generator().manual_seed(1)) if feedback else None
        want_residual = None if residual is None else residual.clone()
        want = quant_core.quantize_fp8_chunks_reference(
            x, world_size, block_size, fp8_dtype, stochastic_rounding=stochastic, seed=-(2**63) + 3, counter=counter,
            residual=want_residual,
        )
        out = torch.full(want.shape, 0xA5, dtype=torch.uint8)
        args = QuantizeFp8ChunksArgs(x, block_size, fp8_dtype, stochastic, -(2**63) + 3, counter, residual, out)
        _triton_chunks._quantize_fp8_chunks(args)
        assert torch.equal(out, want), (world_size, chunk, block_size, fp8_dtype, stochastic)
        if feedback:
            assert torch.equal(residual.view(torch.int32), want_residual.view(torch.int32)), (world_size, chunk)
    generator = torch.Generator().manual_seed(chunk)
    received = torch.randint(0, 256, (world_size, quant_core.chunk_row_bytes(chunk, block_size)), dtype=torch.uint8, generator=generator)
    for average in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            want = quant_core.dequantize_sum_fp8_chunks_reference(received, chunk, block_size, fp8_dtype, average=average, dtype=dtype)
            out = torch.empty(chunk, dtype=dtype)
            _triton_chunks._dequantize_sum_fp8_chunks(DequantizeSumFp8ChunksArgs(received, block_size, fp8_dtype, average, out))
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (world_size, chunk, average, dtype)
"""


@pytest.mark.triton_interpreter(_INTERPRETED)
def test_triton_kernels_equal_the_reference_in_the_triton_interpreter(triton_interpreter):
    pytest.importorskip("triton")
    triton_interpreter.check()


def test_bad_arguments_are_refused_with_the_fix():
    x = torch.zeros(256)
    with pytest.raises(TypeError, match="dtype torch.int64.*float32, bfloat16 or float16"):
        quant_core.quantize_fp8_chunks(x.long(), 2)
    with pytest.raises(ValueError, match="world_size \\(3\\) equal chunks.*256 elements do not divide.*pad it"):
        quant_core.quantize_fp8_chunks(x, 3)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        quant_core.quantize_fp8_chunks(x, 0)
    for block_size in (48, 256, 8, True, 16.0):
        with pytest.raises(ValueError, match="block_size must divide 128 and be a multiple of 16"):
            quant_core.quantize_fp8_chunks(x, 2, block_size)
    with pytest.raises(ValueError, match="fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        quant_core.quantize_fp8_chunks(x, 2, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="counter must be a 0-d int64 tensor.*add to it in place"):
        quant_core.quantize_fp8_chunks(x, 2, stochastic_rounding=True, counter=torch.tensor([1]))
    with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor of x's 256 elements"):
        quant_core.quantize_fp8_chunks(x, 2, residual=torch.zeros(256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a torch.uint8 tensor of shape \\(2, 132\\)"):
        quant_core.quantize_fp8_chunks(x, 2, out=torch.empty(2, 128, dtype=torch.uint8))
    rows = quant_core.quantize_fp8_chunks(x, 2)
    with pytest.raises(
        ValueError, match="one row of 132 bytes per rank \\(chunk 128, block_size 128\\), got shape \\(2, 131\\)"
    ):
        quant_core.dequantize_sum_fp8_chunks(rows[:, :131], 128)
    with pytest.raises(ValueError, match="2-D uint8 tensor"):
        quant_core.dequantize_sum_fp8_chunks(rows.view(torch.int8), 128)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quant_core.dequantize_sum_fp8_chunks(rows, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be a contiguous tensor of 128 elements"):
        quant_core.dequantize_sum_fp8_chunks(rows, 128, out=torch.empty(127))
