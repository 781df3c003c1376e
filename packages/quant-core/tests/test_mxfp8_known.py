"""MXFP8 known answers, worked out by hand from the rules of docs/design.md, 'Numerics' (never from a reference function).

Per block of 32: e = the smallest integer with block_amax <= 448 * 2^e, clamped to [-127, 127]
(-127 for an all-zero block), stored as the E8M0 byte e + 127; codes = e4m3(x / 2^e).
E4M3 code = sign << 7 | E << 3 | m for the value (1 + m/8) * 2^(E - 7) (E >= 1), m * 2^-9 (E = 0):
1.0 = 0x38, 2.0 = 0x40, 4.0 = 0x48, 8.0 = 0x50, 64 = 0x68, 128 = 0x70, 256 = 0x78, 448 = 0x7E.
"""

from __future__ import annotations

import pytest
import torch

import quant_core

NAN, INF = float("nan"), float("inf")


def bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def row(*head: float, length: int = 32, fill: float = 0) -> list[float]:
    return [*head] + [fill] * (length - len(head))


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_e8m0_exponent_edges(backend):
    x = torch.tensor(
        [
            # amax 896 = 448 * 2^1 exactly -> e = 1, byte 128; 896 / 2 = 448 -> 0x7E; -2 / 2 = -1 -> 0xB8.
            row(896.0, -2.0),
            # amax 897 > 896 -> e = 2, byte 129; 897 / 4 = 224.25 -> 224 (step 16 in [128, 256)) = 0x76;
            # 3 / 4 = 0.75 = 1.5 * 2^-1 -> E = 6, m = 4 -> 0x34.
            row(897.0, 3.0),
            # amax 56 = 448 * 2^-3 exactly -> e = -3, byte 124; 1 * 8 = 8 -> 0x50; -56 * 8 = -448 -> 0xFE.
            [1.0] + [0.0] * 30 + [-56.0],
            # amax 56 + 2^-18 (the next fp32 above 56) -> e = -2, byte 125; (56 + 2^-18) * 4 -> 224 (step 16)
            # = 1.75 * 2^7 -> E = 14, m = 6 -> 0x76; 1 * 4 = 4 -> 0x48.
            row(56.0 + 2.0**-18, 1.0),
            # amax 3: 448 * 2^-7 = 3.5 >= 3 > 1.75 = 448 * 2^-8 -> e = -7, byte 120; 3 * 128 = 384 = 1.5 * 2^8
            # -> 0x7C; -0.5 * 128 = -64 -> 0xE8.
            row(3.0, -0.5),
            # all zero (one -0.0) -> e = -127, byte 0; -0.0 keeps its sign -> 0x80.
            row(0.0, 0.0, 0.0, -0.0),
            # amax 2^-130 (an fp32 subnormal) would need e = -138: clamped to -127, byte 0;
            # 2^-130 * 2^127 = 2^-3 -> E = 4 -> 0x20; -1.5 * 2^-131 * 2^127 = -1.5 * 2^-4 -> E = 3, m = 4 -> 0x9C.
            row(2.0**-130, -1.5 * 2.0**-131),
        ],
        dtype=torch.float32,
    )
    with quant_core.use_backend(backend):
        q = quant_core.quantize_mxfp8(x)
    assert q.rowwise_scale_inv.dtype == torch.uint8
    assert q.rowwise_scale_inv.tolist() == [[128], [129], [124], [125], [120], [0], [0]]
    assert q.rowwise_data.dtype == torch.float8_e4m3fn
    assert bits(q.rowwise_data) == [
        row(0x7E, 0xB8),
        row(0x76, 0x34),
        [0x50] + [0x00] * 30 + [0xFE],
        row(0x76, 0x48),
        row(0x7C, 0xE8),
        row(0x00, 0x00, 0x00, 0x80),
        row(0x20, 0x9C),
    ]
    assert q.columnwise_data is None
    assert q.columnwise_scale_inv is None


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_nan_and_inf(backend):
    x = torch.tensor(
        [
            # Block 0: amax over the finite elements is 4 (NaN and +-Inf ignored): 448 * 2^-6 = 7 >= 4 > 3.5
            # -> e = -6, byte 121. NaN (either sign) -> 0x7F; +-Inf saturates to +-448 -> 0x7E / 0xFE;
            # 4 * 64 = 256 -> 0x78; 1 * 64 = 64 -> 0x68.
            # Block 1: no finite nonzero element -> amax 0 -> e = -127, byte 0; Inf still saturates.
            row(NAN, INF, -INF, 4.0, 1.0, -NAN) + row(INF, NAN, -INF)
        ],
        dtype=torch.float32,
    )
    with quant_core.use_backend(backend):
        q = quant_core.quantize_mxfp8(x)
    assert q.rowwise_scale_inv.tolist() == [[121, 0]]
    assert bits(q.rowwise_data) == [row(0x7F, 0x7E, 0xFE, 0x78, 0x68, 0x7F) + row(0x7E, 0x7F, 0xFE)]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_partial_edge_block(backend):
    # K = 40: a full block of 32 and a partial block of 8, leading dims (2, 1) kept in the data's shape.
    # Block 0: amax 3 -> e = -7, byte 120; 1 * 128 -> 0x70, 3 * 128 = 384 -> 0x7C.
    # Block 1: amax 20: 448 * 2^-5 = 14 < 20 <= 28 = 448 * 2^-4 -> e = -4, byte 123;
    # 0.5 * 16 = 8 -> 0x50; -20 * 16 = -320 = -1.25 * 2^8 -> E = 15, m = 2 -> 0xFA.
    first = [1.0] * 5 + [3.0] + [1.0] * 26 + [0.5] * 7 + [-20.0]
    # Row 1: block 0 all zero -> byte 0; block 1 amax 0.5: 448 * 2^-9 = 0.875 >= 0.5 > 0.4375 -> e = -9,
    # byte 118; 0.5 * 512 = 256 -> 0x78, -0.25 * 512 = -128 -> 0xF0.
    second = [0.0] * 32 + [0.5, -0.25] + [0.0] * 6
    x = torch.tensor([[first], [second]], dtype=torch.float32)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_mxfp8(x)
    assert tuple(q.rowwise_data.shape) == (2, 1, 40)
    assert q.rowwise_scale_inv.tolist() == [[120, 123], [0, 118]]
    assert bits(q.rowwise_data) == [
        [[0x70] * 5 + [0x7C] + [0x70] * 26 + [0x50] * 7 + [0xFA]],
        [[0x00] * 32 + [0x78, 0xF0] + [0x00] * 6],
    ]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_columnwise_blocks_run_along_dim0(backend):
    # x is (40, 2). Columnwise = MXFP8 of x^T (2, 40): blocks of 32 + 8 run down each column.
    # Column 0: rows 0..31 = [448, 0 x 31] -> amax 448 -> e = 0, byte 127; 448 -> 0x7E.
    #           rows 32..39 = [-1, 0.5 x 7] -> amax 1: 448 * 2^-8 = 1.75 >= 1 > 0.875 -> e = -8, byte 119;
    #           -1 * 256 -> 0xF8, 0.5 * 256 = 128 -> 0x70.
    # Column 1: all 2 -> e = -7, byte 120 in both blocks; 2 * 128 = 256 -> 0x78.
    column0 = [448.0] + [0.0] * 31 + [-1.0] + [0.5] * 7
    x = torch.tensor([[value, 2.0] for value in column0], dtype=torch.float32)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_mxfp8(x, rowwise=True, columnwise=True)
    assert tuple(q.columnwise_data.shape) == (2, 40)
    assert q.columnwise_scale_inv.tolist() == [[127, 119], [120, 120]]
    assert bits(q.columnwise_data) == [[0x7E] + [0x00] * 31 + [0xF8] + [0x70] * 7, [0x78] * 40]
    # Rowwise (different numbers): one partial block of 2 per row. Row 0 amax 448 -> byte 127, codes
    # [0x7E, 2 -> 0x40]; every other row has amax 2 -> byte 120: 0 -> 0x00, -1 * 128 -> 0xF0, 0.5 * 128 -> 0x68.
    assert q.rowwise_scale_inv.tolist() == [[127]] + [[120]] * 39
    assert bits(q.rowwise_data) == [[0x7E, 0x40]] + [[0x00, 0x78]] * 31 + [[0xF0, 0x78]] + [[0x68, 0x78]] * 7


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_dequantize_known_answer(backend):
    # Row 0, block 0: byte 130 -> e = 3: 0x7E = 448 -> 3584; 0xB8 = -1 -> -8; 0x01 = 2^-9 -> 2^-6; 0x7F -> NaN.
    # Row 0, block 1 (8 wide): byte 100 -> e = -27: 0x38 = 1 -> 2^-27; 0xC0 = -2 -> -2^-26.
    # Row 1, block 0: byte 0 -> e = -127: 0x40 = 2 -> 2^-126; 0x08 = 2^-6 -> 2^-133 (fp32 subnormal).
    # Row 1, block 1: byte 254 -> e = 127: 0x38 -> 2^127; 0xB0 = -0.5 -> -2^126.
    codes = [
        row(0x7E, 0xB8, 0x01, 0x7F) + row(0x38, 0xC0, length=8),
        row(0x40, 0x08) + row(0x38, 0xB0, length=8),
    ]
    data = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[130, 100], [0, 254]], dtype=torch.uint8)
    expected = torch.tensor(
        [
            row(3584.0, -8.0, 2.0**-6, NAN) + row(2.0**-27, -(2.0**-26), length=8),
            row(2.0**-126, 2.0**-133) + row(2.0**127, -(2.0**126), length=8),
        ],
        dtype=torch.float32,
    )
    with quant_core.use_backend(backend):
        out = quant_core.dequantize_mxfp8(data, scale_inv, torch.float32)
        out_bf16 = quant_core.dequantize_mxfp8(data[:1], scale_inv[:1], torch.bfloat16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    # Every value of row 0 is exact in bf16 as well.
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16, expected[:1].bfloat16(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_mxfp8_dequantize_columnwise_known_answer(backend):
    # Columnwise data is x^T's rowwise layout: (K, M) = (1, 40) with blocks of 32 + 8 along M.
    # Byte 119 -> e = -8: 0x7E = 448 -> 1.75; byte 127 -> e = 0: 0xF8 = -256 -> -256.
    data = torch.tensor([[0x7E] * 32 + [0xF8] * 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[119, 127]], dtype=torch.uint8)
    with quant_core.use_backend(backend):
        out = quant_core.dequantize_mxfp8(data, scale_inv, torch.float32)
    assert out.tolist() == [[1.75] * 32 + [-256.0] * 8]
