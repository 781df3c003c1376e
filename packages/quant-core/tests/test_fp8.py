from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant_core
from quant_core.testing import FLOAT_DTYPES, FP8_DTYPES, adversarial, raw_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.ones((), dtype=torch.float32)


def codes(values: list[float], fp8_dtype: torch.dtype, backend: str = "reference") -> list[int]:
    with quant_core.use_backend(backend):
        rowwise, _ = quant_core.cast_to_fp8(torch.tensor(values), ONE, fp8_dtype)
    return rowwise.view(torch.uint8).tolist()


# ---- known answers, worked out by hand from docs/design.md, 'Numerics' ------------------------


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_e4m3_known_codes(backend):
    # 448 = 1.75 * 2^8 -> 0x7E; 464 is past max and saturates; Inf saturates; any NaN -> 0x7F.
    assert codes([448.0, 464.0, 1e9, float("inf"), -float("inf")], E4M3, backend) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert codes([float("nan"), -float("nan"), 0.0, -0.0], E4M3, backend) == [0x7F, 0x7F, 0x00, 0x80]
    # Ties to even: 1 + 1/16 lies between 1 (0x38) and 1.125 (0x39) -> 0x38; 1 + 3/16 -> 1.25 (0x3A).
    assert codes([1.0625, 1.1875, 1.0625001], E4M3, backend) == [0x38, 0x3A, 0x39]
    # Subnormals are multiples of 2^-9: 2^-10 ties to 0, 3 * 2^-10 ties to 2 * 2^-9, 2^-6 is the first normal.
    assert codes([2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6, 1e-40], E4M3, backend) == [0x01, 0x00, 0x02, 0x08, 0x00]
    # 15.5 * 2^-10 (between subnormal 7*2^-9 and 2^-6) rounds up across the normal boundary.
    assert codes([15.5 * 2.0**-10], E4M3, backend) == [0x08]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_e5m2_known_codes(backend):
    # 57344 = 1.75 * 2^15 -> 0x7B; beyond it saturates (no Inf code is produced).
    assert codes([57344.0, 61440.0, 1e9, float("inf"), -float("inf")], E5M2, backend) == [0x7B, 0x7B, 0x7B, 0x7B, 0xFB]
    assert codes([float("nan"), -float("nan")], E5M2, backend) == [0x7F, 0x7F]
    # Ties to even: 1.125 lies between 1 (0x3C) and 1.25 (0x3D) -> 0x3C; 1.375 -> 1.5 (0x3E).
    assert codes([1.125, 1.375], E5M2, backend) == [0x3C, 0x3E]
    # Subnormals are multiples of 2^-16; 2^-17 ties to 0; 2^-14 is the first normal (0x04).
    assert codes([2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-14], E5M2, backend) == [0x01, 0x00, 0x02, 0x04]


def test_scale_known_answers():
    scale, scale_inv = quant_core.fp8_scale(torch.tensor(2.0), E4M3)
    assert scale.item() == 224.0
    assert torch.equal(scale_inv, torch.tensor(1 / 224.0, dtype=torch.float32))
    scale, _ = quant_core.fp8_scale(torch.tensor(3.0), E4M3, power_2_scales=True)  # 149.33 -> 128
    assert scale.item() == 128.0
    scale, scale_inv = quant_core.fp8_scale(torch.tensor(0.0), E5M2)
    assert (scale.item(), scale_inv.item()) == (1.0, 1.0)
    # A denormal amax would overflow the scale: clamped to the largest finite fp32.
    scale, _ = quant_core.fp8_scale(torch.tensor(1e-44), E4M3)
    assert scale.item() == torch.finfo(torch.float32).max
    scale, _ = quant_core.fp8_scale(torch.tensor(1e-44), E4M3, power_2_scales=True)
    assert scale.item() == 2.0**127


def test_quantize_reference_known_answer():
    x = torch.tensor([[1.0, -2.0], [0.5, float("nan")]])
    q = quant_core.quantize_fp8_reference(x, E4M3, columnwise=True)
    assert q.amax.item() == 2.0
    assert q.scale.item() == 224.0
    # 224 = 1.75 * 2^7 -> 0x76; -448 -> 0xFE; 112 -> 0x6E; NaN -> 0x7F.
    assert raw_bits(q.rowwise_data).tolist() == [[0x76, 0xFE], [0x6E, 0x7F]]
    assert raw_bits(q.columnwise_data).tolist() == [[0x76, 0x6E], [0xFE, 0x7F]]


# ---- every backend equals the reference, bit for bit -------------------------------------------

SHAPES = [
    (1,),
    (5,),
    (200_003,),
    (1, 1),
    (64, 64),
    (65, 63),
    (130, 257),
    (3, 17, 40),
    (2, 3, 4, 5),
    (0,),
    (0, 8),
    (8, 0),
]


def assert_same(result: quant_core.Float8Quantized, expected: quant_core.Float8Quantized) -> None:
    for field in ("rowwise_data", "columnwise_data"):
        got, want = getattr(result, field), getattr(expected, field)
        assert (got is None) == (want is None), field
        if got is not None:
            assert (got.dtype, got.shape) == (want.dtype, want.shape), field
            assert torch.equal(raw_bits(got), raw_bits(want)), field
    for field in ("scale", "scale_inv", "amax"):
        assert torch.equal(getattr(result, field), getattr(expected, field)), field


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("power_2_scales", [False, True])
def test_quantize_equals_reference(backend, fp8_dtype, dtype, shape, power_2_scales):
    x = adversarial(shape, dtype, seed=len(shape) * 7 + sum(shape))
    for rowwise, columnwise in [(True, False), (False, True), (True, True)]:
        kwargs = dict(power_2_scales=power_2_scales, rowwise=rowwise, columnwise=columnwise)
        assert_same(
            quant_core.quantize_fp8(x, fp8_dtype, **kwargs), quant_core.quantize_fp8_reference(x, fp8_dtype, **kwargs)
        )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_reads_non_contiguous_views(backend, fp8_dtype, dtype):
    base = adversarial((192, 160), dtype, seed=11)
    views = [
        base.t(),
        base[::3, 5::2],
        base.reshape(12, 16, 160).transpose(0, 1),
        base[:, :1],
        base.expand(2, 192, 160),
    ]
    for view in views:
        assert_same(
            quant_core.quantize_fp8(view, fp8_dtype, columnwise=True),
            quant_core.quantize_fp8_reference(view, fp8_dtype, columnwise=True),
        )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_covers_the_whole_fp32_grid(backend, fp8_dtype):
    # Every fp32 sign/exponent/top-8-mantissa pattern, each with low bits that sit just below, on and
    # just above the rounding point of both formats: every tie and saturation case.
    high = torch.arange(1 << 17, dtype=torch.int64) << 15
    for low in (0, 0x3FFF, 0x4000, 0x4001, 0x7FFF, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF, 0x100000):
        patterns = (high | low) & 0xFFFFFFFF
        x = torch.where(patterns >= 2**31, patterns - 2**32, patterns).to(torch.int32).view(torch.float32)
        got, _ = quant_core.cast_to_fp8(x, ONE, fp8_dtype)
        want, _ = quant_core.cast_to_fp8_reference(x, ONE, fp8_dtype)
        assert torch.equal(raw_bits(got), raw_bits(want)), hex(low)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(FLOAT_DTYPES),
    fp8_dtype=st.sampled_from(FP8_DTYPES),
    power_2_scales=st.booleans(),
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=50
    ),
)
def test_quantize_equals_reference_on_generated_inputs(shape, dtype, fp8_dtype, power_2_scales, values):
    numel = 1
    for size in shape:
        numel *= size
    x = torch.tensor(values, dtype=torch.float32).repeat(numel // len(values) + 1)[:numel].reshape(shape).to(dtype)
    expected = quant_core.quantize_fp8_reference(x, fp8_dtype, power_2_scales=power_2_scales, columnwise=True)
    for backend in quant_core.available_backends():
        with quant_core.use_backend(backend):
            assert_same(quant_core.quantize_fp8(x, fp8_dtype, power_2_scales=power_2_scales, columnwise=True), expected)


def test_cast_fills_given_buffers_in_place(backend):
    x = adversarial((70, 90), torch.bfloat16, seed=5)
    scale = torch.tensor(3.0)
    rowwise_out, columnwise_out = torch.empty(70, 90, dtype=E4M3), torch.empty(90, 70, dtype=E4M3)
    rowwise, columnwise = quant_core.cast_to_fp8(
        x, scale, E4M3, columnwise=True, rowwise_out=rowwise_out, columnwise_out=columnwise_out
    )
    assert rowwise is rowwise_out
    assert columnwise is columnwise_out
    want_rowwise, want_columnwise = quant_core.cast_to_fp8_reference(x, scale, E4M3, columnwise=True)
    assert torch.equal(raw_bits(rowwise_out), raw_bits(want_rowwise))
    assert torch.equal(raw_bits(columnwise_out), raw_bits(want_columnwise))


def test_round_trip_error_on_gaussian_data():
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    for fp8_dtype, bound in ((E4M3, 0.04), (E5M2, 0.08)):
        q = quant_core.quantize_fp8(x, fp8_dtype)
        error = (quant_core.dequantize_fp8_reference(q.rowwise_data, q.scale_inv) - x).norm() / x.norm()
        assert error < bound, (fp8_dtype, error)


# ---- bad input -------------------------------------------------------------------------------


def test_bad_fp8_dtype_raises():
    with pytest.raises(ValueError, match=r"fp8_dtype must be torch\.float8_e4m3fn or torch\.float8_e5m2"):
        quant_core.quantize_fp8(torch.ones(4), torch.bfloat16)


def test_zero_dim_input_raises():
    with pytest.raises(ValueError, match=r"x is 0-d.*reshape it to \(1,\)"):
        quant_core.quantize_fp8(torch.tensor(1.0))


def test_no_usage_raises():
    with pytest.raises(ValueError, match="at least one usage"):
        quant_core.quantize_fp8(torch.ones(4), rowwise=False)


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        (torch.ones(2), "one-element float32"),
        (torch.ones((), dtype=torch.float64), "one-element float32"),
        (2.0, "got float"),
    ],
)
def test_bad_scale_raises(scale, match):
    with pytest.raises(ValueError, match=match):
        quant_core.cast_to_fp8(torch.ones(4), scale, E4M3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rowwise_out=torch.empty(4, 5, dtype=E4M3)), r"rowwise_out must be a .* of shape \(4, 6\)"),
        (dict(rowwise_out=torch.empty(4, 6, dtype=E5M2)), "rowwise_out must be a torch.float8_e4m3fn"),
        (dict(rowwise_out=torch.empty(6, 4, dtype=E4M3).t()), "rowwise_out must be contiguous"),
        (dict(columnwise=True, columnwise_out=torch.empty(4, 6, dtype=E4M3)), r"columnwise_out .* shape \(6, 4\)"),
    ],
)
def test_mismatched_output_buffer_raises_and_writes_nothing(kwargs, match):
    out = next(iter(kwargs.values())) if "rowwise_out" in kwargs else kwargs["columnwise_out"]
    before = out.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=match):
        quant_core.cast_to_fp8(torch.ones(4, 6), ONE, E4M3, **kwargs)
    assert torch.equal(out.view(torch.uint8), before)


# ---- delayed scaling, dequantize, transpose ------------------------------------------------------


def test_delayed_scaling_history_and_margin():
    history = torch.zeros(4)
    for value in (3.0, 1.0, 2.0):
        quant_core.push_amax_(history, torch.tensor(value))
    assert history.tolist() == [2.0, 1.0, 3.0, 0.0]  # newest first
    assert quant_core.amax_from_history(history).item() == 3.0
    assert quant_core.amax_from_history(history, "most_recent").item() == 2.0
    for value in (5.0, 6.0):  # the history keeps its length: the oldest entries fall off
        quant_core.push_amax_(history, torch.tensor(value))
    assert history.tolist() == [6.0, 5.0, 2.0, 1.0]
    # scale = fmax / amax / 2^margin: 448 / 7 / 4 = 16.
    scale, scale_inv = quant_core.fp8_scale(torch.tensor(7.0), E4M3, margin=2)
    assert (scale.item(), scale_inv.item()) == (16.0, 1 / 16)


def test_delayed_scaling_rejects_bad_history_and_algo():
    with pytest.raises(ValueError, match="non-empty 1-D float32"):
        quant_core.amax_from_history(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        quant_core.amax_from_history(torch.zeros(3), "mean")  # type: ignore[arg-type]


def test_fp8_scale_is_one_ieee_division():
    # 448 / 3 rounds to 0x43155555; torch's `448.0 / tensor` (reciprocal, then multiply) gives ...56.
    scale, _ = quant_core.fp8_scale(torch.tensor(3.0), E4M3)
    assert scale.view(torch.int32).item() == 0x43155555


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (70, 90), (3, 5, 40), (0, 4)])
def test_dequantize_equals_reference(backend, fp8_dtype, out_dtype, shape):
    q = quant_core.quantize_fp8_reference(adversarial(shape, torch.float32, seed=2), fp8_dtype, columnwise=True)
    for data in (q.rowwise_data, q.columnwise_data):
        got = quant_core.dequantize_fp8(data, q.scale_inv, out_dtype)
        want = quant_core.dequantize_fp8_reference(data, q.scale_inv, out_dtype)
        assert (got.dtype, got.shape) == (out_dtype, data.shape)
        bitwise = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[out_dtype]
        assert torch.equal(got.view(bitwise), want.view(bitwise))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale_inv", [1.0, 3.0, 2.0**-20, 2.0**100])
def test_dequantize_decodes_every_code_like_the_reference(backend, fp8_dtype, out_dtype, scale_inv):
    # All 256 codes (NaNs, +-Inf for E5M2, subnormals, both zeros) in rows of 256, scales that keep
    # them, shrink them into subnormals or overflow bf16 and fp16.
    data = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(fp8_dtype)
    scale = torch.tensor(scale_inv, dtype=torch.float32)
    got = quant_core.dequantize_fp8(data, scale, out_dtype)
    want = quant_core.dequantize_fp8_reference(data, scale, out_dtype)
    assert torch.equal(raw_bits(got), raw_bits(want))


@pytest.mark.parametrize("shape", [(1,), (70, 90), (3, 5, 40), (300, 200)])
def test_transpose_equals_columnwise(backend, shape):
    q = quant_core.quantize_fp8(adversarial(shape, torch.bfloat16, seed=8), columnwise=True)
    assert torch.equal(raw_bits(quant_core.transpose_fp8(q.rowwise_data)), raw_bits(q.columnwise_data))
    back = quant_core.transpose_fp8(q.columnwise_data)  # and back again: the (M, K) view of rowwise
    assert torch.equal(raw_bits(back), raw_bits(q.rowwise_data.reshape(back.shape)))


def test_dequantize_and_transpose_reject_non_fp8_data():
    with pytest.raises(ValueError, match="data must have an FP8 dtype"):
        quant_core.dequantize_fp8(torch.ones(3), torch.tensor(1.0))
    with pytest.raises(ValueError, match="data must be FP8 data"):
        quant_core.transpose_fp8(torch.ones(3, 3, dtype=torch.uint8))
