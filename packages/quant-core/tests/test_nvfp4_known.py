"""NVFP4 and Hadamard known answers, worked out by hand from the rules of docs/design.md, 'Numerics' (never from a reference function).

Tensor scale S = 448 * 6 / global_amax = 2688 / global_amax (1 if 0, clamped to the largest fp32).
Per block: s = e4m3(block_amax / 6 * S), enc = S / s, q = e2m1(x * enc) (q = 0 where s = 0);
dequantized q * (s / S). E2M1 magnitude codes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3;
two codes per byte, the even element in the low nibble.
E4M3 scale bytes used here: 1.0 = 0x38, 1.625 = 0x3D, 2.0 = 0x40, 112 = 0x6E, 224 = 0x76,
384 = 0x7C, 448 = 0x7E.
"""

from __future__ import annotations

import math

import pytest
import torch

import quant_core
from quant_core.testing import splitmix64_int

NAN, INF = float("nan"), float("inf")
FLOAT32_MAX = torch.finfo(torch.float32).max
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def amax(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def pack(codes: list[int]) -> list[int]:
    """The spec's packing, by hand: element 2i in the low nibble of byte i, element 2i + 1 in the high one."""
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]


def decode(data: torch.Tensor) -> torch.Tensor:
    """E2M1 values of packed bytes, from the spec's table (low nibble first)."""
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*data.shape[:-1], -1).long()
    magnitude = torch.tensor(E2M1)[codes & 0x7]
    return torch.where(codes >= 8, -magnitude, magnitude)


# ---- E2M1 codes, packing, scales ---------------------------------------------------------------


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_e2m1_codes_ties_sign_and_nan(backend):
    # Global amax (finite) = 6 -> S = 2688 / 6 = 448; block amax 6 -> s = e4m3(6 / 6 * 448) = 448 (0x7E),
    # enc = 448 / 448 = 1, so each code is e2m1(x) directly. Ties go to the even code:
    # 0.25 -> 0 (0 vs 0.5), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2), 1.75 -> 2.0 (code 4), 2.5 -> 2.0 (code 4),
    # 3.5 -> 4.0 (code 6), 5 -> 4.0 (code 6); 6 -> code 7; -0.0 -> 0x8 (sign kept); NaN -> 0; +Inf saturates to 6
    # (code 7), -Inf to -6 (0xF); 0.5 -> 1; -1.5 -> 0xB; 3 -> 5; 4 -> 6.
    x = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, NAN, INF, -INF, 0.5, -1.5, 3.0, 4.0]
    # codes [0, 2, 2, 4, 4, 6, 6, 7, 8, 0, 7, F, 1, B, 5, 6] -> bytes (high << 4 | low):
    expected = [0x20, 0x42, 0x64, 0x76, 0x08, 0xF7, 0xB1, 0x65]
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(torch.tensor([x]))
    assert q.amax.item() == 6.0
    assert q.rowwise_data.dtype == torch.uint8
    assert q.rowwise_data.tolist() == [expected]
    assert q.rowwise_scale_inv.dtype == torch.float8_e4m3fn
    assert bits(q.rowwise_scale_inv) == [[0x7E]]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_saturates_above_six(backend):
    # Explicit global_amax 6 -> S = 448; block amax 7: 7 / 6 * 448 = 522.7 > 448 -> s = 448 (e4m3 saturates),
    # enc = 1: 7 -> 6 (code 7), -7 -> 0xF, 6.5 -> code 7; -NaN -> 0 (no sign on NaN).
    x = torch.tensor([[7.0, -7.0, 6.5, -NAN] + [0.0] * 12])
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, global_amax=amax(6.0))
    assert bits(q.rowwise_scale_inv) == [[0x7E]]
    assert q.rowwise_data.tolist() == [[0xF7, 0x07, 0, 0, 0, 0, 0, 0]]


def test_nvfp4_tensor_scale_known_answers():
    # 2688 / 6 = 448; 2688 / 2688 = 1; 2688 / 1344 = 2; amax 0 -> 1;
    # 2688 / 10 = 268.8 correctly rounded (ulp 2^-15): 8808038.4 * 2^-15 -> 8808038 * 2^-15 = 268.79998779296875
    # (reciprocal(10) * 2688 would round to the fp32 above);
    # 2688 / 1e-44 and 2688 / (1.125 * 2^-117) = 1.17 * 2^128 overflow fp32 -> the largest fp32.
    cases = [
        (6.0, 448.0),
        (10.0, 268.79998779296875),
        (2688.0, 1.0),
        (1344.0, 2.0),
        (0.0, 1.0),
        (1e-44, FLOAT32_MAX),
        (1.125 * 2.0**-117, FLOAT32_MAX),
    ]
    for global_amax, expected in cases:
        S = quant_core.nvfp4_tensor_scale(amax(global_amax))
        assert S.dtype == torch.float32
        assert S.item() == expected, global_amax


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_block_scale_and_explicit_global_amax(backend):
    # x (1, 32): block 0 = [10, 4, -5, 1, 0...], block 1 = [12, 3, -1, 5, 0...]; own amax 12.
    x = torch.tensor([[10.0, 4.0, -5.0, 1.0] + [0.0] * 12 + [12.0, 3.0, -1.0, 5.0] + [0.0] * 12])
    # Explicit global_amax 2688 (larger than the tensor's own 12) -> S = 1.
    # Block 0: 10 / 6 = 1.667 -> e4m3 (step 0.125) 1.625 (0x3D); enc = 1 / 1.625 = 0.615:
    #   10 -> 6.15 -> 6 (7); 4 -> 2.46 -> 2 (4); -5 -> -3.08 -> -3 (0xD); 1 -> 0.615 -> 0.5 (1).
    # Block 1: 12 / 6 = 2 -> s = 2 (0x40); enc = 0.5: 12 -> 6 (7); 3 -> 1.5 (3); -1 -> -0.5 (0x9);
    #   5 -> 2.5, a tie between 2 (code 4) and 3 (code 5) -> 4.
    explicit = [0x47, 0x1D] + [0] * 6 + [0x37, 0x49] + [0] * 6
    # Dequantized q * s / S: [6, 2, -3, 0.5] * 1.625 = [9.75, 3.25, -4.875, 0.8125]; [6, 1.5, -0.5, 2] * 2.
    explicit_values = [9.75, 3.25, -4.875, 0.8125] + [0.0] * 12 + [12.0, 3.0, -1.0, 4.0] + [0.0] * 12
    # Default global_amax = 12 -> S = 224. Block 0: 10 / 6 * 224 = 373.3 -> e4m3 (step 32) 384 (0x7C),
    #   enc = 224 / 384 = 0.583: 10 -> 5.83 -> 6 (7); 4 -> 2.33 -> 2 (4); -5 -> -2.92 -> -3 (0xD); 1 -> 0.58 -> 0.5 (1).
    # Block 1: 12 / 6 * 224 = 448 (0x7E), enc = 0.5: same codes as above.
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, global_amax=amax(2688.0))
        values = quant_core.dequantize_nvfp4(q.rowwise_data, q.rowwise_scale_inv, q.amax, (1, 16), torch.float32)
        own = quant_core.quantize_nvfp4(x)
    assert q.amax.item() == 2688.0
    assert bits(q.rowwise_scale_inv) == [[0x3D, 0x40]]
    assert q.rowwise_data.tolist() == [explicit]
    assert values.tolist() == [explicit_values]
    assert own.amax.item() == 12.0
    assert bits(own.rowwise_scale_inv) == [[0x7C, 0x7E]]
    assert own.rowwise_data.tolist() == [explicit]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_zero_block_and_underflowing_block_scale(backend):
    # global_amax 2688 -> S = 1.
    # Block 0 is zero (with a -0.0): s = e4m3(0) = 0 -> every code 0, the -0.0 included (q = 0 where s = 0).
    # Block 1 = +-1e-4: 1e-4 / 6 = 1.7e-5 is below half the smallest e4m3 subnormal (2^-10) -> s = 0 -> codes 0.
    # Block 2 = [6, 0...]: s = e4m3(1) = 1 (0x38), enc 1 -> 6 is code 7.
    x = torch.tensor([[0.0, -0.0] + [0.0] * 14 + [1e-4, -1e-4] * 8 + [6.0] + [0.0] * 15])
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, global_amax=amax(2688.0))
    assert bits(q.rowwise_scale_inv) == [[0x00, 0x00, 0x38]]
    assert q.rowwise_data.tolist() == [[0] * 16 + [0x07] + [0] * 7]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_tiny_global_amax_clamps_tensor_scale(backend):
    # x's own amax b = 1.125 * 2^-117: S = 2688 / b = 1.17 * 2^128 overflows -> S = FLOAT32_MAX = (2^24 - 1) * 2^104.
    # b / 6 = 0.1875 * 2^-117 (exact); * S = 384 * (1 - 2^-24) -> fp32 384 - 2^-15 -> e4m3 384 (0x7C).
    # enc = S / 384 = (2^24 - 1) / 3 * 2^97 = 5592405 * 2^97 (exact). Then:
    # 1.125 * 2^-117 -> 5.9999995 -> 6 (7); 2^-118 -> 2.667 -> 3 (5); -2^-120 -> -0.667 -> -0.5 (0x9);
    # 2^-119 -> 1.333 -> 1.5 (3).
    b = 1.125 * 2.0**-117
    x = torch.tensor([[b, 2.0**-118, -(2.0**-120), 2.0**-119] + [0.0] * 12])
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x)
    assert q.amax.item() == b
    assert bits(q.rowwise_scale_inv) == [[0x7C]]
    assert q.rowwise_data.tolist() == [[0x57, 0x39, 0, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_1x16_columnwise_blocks_run_along_dim0(backend):
    # x (32, 2), global amax 6 -> S = 448. Columnwise = 1 x 16 quantization of x^T (2, 32).
    # Column 0 = [6, 1.5 x 15 | 1.5 x 16]: block 0 amax 6 -> s = 448 (0x7E), enc 1: 6 -> 7, 1.5 -> 3;
    #   block 1 amax 1.5 -> s = e4m3(112) = 112 (0x6E), enc 4: 1.5 -> 6 (7).
    # Column 1 = all -1: 1 / 6 * 448 = 74.67 -> e4m3 (step 8) 72 (0x69); enc = 448 / 72 = 6.22:
    #   -1 -> -6.22 saturates to -6 (0xF).
    # Rowwise: one partial block [x0, -1] per row. Row 0: amax 6 -> 0x7E, codes (7, -1 -> 0xA) -> 0xA7;
    #   other rows: amax 1.5 -> 0x6E, enc 4: (1.5 -> 7, -1 -> -4 = 0xE) -> 0xE7.
    x = torch.tensor([[6.0, -1.0]] + [[1.5, -1.0]] * 31)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, (1, 16), rowwise=True, columnwise=True)
    assert tuple(q.columnwise_data.shape) == (2, 16)
    assert bits(q.columnwise_scale_inv) == [[0x7E, 0x6E], [0x69, 0x69]]
    assert q.columnwise_data.tolist() == [[0x37] + [0x33] * 7 + [0x77] * 8, [0xFF] * 16]
    assert bits(q.rowwise_scale_inv) == [[0x7E]] + [[0x6E]] * 31
    assert q.rowwise_data.tolist() == [[0xA7]] + [[0xE7]] * 31


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_16x16_tile_shares_one_scale(backend):
    # x (16, 16) = 1.5 except x[9, 4] = 6; global amax 6 -> S = 448.
    # 16 x 16: one tile, amax 6 -> s = 448 (0x7E), enc 1: 1.5 -> code 3, 6 -> code 7.
    #   Rowwise bytes 0x33, except row 9 byte 2 (elements 4, 5) = 3 << 4 | 7 = 0x37.
    #   Columnwise (x^T codes): 0x33, except row 4 byte 4 (elements 8, 9 of column 4) = 7 << 4 | 3 = 0x73.
    # 1 x 16 on the same x: rows without the 6 have amax 1.5 -> s = e4m3(1.5 / 6 * 448 = 112) = 112 (0x6E),
    #   enc = 4: 1.5 -> 6 (code 7) -> bytes 0x77; row 9 keeps s = 448 and bytes 0x33 / 0x37.
    x = torch.full((16, 16), 1.5)
    x[9, 4] = 6.0
    tile_rows = [[0x33] * 8 for _ in range(16)]
    tile_rows[9][2] = 0x37
    tile_columns = [[0x33] * 8 for _ in range(16)]
    tile_columns[4][4] = 0x73
    block_rows = [[0x77] * 8 for _ in range(16)]
    block_rows[9] = tile_rows[9]
    with quant_core.use_backend(backend):
        tile = quant_core.quantize_nvfp4(x, (16, 16), rowwise=True, columnwise=True)
        blocks = quant_core.quantize_nvfp4(x, (1, 16))
    assert bits(tile.rowwise_scale_inv) == [[0x7E]]
    assert tile.rowwise_data.tolist() == tile_rows
    assert bits(tile.columnwise_scale_inv) == [[0x7E]]
    assert tile.columnwise_data.tolist() == tile_columns
    assert bits(blocks.rowwise_scale_inv) == [[0x6E]] * 9 + [[0x7E]] + [[0x6E]] * 6
    assert blocks.rowwise_data.tolist() == block_rows


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_transpose_equals_16x16_columnwise(backend):
    # x (32, 32) holds E2M1 grid values with code c(i, j) = (i + 3j) % 16 (bit 3 = sign, so code 8 is -0.0),
    # times a factor per tile: 1 for tiles (0, 0) and (1, 1), 0.5 for (0, 1), 0.25 for (1, 0). Every tile holds a
    # code 7 (6 * factor) in each row, so its amax is 6 * factor -> s = 448 * factor: 448 (0x7E), 224 (0x76),
    # 112 (0x6E); enc = 1 / factor (exact), so the codes are c(i, j) again.
    def code(i: int, j: int) -> int:
        return (i + 3 * j) % 16

    factor = [[1.0, 0.5], [0.25, 1.0]]
    x = torch.tensor(
        [
            [
                math.copysign(E2M1[code(i, j) & 7], -1.0 if code(i, j) & 8 else 1.0) * factor[i // 16][j // 16]
                for j in range(32)
            ]
            for i in range(32)
        ]
    )
    rowwise = [pack([code(i, j) for j in range(32)]) for i in range(32)]
    columnwise = [pack([code(i, j) for i in range(32)]) for j in range(32)]
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, (16, 16), rowwise=True, columnwise=True)
        data_t, scale_t = quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)
    assert q.amax.item() == 6.0
    assert q.rowwise_data.tolist() == rowwise
    assert bits(q.rowwise_scale_inv) == [[0x7E, 0x76], [0x6E, 0x7E]]
    assert tuple(q.columnwise_data.shape) == (32, 16)
    assert q.columnwise_data.tolist() == columnwise
    assert bits(q.columnwise_scale_inv) == [[0x7E, 0x6E], [0x76, 0x7E]]
    assert data_t.tolist() == columnwise
    assert bits(scale_t) == [[0x7E, 0x6E], [0x76, 0x7E]]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_odd_packed_dims_raise(backend):
    with quant_core.use_backend(backend):
        with pytest.raises(ValueError, match="even"):
            quant_core.quantize_nvfp4(torch.ones(2, 15))
        # Columnwise 1 x 16 data packs along M, which must then be even too.
        with pytest.raises(ValueError, match="even"):
            quant_core.quantize_nvfp4(torch.ones(3, 16), rowwise=False, columnwise=True)
        assert tuple(quant_core.quantize_nvfp4(torch.ones(3, 16)).rowwise_data.shape) == (3, 8)


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_dequantize_known_answer(backend):
    # Bytes 0x72, 0xF9 -> codes [2, 7, 9, 0xF] -> [1, 6, -0.5, -6].
    data = torch.tensor([[0x72, 0xF9, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    s_1625 = torch.tensor([[0x3D]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    s_448 = torch.tensor([[0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    # 16 x 16 tile of bytes 0x21 (codes 1, 2 -> 0.5, 1.0), s = 2 (0x40).
    tile = torch.full((16, 8), 0x21, dtype=torch.uint8)
    s_2 = torch.tensor([[0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with quant_core.use_backend(backend):
        # global_amax 2688 -> S = 1, s = 1.625: values * 1.625.
        a = quant_core.dequantize_nvfp4(data, s_1625, amax(2688.0), (1, 16), torch.float32)
        # global_amax 6 -> S = 448, s = 448: values * 1.
        b = quant_core.dequantize_nvfp4(data, s_448, amax(6.0), (1, 16), torch.bfloat16)
        # global_amax 1344 -> S = 2, s = 2: values * 1.
        c = quant_core.dequantize_nvfp4(tile, s_2, amax(1344.0), (16, 16), torch.float32)
    assert a.tolist() == [[1.625, 9.75, -0.8125, -9.75] + [0.0] * 12]
    assert b.dtype == torch.bfloat16
    assert b.float().tolist() == [[1.0, 6.0, -0.5, -6.0] + [0.0] * 12]
    assert c.tolist() == [[0.5, 1.0] * 8] * 16


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_dequantize_without_tensor_scale_known_answer(backend):
    # global_amax None: the block values q * s alone (S = 1), whatever the amax was.
    data = torch.tensor([[0x72, 0xF9, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)  # [1, 6, -0.5, -6, 0...]
    s_1625 = torch.tensor([[0x3D]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    tile = torch.full((16, 8), 0x21, dtype=torch.uint8)  # 16 x 16 tile of [0.5, 1.0, ...]
    s_448 = torch.tensor([[0x7E]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with quant_core.use_backend(backend):
        a = quant_core.dequantize_nvfp4(data, s_1625, None, (1, 16), torch.float32)
        b = quant_core.dequantize_nvfp4(tile, s_448, None, (16, 16), torch.bfloat16)
    assert a.tolist() == [[1.625, 9.75, -0.8125, -9.75] + [0.0] * 12]
    assert b.dtype == torch.bfloat16
    assert b.float().tolist() == [[224.0, 448.0] * 8] * 16


# Backends with a kernel for nvfp4_gemm_output on the CPU: the reference (the op serves CUDA's
# emulated GEMM; its Triton kernel is checked in test_triton_nvfp4.py).
def test_nvfp4_gemm_output_known_answers():
    product = torch.tensor([[1.0, -3.0, 2.0**100], [0.375, NAN, -INF]])
    bias = torch.tensor([0.5, 1.0, -2.0], dtype=torch.bfloat16)
    # amaxes 5376 and 672: S_a = 0.5, S_b = 4, so the factor is 2 * 0.25 = 0.5.
    scaled = quant_core.nvfp4_gemm_output(product, amax(5376.0), amax(672.0), dtype=torch.float32)
    assert scaled[0].tolist() == [0.5, -1.5, 2.0**99]
    assert scaled[1, 0] == 0.1875
    assert math.isnan(scaled[1, 1])
    assert scaled[1, 2] == -INF
    # amaxes 0 and 2688: S = 1 for both; the bias is added in fp32 before the one rounding to bf16.
    plain = quant_core.nvfp4_gemm_output(product, amax(0.0), amax(2688.0), bias, torch.bfloat16)
    assert plain.dtype == torch.bfloat16
    assert plain[0].float().tolist() == [1.5, -2.0, 2.0**100]  # the bias is below 2^100's fp32 ulp
    # 0.375 + 0.5 = 0.875 exactly; 1 + 2^-9 (not a bf16) + 0 rounds to even once: 1.0.
    assert plain[1, 0].item() == 0.875
    one_ulp = quant_core.nvfp4_gemm_output(torch.tensor([[1.0 + 2**-9]]), amax(0.0), amax(0.0), None, torch.bfloat16)
    assert one_ulp.item() == 1.0
    # A tiny amax: S clamps to the largest fp32, whose reciprocal rounds to the subnormal 2^-128
    # (not flushed to 0).
    tiny = quant_core.nvfp4_gemm_output(torch.tensor([[2.0**100]]), amax(1.0e-38), amax(2688.0), None, torch.float32)
    assert tiny.item() == 2.0**-28


def test_nvfp4_gemm_output_checks_its_inputs():
    product = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="2-D float32"):
        quant_core.nvfp4_gemm_output(product.bfloat16(), amax(1.0), amax(1.0))
    with pytest.raises(ValueError, match="b_global_amax must be a one-element float32"):
        quant_core.nvfp4_gemm_output(product, amax(1.0), torch.ones(2))
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        quant_core.nvfp4_gemm_output(product, amax(1.0), amax(1.0), torch.zeros(2))
    with pytest.raises(ValueError, match="dtype must be"):
        quant_core.nvfp4_gemm_output(product, amax(1.0), amax(1.0), None, torch.int8)


# ---- stochastic rounding -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_stochastic_rounding_keeps_grid_values(backend):
    # S = 448, s = 448, enc = 1 (block amax 6): every value is on the E2M1 grid, so no seed may move it.
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.0]
    # codes [0, 1, 2, 3, 4, 5, 6, 7, 9, A, B, C, D, E, F, 8]:
    expected = [[0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x8F]] * 4
    x = torch.tensor([grid] * 4)
    with quant_core.use_backend(backend):
        for seed in (0, 1, 12345, 2**63 + 5):
            q = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=seed)
            assert q.rowwise_data.tolist() == expected, seed
            assert bits(q.rowwise_scale_inv) == [[0x7E]] * 4


def _stochastic_input(rows: int) -> torch.Tensor:
    # Each block: [6, 1.2 x 7, -2.5 x 8]. Block amax 6 with S = 448 -> s = 448, enc = 1: no scaling, no saturation.
    return torch.tensor([[6.0] + [1.2] * 7 + [-2.5] * 8]).repeat(rows, 1)


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_stochastic_rounding_is_unbiased(backend):
    rows = 14286  # 1.2 x 100002 and -2.5 x 114288 elements
    x = _stochastic_input(rows)
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=7)
        nearest = quant_core.quantize_nvfp4(x)
    values = decode(q.rowwise_data).double()
    assert bits(q.rowwise_scale_inv) == [[0x7E]] * rows
    assert torch.equal(values[:, 0], torch.full((rows,), 6.0, dtype=torch.float64))
    # 1.2 lies between 1 and 1.5: up with p = 0.4, sd 0.5 * sqrt(p (1 - p)) = 0.245 per element.
    ones = values[:, 1:8]
    assert set(ones.unique().tolist()) == {1.0, 1.5}
    n = ones.numel()
    bound = 4 * 0.5 * math.sqrt(0.4 * 0.6 / n)  # 4 standard errors = 0.0031
    assert abs(ones.mean().item() - 1.2) < bound
    # -2.5 lies between -2 and -3: p = 0.5, sd 0.5 per element.
    halves = values[:, 8:]
    assert set(halves.unique().tolist()) == {-3.0, -2.0}
    bound = 4 * 1.0 * math.sqrt(0.25 / halves.numel())  # 0.0059
    assert abs(halves.mean().item() + 2.5) < bound
    # Round-to-nearest is biased here (1.2 -> 1, -2.5 -> -2 by ties to even), far outside those bounds.
    assert q.rowwise_data.tolist() != nearest.rowwise_data.tolist()
    assert torch.equal(decode(nearest.rowwise_data)[:, 1:8], torch.ones(rows, 7))
    assert torch.equal(decode(nearest.rowwise_data)[:, 8:], torch.full((rows, 8), -2.0))


@pytest.mark.parametrize("backend", quant_core.available_backends())
@pytest.mark.parametrize("seed", [12345, 2**63 + 5])
@pytest.mark.parametrize("seed_as_tensor", [False, True], ids=["int", "tensor"])
def test_nvfp4_stochastic_rounding_known_draws(backend, seed, seed_as_tensor):
    # Every block has amax 6 (global amax 6): S = 448, s = 448, enc = 1. 1.25 lies halfway between
    # 1 and 1.5, so it rounds up (code 3) iff the 24-bit draw is below 2^23, i.e. iff bit 63 of
    # splitmix64(seed, index) is 0, else down to 1.0 (code 2); 6 is on the grid (code 7).
    # Row 0 is all 6; row 1 is [6, 1.25 x 15]. Rowwise index m * 16 + k; columnwise (x^T, rows
    # [6, x[1, k]], its blocks along M) continues at M * K = 32: index 32 + 2k + m.
    x = torch.tensor([[6.0] * 16, [6.0] + [1.25] * 15])

    def code(index: int) -> int:
        return 2 if splitmix64_int(seed, index) >> 63 else 3

    rowwise = [[7] * 16, [7] + [code(16 + k) for k in range(1, 16)]]
    columnwise = [[7, 7]] + [[7, code(32 + 2 * k + 1)] for k in range(1, 16)]
    # The tensor form of a seed holds its uint64 bits as int64 (2^63 + 5 -> -2^63 + 5).
    seed_arg = torch.tensor(seed - 2**64 if seed >= 2**63 else seed) if seed_as_tensor else seed
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(
            x, global_amax=amax(6.0), columnwise=True, stochastic_rounding=True, seed=seed_arg
        )
    assert q.rowwise_data.tolist() == [pack(row) for row in rowwise]
    assert q.columnwise_data.tolist() == [pack(row) for row in columnwise]
    assert {code(i) for i in range(17, 32)} == {2, 3}  # both directions occur: the test can fail


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_nvfp4_stochastic_rounding_depends_only_on_seed(backend):
    x = _stochastic_input(6250)  # 100k elements
    with quant_core.use_backend(backend):
        first = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=3)
        again = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=3)
        other = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=4)
    assert torch.equal(first.rowwise_data, again.rowwise_data)
    # Two independent draws disagree on an element w.p. 2 p (1 - p) = 0.48 (1.2) or 0.5 (-2.5).
    differ = (decode(first.rowwise_data) != decode(other.rowwise_data)).double().mean().item()
    assert 0.4 < differ < 0.6


# ---- random Hadamard transform ----------------------------------------------------------------

# The signs are the top bits of SplitMix64 draws 0..15 ([Note: counter RNG]); seed 0's stream is the published
# one: 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, ... -> -1, +1, +1, ...
SIGNS = {
    0: [-1, 1, 1, -1, 1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1, -1],
    1: [-1, -1, -1, 1, 1, -1, -1, -1, 1, -1, 1, -1, 1, -1, 1, 1],
}


def sylvester(i: int, j: int) -> int:
    """Entry (i, j) of the 16 x 16 Sylvester Hadamard matrix: (-1)^popcount(i & j)."""
    return -1 if bin(i & j).count("1") % 2 else 1


@pytest.mark.parametrize("seed", [0, 1])
def test_hadamard_signs_known_answer(seed):
    signs = quant_core.hadamard_signs(seed)
    assert signs.dtype == torch.float32
    assert signs.tolist() == SIGNS[seed]


@pytest.mark.parametrize("backend", quant_core.available_backends())
@pytest.mark.parametrize("seed", [0, 1])
def test_hadamard_transform_of_one_hot_vectors(backend, seed):
    # T(e_j) = signs[j] * H[:, j] / 4: entries +-0.25 in the Sylvester pattern of column j.
    # Two groups per row (the second group all zero) check that groups do not mix.
    x = torch.cat((torch.eye(16), torch.zeros(16, 16)), dim=1)
    expected = [[SIGNS[seed][j] * sylvester(i, j) * 0.25 for i in range(16)] + [0.0] * 16 for j in range(16)]
    with quant_core.use_backend(backend):
        out = quant_core.hadamard_transform_16(x, seed)
    assert out.dtype == torch.float32
    assert out.tolist() == expected


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_hadamard_transform_preserves_norms_and_dot_products(backend):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=generator)
    b = a + 0.5 * torch.randn(64, 256, generator=generator)
    with quant_core.use_backend(backend):
        ta = quant_core.hadamard_transform_16(a, 3)
        tb = quant_core.hadamard_transform_16(b, 3)
    # Orthonormal: the L2 norm of each group of 16 is kept to 1e-6 (relative).
    norms = a.double().reshape(-1, 16).norm(dim=1)
    torch.testing.assert_close(ta.double().reshape(-1, 16).norm(dim=1), norms, rtol=1e-6, atol=0)
    # Transforming both operands along the same dim keeps their dot products to 1e-5 (relative).
    dots = (a.double() * b.double()).sum(dim=1)
    torch.testing.assert_close((ta.double() * tb.double()).sum(dim=1), dots, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_hadamard_transform_needs_groups_of_16(backend):
    with quant_core.use_backend(backend), pytest.raises(ValueError, match="16"):
        quant_core.hadamard_transform_16(torch.ones(2, 24), 0)
