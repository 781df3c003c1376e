"""Every backend equals the reference bit for bit for MXFP8, blockwise FP8 and NVFP4.

Hand-computed known answers live in test_*_known.py; this file checks kernels against the
reference over shapes, dtypes, strides, usages and generated values, and the format-level
properties: round-trip error bounds, lossless transposes, in-place refills, bad input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Case(NamedTuple):
    """One format configuration: its public quantize and dequantize, and whether it packs 4-bit codes."""

    quantize: Callable[..., quant_core.BlockQuantized]
    reference: Callable[..., quant_core.BlockQuantized]
    dequantize: Callable[[torch.Tensor, torch.Tensor, quant_core.BlockQuantized, torch.dtype], torch.Tensor]
    dequantize_reference: Callable[[torch.Tensor, torch.Tensor, quant_core.BlockQuantized, torch.dtype], torch.Tensor]
    packed: bool
    error_bound: float  # relative L2 round-trip error on Gaussian data


def _blockwise(block_shape, fp8_dtype, power_2_scales):
    kwargs = dict(block_shape=block_shape, fp8_dtype=fp8_dtype, power_2_scales=power_2_scales)
    return Case(
        lambda x, **usage: quant_core.quantize_fp8_blockwise(x, **kwargs, **usage),
        lambda x, **usage: quant_core.quantize_fp8_blockwise_reference(x, **kwargs, **usage),
        lambda d, s, q, dt: quant_core.dequantize_fp8_blockwise(d, s, block_shape, dt),
        lambda d, s, q, dt: quant_core.dequantize_fp8_blockwise_reference(d, s, block_shape, dt),
        packed=False,
        error_bound=0.04 if fp8_dtype == E4M3 else 0.08,
    )


def _nvfp4(block_shape, stochastic_rounding):
    kwargs = dict(block_shape=block_shape, stochastic_rounding=stochastic_rounding, seed=1234)
    return Case(
        lambda x, **usage: quant_core.quantize_nvfp4(x, **kwargs, **usage),
        lambda x, **usage: quant_core.quantize_nvfp4_reference(x, **kwargs, **usage),
        lambda d, s, q, dt: quant_core.dequantize_nvfp4(d, s, q.amax, block_shape, dt),
        lambda d, s, q, dt: quant_core.dequantize_nvfp4_reference(d, s, q.amax, block_shape, dt),
        packed=True,
        error_bound=0.16 if stochastic_rounding else 0.12,
    )


CASES = {
    "mxfp8": Case(
        quant_core.quantize_mxfp8,
        quant_core.quantize_mxfp8_reference,
        lambda d, s, q, dt: quant_core.dequantize_mxfp8(d, s, dt),
        lambda d, s, q, dt: quant_core.dequantize_mxfp8_reference(d, s, dt),
        packed=False,
        error_bound=0.04,
    ),
    "blockwise-1x128-pow2-e4m3": _blockwise((1, 128), E4M3, True),
    "blockwise-1x128-e4m3": _blockwise((1, 128), E4M3, False),
    "blockwise-1x128-pow2-e5m2": _blockwise((1, 128), E5M2, True),
    "blockwise-128x128-pow2-e4m3": _blockwise((128, 128), E4M3, True),
    "blockwise-128x128-e5m2": _blockwise((128, 128), E5M2, False),
    "nvfp4-1x16": _nvfp4((1, 16), False),
    "nvfp4-1x16-stochastic": _nvfp4((1, 16), True),
    "nvfp4-16x16": _nvfp4((16, 16), False),
    "nvfp4-16x16-stochastic": _nvfp4((16, 16), True),
}
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")
USAGES = [
    dict(rowwise=True, columnwise=False),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True),
]
# Shapes whose (M, K) view has even dims (NVFP4 packs pairs along both): partial edge blocks of every
# block size, 3-D, and a single block row; 1-D (M = 1) and odd shapes are covered for FP8 formats.
EVEN_SHAPES = [(2, 16), (32, 32), (34, 50), (130, 258), (256, 384), (2, 3, 40), (4, 6, 160)]
ODD_SHAPES = [(1,), (7,), (64,), (1, 1), (3, 33), (129, 129), (5, 3, 41)]


def bitwise(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got: quant_core.BlockQuantized, want: quant_core.BlockQuantized) -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), field
            assert torch.equal(bitwise(a), bitwise(b)), field


def shapes_for(case: str) -> list[tuple[int, ...]]:
    return EVEN_SHAPES + ([] if CASES[case].packed else ODD_SHAPES)


PARAMS = [(case, shape) for case in CASES for shape in shapes_for(case)]


@pytest.mark.parametrize(("case", "shape"), PARAMS, ids=[f"{c}-{s}" for c, s in PARAMS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_equals_reference(backend, case, shape, dtype):
    x = adversarial(shape, dtype, seed=sum(shape) + len(case))
    for usage in USAGES:
        assert_same(CASES[case].quantize(x, **usage), CASES[case].reference(x, **usage))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_reads_non_contiguous_views(backend, case, dtype):
    base = adversarial((192, 320), dtype, seed=5)
    views = [base.t(), base[::2, 32:288], base.reshape(12, 16, 320).transpose(0, 1), base[:, ::2]]
    for view in views:
        assert_same(
            CASES[case].quantize(view, rowwise=True, columnwise=True), CASES[case].reference(view, columnwise=True)
        )


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(sorted(CASES)),
    half_rows=st.integers(0, 40),
    half_cols=st.integers(1, 80),
    dtype=st.sampled_from(FLOAT_DTYPES),
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=40
    ),
)
def test_quantize_equals_reference_on_generated_inputs(case, half_rows, half_cols, dtype, values):
    rows, cols = 2 * half_rows, 2 * half_cols
    x = torch.tensor(values).repeat(rows * cols // len(values) + 1)[: rows * cols].reshape(rows, cols).to(dtype)
    expected = CASES[case].reference(x, rowwise=True, columnwise=True)
    for backend in quant_core.available_backends():
        with quant_core.use_backend(backend):
            assert_same(CASES[case].quantize(x, rowwise=True, columnwise=True), expected)


@pytest.mark.parametrize("case", CASES)
def test_quantize_refills_out_in_place(backend, case):
    first = CASES[case].quantize(adversarial((64, 256), torch.bfloat16, seed=1), rowwise=True, columnwise=True)
    x = adversarial((64, 256), torch.bfloat16, seed=2)
    result = CASES[case].quantize(x, rowwise=True, columnwise=True, out=first)
    for field in FIELDS[:4]:
        assert getattr(result, field) is getattr(first, field), field
    assert_same(
        dataclasses.replace(result, amax=None),
        dataclasses.replace(CASES[case].reference(x, columnwise=True), amax=None),
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_dequantize_equals_reference_for_both_usages(backend, case, out_dtype):
    q = CASES[case].reference(adversarial((130, 258), torch.float32, seed=9), columnwise=True)
    for usage in ("rowwise", "columnwise"):
        data, scale_inv = getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv")
        got = CASES[case].dequantize(data, scale_inv, q, out_dtype)
        want = CASES[case].dequantize_reference(data, scale_inv, q, out_dtype)
        assert got.dtype == out_dtype
        assert torch.equal(bitwise(got), bitwise(want)), usage


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_dequantize_decodes_every_code_and_scale_byte_like_the_reference(backend, out_dtype):
    # MXFP8: all 256 codes against all 256 E8M0 bytes (255 gives 2^128 = Inf, 0 gives 2^-127).
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(E4M3)
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 8)
    got = quant_core.dequantize_mxfp8(data, scales, out_dtype)
    assert torch.equal(bitwise(got), bitwise(quant_core.dequantize_mxfp8_reference(data, scales, out_dtype)))
    # NVFP4: all 256 bytes (every pair of E2M1 codes) against all 256 E4M3 block-scale bytes.
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    block_scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 32).view(E4M3)
    amax = torch.tensor(3.0)
    got = quant_core.dequantize_nvfp4(packed, block_scales, amax, (1, 16), out_dtype)
    want = quant_core.dequantize_nvfp4_reference(packed, block_scales, amax, (1, 16), out_dtype)
    assert torch.equal(bitwise(got), bitwise(want))


@pytest.mark.parametrize("case", CASES)
def test_round_trip_error_on_gaussian_data(case):
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    q = CASES[case].quantize(x, rowwise=True, columnwise=True)
    for usage, original in (("rowwise", x), ("columnwise", x.t())):
        restored = CASES[case].dequantize(
            getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv"), q, torch.float32
        )
        error = float((restored - original).norm() / original.norm())
        assert error < CASES[case].error_bound, (usage, error)


@pytest.mark.parametrize("shape", [(256, 384), (130, 258), (4, 6, 160)])
def test_transpose_of_128x128_tiles_is_lossless(backend, shape):
    x = adversarial(shape, torch.bfloat16, seed=3)
    q = quant_core.quantize_fp8_blockwise(x, (128, 128), columnwise=True)
    data, scale_inv = quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)
    assert torch.equal(bitwise(data), bitwise(q.columnwise_data))
    assert torch.equal(scale_inv, q.columnwise_scale_inv)


@pytest.mark.parametrize("shape", [(32, 48), (130, 258), (4, 6, 160)])
def test_transpose_of_16x16_tiles_is_lossless(backend, shape):
    x = adversarial(shape, torch.bfloat16, seed=4)
    q = quant_core.quantize_nvfp4(x, (16, 16), columnwise=True)
    data, scale_inv = quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)
    assert torch.equal(data, q.columnwise_data)
    assert torch.equal(bitwise(scale_inv), bitwise(q.columnwise_scale_inv))


def test_transposes_refuse_one_dimensional_blocks():
    q = quant_core.quantize_fp8_blockwise(torch.randn(256, 256), (1, 128))
    with pytest.raises(ValueError, match="1 x 128 data cannot be transposed losslessly"):
        quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)
    q = quant_core.quantize_nvfp4(torch.randn(32, 32), (1, 16))
    with pytest.raises(ValueError, match="1 x 16 data cannot be transposed losslessly"):
        quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seed", [0, 7, 2**63 + 11])
def test_hadamard_transform_equals_reference(backend, dtype, seed):
    x = adversarial((48, 64), dtype, seed=6)
    for view in (x, x.t().contiguous().t(), x[::2]):
        got = quant_core.hadamard_transform_16(view, seed)
        assert got.dtype == dtype
        assert torch.equal(bitwise(got), bitwise(quant_core.hadamard_transform_16_reference(view, seed)))


def test_stochastic_rounding_depends_on_seed_and_is_reproducible():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    first = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=1)
    assert torch.equal(first.rowwise_data, quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=1).rowwise_data)
    assert not torch.equal(
        first.rowwise_data, quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=2).rowwise_data
    )


# ---- empty and bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", [(0,), (0, 32), (32, 0)])
def test_empty_input_gives_empty_results(backend, case, shape):
    q = CASES[case].quantize(torch.empty(shape), rowwise=True, columnwise=True)
    assert q.rowwise_data.numel() == 0
    assert q.columnwise_data.numel() == 0


@pytest.mark.parametrize("case", CASES)
def test_integer_meta_and_zero_dim_inputs_raise(case):
    quantize = CASES[case].quantize
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="x has dtype torch.complex64"):
        quantize(torch.ones(4, 32, dtype=torch.complex64))
    with pytest.raises(ValueError, match="meta device"):
        quantize(torch.empty(4, 32, device="meta"))
    with pytest.raises(ValueError, match="x is 0-d"):
        quantize(torch.tensor(1.0))


def test_nvfp4_odd_packed_dims_raise():
    with pytest.raises(ValueError, match="last dim, which must be even; got K=33"):
        quant_core.quantize_nvfp4(torch.ones(4, 33))
    for block_shape in ((1, 16), (16, 16)):
        with pytest.raises(ValueError, match="along dim 0 of the .* must be even; got M=3"):
            quant_core.quantize_nvfp4(torch.ones(3, 32), block_shape, columnwise=True)
    assert quant_core.quantize_nvfp4(torch.ones(3, 32)).rowwise_data.shape == (3, 16)  # rowwise alone is fine


def test_bad_block_shapes_raise():
    with pytest.raises(ValueError, match=r"blockwise FP8 block_shape must be one of"):
        quant_core.quantize_fp8_blockwise(torch.ones(4, 128), (1, 32))
    with pytest.raises(ValueError, match=r"NVFP4 block_shape must be one of"):
        quant_core.quantize_nvfp4(torch.ones(4, 32), (32, 32))


def test_bad_seeds_raise():
    for seed in (torch.tensor(1.0), torch.tensor([1]), torch.tensor(1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="seed must be an int or a 0-d int64 tensor"):
            quant_core.quantize_nvfp4(torch.ones(4, 32), stochastic_rounding=True, seed=seed)


def test_mismatched_out_buffer_raises_and_leaves_it_untouched():
    good = quant_core.quantize_mxfp8(torch.randn(64, 64), columnwise=True)
    before = good.rowwise_data.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"out.rowwise_data must be a torch.float8_e4m3fn tensor of shape \(64, 96\)"):
        quant_core.quantize_mxfp8(torch.randn(64, 96), out=good)
    assert torch.equal(good.rowwise_data.view(torch.uint8), before)


def test_dequantize_checks_its_scales():
    q = quant_core.quantize_mxfp8(torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"MXFP8 scale_inv .* must be a torch.uint8 tensor of shape \(64, 2\)"):
        quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv[:, :1])
    with pytest.raises(ValueError, match="dtype must be one of"):
        quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv, torch.int8)
    with pytest.raises(ValueError, match="MXFP8 data must be a torch.float8_e4m3fn tensor"):
        quant_core.dequantize_mxfp8(q.rowwise_data.view(torch.uint8), q.rowwise_scale_inv)


@pytest.mark.parametrize("backend_name", quant_core.available_backends())
def test_nvfp4_encode_factor_is_clamped_like_every_scale(backend_name):
    # Own amax 2^-130: S = 2688 / 2^-130 overflows and clamps to the largest fp32 (just under 2^128);
    # s = e4m3(2^-130 / 6 * S) = e4m3(0.0417) = 0x13 (0.04296875) < 1, so S / s overflows too and must
    # clamp to the same largest fp32. Then 2^-130 * that is just under 0.25 -> 0, -2^-131 * that is
    # about -0.125 -> -0 (0x8), and the zeros keep their sign.
    # Unclamped, enc = Inf would turn the tiny values into +-6 and 0 * Inf into NaN -> 0.
    x = torch.tensor([[2.0**-130, -(2.0**-131), 0.0, -0.0]])
    with quant_core.use_backend(backend_name):
        q = quant_core.quantize_nvfp4(x)
    assert q.rowwise_scale_inv.view(torch.uint8).tolist() == [[0x13]]
    assert q.rowwise_data.tolist() == [[0x80, 0x80]]  # codes [0, 8, 0, 8], packed low nibble first
