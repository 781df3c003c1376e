"""Blockwise FP8 known answers, worked out by hand from the rules of docs/design.md, 'Numerics' (never from a reference function).

Per block (1 x 128 along K, or a 128 x 128 tile): scale = the largest power of two with
block_amax * scale <= 448 (1 for an all-zero block), or 448 / block_amax with power_2_scales=False;
codes = fp8(x * scale); scale_inv = 1 / scale (fp32).
E4M3 code = sign << 7 | E << 3 | m for (1 + m/8) * 2^(E - 7): 1.0 = 0x38, 2.0 = 0x40, 4.0 = 0x48,
64 = 0x68, 128 = 0x70, 256 = 0x78, 448 = 0x7E.
"""

from __future__ import annotations

import pytest
import torch

import quant_core

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN = float("nan")


def bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def row(*head: float, length: int = 128, fill: float = 0) -> list[float]:
    return [*head] + [fill] * (length - len(head))


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_power_of_two_scales(backend):
    x = torch.tensor(
        [
            # amax 1: 1 * 256 <= 448 < 1 * 512 -> scale 256, scale_inv 2^-8; 1 -> 256 = 0x78,
            # -0.5 -> -128 = 0xF0, 0.25 -> 64 = 0x68.
            row(1.0, -0.5, fill=0.25),
            # amax 3.5: 3.5 * 128 = 448 exactly -> scale 128, scale_inv 2^-7; 3.5 -> 0x7E, 1 -> 128 = 0x70.
            row(3.5, 1.0),
            # amax 448 -> scale 1; -448 -> 0xFE, -1 -> 0xB8, 2^-9 (the smallest subnormal) -> 0x01.
            row(-448.0, -1.0, 2.0**-9),
            # amax 449 > 448 -> scale 0.5, scale_inv 2; 449 * 0.5 = 224.5 -> 224 (step 16) = 0x76; 2 * 0.5 -> 0x38.
            row(449.0, 2.0),
            # all zero -> scale 1, scale_inv 1; -0.0 keeps its sign -> 0x80.
            row(0.0, 0.0, 0.0, -0.0),
        ],
        dtype=torch.float32,
    )
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x)
    assert q.rowwise_scale_inv.dtype == torch.float32
    assert q.rowwise_scale_inv.tolist() == [[2.0**-8], [2.0**-7], [1.0], [2.0], [1.0]]
    assert q.rowwise_data.dtype == E4M3
    assert bits(q.rowwise_data) == [
        row(0x78, 0xF0, fill=0x68),
        row(0x7E, 0x70),
        row(0xFE, 0xB8, 0x01),
        row(0x76, 0x38),
        row(0x00, 0x00, 0x00, 0x80),
    ]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_non_power_of_two_scale(backend):
    # Row 0, block amax 64. power_2_scales=False: scale = 448 / 64 = 7 (exact), scale_inv = fp32(1/7) = 0x3E124925
    # (1/7 = 1.001001...b * 2^-3, mantissa 001001001001001001001001|001... rounds up in the last bit).
    # Codes: 64 * 7 = 448 -> 0x7E; 1 * 7 = 7 = 1.75 * 4 -> E = 9, m = 6 -> 0x4E;
    # 10 * 7 = 70 -> 72 (step 8 in [64, 128)) = 1.125 * 64 -> E = 13, m = 1 -> 0x69.
    # Row 1, block amax 3: scale = 448 / 3 = 149.333... correctly rounded to fp32 (ulp 2^-16):
    # 9786709.33 * 2^-16 -> 9786709 * 2^-16 = 0x43155555 (reciprocal(3) * 448 would give 0x43155556).
    # scale_inv = 1 / that: 2^47 / 9786709 = 14380471.35 -> 14380471 * 2^-31 = 0x3BDB6DB7.
    # Codes: 3 * scale = 29360127 * 2^-16, a tie at ulp 2^-15 -> 448.0 (even) -> 0x7E;
    # 1 * scale = 149.3 -> 144 (step 16) = 1.125 * 128 -> 0x71; 2 * scale = 298.7 -> 288 (step 32) -> 0x79.
    # Default power-of-two scales: amax 64 -> 64 * 4 = 256 <= 448 < 512 -> scale 4, scale_inv 0.25;
    # 64 * 4 = 256 -> 0x78, 1 * 4 -> 0x48, 10 * 4 = 40 = 1.25 * 32 -> E = 12, m = 2 -> 0x62.
    # amax 3 -> 3 * 128 = 384 <= 448 -> scale 128, scale_inv 2^-7; 384 -> 0x7C, 128 -> 0x70, 256 -> 0x78.
    # Row 2 is all zero: scale 1 either way.
    x = torch.tensor([row(64.0, 1.0, 10.0), row(3.0, 1.0, 2.0), row()], dtype=torch.float32)
    with quant_core.use_backend(backend):
        exact = quant_core.quantize_fp8_blockwise(x, power_2_scales=False)
        pow2 = quant_core.quantize_fp8_blockwise(x)
    assert exact.rowwise_scale_inv.view(torch.int32).tolist() == [[0x3E124925], [0x3BDB6DB7], [0x3F800000]]
    assert bits(exact.rowwise_data) == [row(0x7E, 0x4E, 0x69), row(0x7E, 0x71, 0x79), row()]
    assert pow2.rowwise_scale_inv.tolist() == [[0.25], [2.0**-7], [1.0]]
    assert bits(pow2.rowwise_data) == [row(0x78, 0x48, 0x62), row(0x7C, 0x70, 0x78), row()]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_e5m2_power_of_two_scale(backend):
    # E5M2 max 57344 = 1.75 * 2^15. amax 1 -> scale 2^15 (2^16 > 57344), scale_inv 2^-15.
    # E5M2 code = sign << 7 | E << 2 | m for (1 + m/4) * 2^(E - 15): 1 * 2^15 -> E = 30 -> 0x78;
    # -0.75 * 2^15 = -1.5 * 2^14 -> E = 29, m = 2 -> 0xF6.
    x = torch.tensor([row(1.0, -0.75)], dtype=torch.float32)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x, fp8_dtype=E5M2)
    assert q.rowwise_data.dtype == E5M2
    assert q.rowwise_scale_inv.tolist() == [[2.0**-15]]
    assert bits(q.rowwise_data) == [row(0x78, 0xF6)]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_1x128_columnwise_quantizes_x_transposed(backend):
    # x (2, 128): row 0 all 1.0; row 1 all 3.5 except x[1, 0] = 0.
    # Rowwise: row 0 amax 1 -> scale 256 (1 -> 0x78); row 1 amax 3.5 -> scale 128 (3.5 -> 0x7E, 0 -> 0x00).
    # Columnwise = 1 x 128 quantization of x^T (128, 2): one partial block per column of x.
    # Column 0 = [1, 0] -> amax 1 -> scale 256: [0x78, 0x00]; columns 1.. = [1, 3.5] -> amax 3.5 -> scale 128:
    # [1 * 128 = 0x70, 0x7E].
    x = torch.tensor([[1.0] * 128, [0.0] + [3.5] * 127], dtype=torch.float32)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x, (1, 128), rowwise=True, columnwise=True)
    assert q.rowwise_scale_inv.tolist() == [[2.0**-8], [2.0**-7]]
    assert bits(q.rowwise_data) == [[0x78] * 128, [0x00] + [0x7E] * 127]
    assert tuple(q.columnwise_data.shape) == (128, 2)
    assert q.columnwise_scale_inv.tolist() == [[2.0**-8]] + [[2.0**-7]] * 127
    assert bits(q.columnwise_data) == [[0x78, 0x00]] + [[0x70, 0x7E]] * 127


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_1x128_partial_block_and_single_row_columnwise(backend):
    # x (1, 130): block 0 = [1, 0.5 x 127] -> amax 1 -> scale 256; block 1 = [3.5, -1] -> amax 3.5 -> scale 128.
    # Codes: 1 -> 0x78, 0.5 * 256 = 128 -> 0x70; 3.5 * 128 -> 0x7E, -1 * 128 -> 0xF0.
    # Columnwise of x^T (130, 1): one element per block, so each gets its own scale:
    # 1 -> scale 256, code 0x78; 0.5 -> scale 512, 0x78; 3.5 -> scale 128, 0x7E; -1 -> scale 256, 0xF8.
    x = torch.tensor([[1.0] + [0.5] * 127 + [3.5, -1.0]], dtype=torch.float32)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x, (1, 128), rowwise=True, columnwise=True)
    assert q.rowwise_scale_inv.tolist() == [[2.0**-8, 2.0**-7]]
    assert bits(q.rowwise_data) == [[0x78] + [0x70] * 127 + [0x7E, 0xF0]]
    assert q.columnwise_scale_inv.tolist() == [[2.0**-8]] + [[2.0**-9]] * 127 + [[2.0**-7], [2.0**-8]]
    assert bits(q.columnwise_data) == [[0x78]] * 128 + [[0x7E], [0xF8]]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_128x128_tile_shares_one_scale(backend):
    # x (128, 128) = 1.0 except x[100, 3] = 3.5 and x[5, 120] = -2: one tile, amax 3.5 -> scale 128 for all;
    # 1 * 128 -> 0x70, 3.5 * 128 = 448 -> 0x7E, -2 * 128 = -256 -> 0xF8.
    x = torch.ones(128, 128)
    x[100, 3], x[5, 120] = 3.5, -2.0
    expected = [[0x70] * 128 for _ in range(128)]
    expected[100][3], expected[5][120] = 0x7E, 0xF8
    expected_t = [list(column) for column in zip(*expected, strict=True)]
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x, (128, 128), rowwise=True, columnwise=True)
        transposed_data, transposed_scale = quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)
        rows = quant_core.quantize_fp8_blockwise(x, (1, 128))
    assert q.rowwise_scale_inv.tolist() == [[2.0**-7]]
    assert bits(q.rowwise_data) == expected
    # Columnwise of a 128 x 128 tile: the exact transpose of the rowwise codes and scales.
    assert q.columnwise_scale_inv.tolist() == [[2.0**-7]]
    assert bits(q.columnwise_data) == expected_t
    assert bits(transposed_data) == expected_t
    assert transposed_scale.tolist() == [[2.0**-7]]
    # The same x in 1 x 128 blocks: row 100 (amax 3.5) and row 5 (amax 2: 2 * 128 = 256 <= 448 < 512) get 2^-7,
    # every other row (amax 1) 2^-8.
    expected_rows = [[2.0**-8]] * 128
    expected_rows[100] = expected_rows[5] = [2.0**-7]
    assert rows.rowwise_scale_inv.tolist() == expected_rows


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_partial_128x128_tiles(backend):
    # x (130, 130): tiles [0:128, 0:128], [0:128, 128:130], [128:130, 0:128], [128:130, 128:130].
    # Tile (0, 0): 0.5 with x[127, 127] = 1 -> amax 1 -> scale 256; 0.5 -> 128 = 0x70, 1 -> 256 = 0x78.
    # Tile (0, 1): 1.0 with x[0, 128] = 3.5 -> amax 3.5 -> scale 128; 1 -> 0x70, 3.5 -> 0x7E.
    # Tile (1, 0): 2.0 with x[129, 0] = -448 -> amax 448 -> scale 1; 2 -> 0x40, -448 -> 0xFE.
    # Tile (1, 1): zero -> scale 1; codes 0.
    x = torch.full((130, 130), 0.5)
    x[127, 127] = 1.0
    x[:128, 128:] = 1.0
    x[0, 128] = 3.5
    x[128:, :128] = 2.0
    x[129, 0] = -448.0
    x[128:, 128:] = 0.0
    expected = [[0x70] * 130 for _ in range(130)]
    expected[127][127] = 0x78
    expected[0][128] = 0x7E
    for i in (128, 129):
        expected[i] = [0x40] * 128 + [0x00, 0x00]
    expected[129][0] = 0xFE
    expected_t = [list(column) for column in zip(*expected, strict=True)]
    with quant_core.use_backend(backend):
        q = quant_core.quantize_fp8_blockwise(x, (128, 128), rowwise=True, columnwise=True)
        transposed_data, transposed_scale = quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)
        values = quant_core.dequantize_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv, (128, 128), torch.float32)
        values_t = quant_core.dequantize_fp8_blockwise(
            q.columnwise_data, q.columnwise_scale_inv, (128, 128), torch.float32
        )
    assert q.rowwise_scale_inv.tolist() == [[2.0**-8, 2.0**-7], [1.0, 1.0]]
    assert bits(q.rowwise_data) == expected
    assert q.columnwise_scale_inv.tolist() == [[2.0**-8, 1.0], [2.0**-7, 1.0]]
    assert bits(q.columnwise_data) == expected_t
    assert bits(transposed_data) == expected_t
    assert transposed_scale.tolist() == [[2.0**-8, 1.0], [2.0**-7, 1.0]]
    # Every element of x is exact after scaling, so both usages dequantize back to x (resp. x^T) exactly.
    assert torch.equal(values, x)
    assert torch.equal(values_t, x.t())


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_blockwise_dequantize_known_answer(backend):
    # 1 x 128 blocks, scale_inv [0.25, 3]: 0x7E = 448 -> 112; 0xB8 = -1 -> -0.25; 0x01 = 2^-9 -> 2^-11;
    # 0x7F -> NaN; block 1 (2 wide): 0x38 = 1 -> 3; 0xC0 = -2 -> -6.
    data = torch.tensor([[*row(0x7E, 0xB8, 0x01, 0x7F), 0x38, 0xC0]], dtype=torch.uint8).view(E4M3)
    scale_inv = torch.tensor([[0.25, 3.0]])
    expected = torch.tensor([[*row(112.0, -0.25, 2.0**-11, NAN), 3.0, -6.0]])
    # 128 x 128 tiles, (2, 130) data of 1.0 (0x38), scale_inv [[0.5, 4]]: 0.5 in tile 0, 4 in tile 1.
    tile_data = torch.full((2, 130), 0x38, dtype=torch.uint8).view(E4M3)
    tile_scale_inv = torch.tensor([[0.5, 4.0]])
    with quant_core.use_backend(backend):
        out = quant_core.dequantize_fp8_blockwise(data, scale_inv, (1, 128), torch.float32)
        out_bf16 = quant_core.dequantize_fp8_blockwise(data, scale_inv, (1, 128), torch.bfloat16)
        tiles = quant_core.dequantize_fp8_blockwise(tile_data, tile_scale_inv, (128, 128), torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16, expected.bfloat16(), rtol=0, atol=0, equal_nan=True)
    assert tiles.tolist() == [[0.5] * 128 + [4.0, 4.0]] * 2
