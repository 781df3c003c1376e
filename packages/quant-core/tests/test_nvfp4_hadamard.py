"""NVFP4's Hadamard-transformed columnwise usage ([Note: NVFP4 random Hadamard transform]):
known answers worked out by hand, every backend equal to the reference bit for bit (random and
adversarial values, dtypes, strides, usages, stochastic rounding), the amaxes in one read, the
inverse, the wgrad product it preserves, and the refusals.

The signs of seed 0 are SIGNS[0] of test_nvfp4_known.py:
[-1, 1, 1, -1, 1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1, -1]. T(v) = (1/4) H_16 D v.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

SIGNS_0 = [-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")
USAGES = [
    dict(rowwise=True, columnwise=False),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True),
]
# (M, K) views with M a multiple of 16 (whole runs) and K even: partial blocks along K, 3-D, many tiles.
SHAPES = [(16, 16), (32, 50), (64, 258), (4, 8, 40), (160, 384)]
NAN, INF = float("nan"), float("inf")


def bitwise(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got: quant_core.BlockQuantized, want: quant_core.BlockQuantized, what: str = "") -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), (what, field)
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, field)
            assert torch.equal(bitwise(a), bitwise(b)), (what, field)


def e4m3_bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


# ---- known answers ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_transformed_columnwise_known_answer(backend):
    # x (16, 2): column 0 = [8, 0 x 15] (a one-hot run), column 1 = the signs themselves.
    # T(8 e_0) = 8 * s_0 * H[:, 0] / 4 = -2 in every row; T(s) = H (D s) / 4 = H 1 / 4 = [4, 0 x 15].
    # So amax(x) = 8 and amax(T(x^T)) = 4 (not 8: each usage has its own amax).
    # Columnwise: S_c = 2688 / 4 = 672.
    #   Column 0: block amax 2 -> s = e4m3(2 / 6 * 672 = 224) = 224 (0x76), enc = 672 / 224 = 3: -2 -> -6 (0xF).
    #   Column 1: block amax 4 -> s = e4m3(4 / 6 * 672 = 448) = 448 (0x7E), enc = 1.5: 4 -> 6 (code 7), zeros -> 0.
    # Rowwise (unchanged by the transform): S = 2688 / 8 = 336.
    #   Row 0 = [8, -1]: amax 8 -> s = e4m3(448) = 0x7E, enc = 0.75: 8 -> 6 (7), -1 -> -0.75 -> -1 (tie up: 0xA).
    #   Rows i > 0 = [0, s_i]: amax 1 -> s = e4m3(56) = 56 (0x66), enc = 6: s_i -> +-6 (7 or 0xF), 0 -> 0.
    x = torch.tensor([[8.0, SIGNS_0[0]]] + [[0.0, s] for s in SIGNS_0[1:]])
    with quant_core.use_backend(backend):
        q = quant_core.quantize_nvfp4(x, rowwise=True, columnwise=True, hadamard_seed=0)
        amaxes = quant_core.hadamard_amaxes(x, 0)
    assert amaxes.tolist() == [8.0, 4.0]
    assert q.amax.item() == 8.0
    assert q.columnwise_amax.item() == 4.0
    assert e4m3_bits(q.columnwise_scale_inv) == [[0x76], [0x7E]]
    assert q.columnwise_data.tolist() == [[0xFF] * 8, [0x07] + [0] * 7]
    assert e4m3_bits(q.rowwise_scale_inv) == [[0x7E]] + [[0x66]] * 15
    assert q.rowwise_data.tolist() == [[0xA7]] + [[0x70 if s > 0 else 0xF0] for s in SIGNS_0[1:]]
    # Dequantized: -6 * 224 / 672 = -2 and 6 * 448 / 672 = 4, exactly T(x^T); the inverse gives x^T back.
    values = quant_core.dequantize_nvfp4(q.columnwise_data, q.columnwise_scale_inv, q.columnwise_amax)
    assert values.tolist() == [[-2.0] * 16, [4.0] + [0.0] * 15]
    assert torch.equal(quant_core.hadamard_inverse_16(values, 0), x.t())


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_hadamard_amaxes_known_answers(backend):
    # x (20, 2): column 0 = [8, 0 x 15 | 3, 0, 0, 0]: runs [8, 0...] -> |T| = 2 and the partial run
    # [3, 0, 0, 0] padded with zeros -> |T| = 0.75. Column 1: NaN and +Inf in run 0 (its transform is
    # NaN or +-Inf everywhere: ignored), -5 in row 3, 2^100 in row 17 (|T| = 2^98 in its run).
    # amax(x) = 2^100 (NaN, Inf ignored); amax(T(x^T)) = 2^98.
    x = torch.zeros(20, 2)
    x[0, 0], x[16, 0] = 8.0, 3.0
    x[1, 1], x[2, 1], x[3, 1], x[17, 1] = NAN, INF, -5.0, 2.0**100
    with quant_core.use_backend(backend):
        got = quant_core.hadamard_amaxes(x, 0)
        small = quant_core.hadamard_amaxes(x[:, :1], 0)
        nothing_finite = quant_core.hadamard_amaxes(torch.full((16, 4), INF), 0)
        empty = quant_core.hadamard_amaxes(torch.empty(0, 16), 0)
    assert got.dtype == torch.float32
    assert got.tolist() == [2.0**100, 2.0**98]
    assert small.tolist() == [8.0, 2.0]
    assert nothing_finite.tolist() == [0.0, 0.0]
    assert empty.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("backend", quant_core.available_backends())
def test_inverse_undoes_the_transform(backend):
    # T^-1 (T(e_j)) = e_j exactly: T(e_j) = +-0.25 entries, H 0.25 s_j H[:, j] / 4 = s_j e_j, times s_j.
    x = torch.eye(16)
    with quant_core.use_backend(backend):
        for seed in (0, 1, 2**63 + 5):
            assert torch.equal(quant_core.hadamard_inverse_16(quant_core.hadamard_transform_16(x, seed), seed), x)
        y = adversarial((48, 64), torch.bfloat16, seed=3)
        for view in (y, y.t().contiguous().t(), y[::2]):
            got = quant_core.hadamard_inverse_16(view, 7)
            assert got.dtype == torch.bfloat16
            assert torch.equal(bitwise(got), bitwise(quant_core.hadamard_inverse_16_reference(view, 7)))
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    round_trip = quant_core.hadamard_inverse_16_reference(quant_core.hadamard_transform_16_reference(g, 9), 9)
    torch.testing.assert_close(round_trip, g, rtol=0, atol=1e-6)


# ---- every backend equals the reference -----------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_quantize_equals_reference(backend, shape, dtype, stochastic_rounding):
    x = adversarial(shape, dtype, seed=sum(shape))
    kwargs = dict(stochastic_rounding=stochastic_rounding, seed=2**63 + 12345)
    for hadamard_seed in (0, -(2**62) + 3):
        for usage in USAGES:
            got = quant_core.quantize_nvfp4(x, hadamard_seed=hadamard_seed, **kwargs, **usage)
            want = quant_core.quantize_nvfp4_reference(x, hadamard_seed=hadamard_seed, **kwargs, **usage)
            assert_same(got, want, f"{usage} seed {hadamard_seed}")
            assert (got.columnwise_amax is None) == (not usage["columnwise"])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_reads_non_contiguous_views(backend, dtype):
    base = adversarial((192, 320), dtype, seed=5)
    views = [base.t(), base[::2, 32:288], base.reshape(12, 16, 320).transpose(0, 1), base[:, ::2]]
    for view in views:
        got = quant_core.quantize_nvfp4(view, rowwise=True, columnwise=True, hadamard_seed=3)
        assert_same(
            got, quant_core.quantize_nvfp4_reference(view, columnwise=True, hadamard_seed=3), str(view.stride())
        )


def test_quantize_of_special_values_equals_reference(backend):
    # Runs of zeros, subnormals, a run holding +-Inf and NaN (its transform is non-finite
    # everywhere), huge values whose transform overflows fp32, values at E2M1 ties.
    x = torch.zeros(64, 32)
    x[16:32, 0] = 1e-40
    x[16:32, 1] = -1e-42
    x[32, 2], x[33, 2], x[34, 3] = INF, NAN, -INF
    x[48:64, 4] = 3e38  # 16 * 3e38 / 4 > the largest fp32: the transform overflows to +-Inf
    x[48:64, 5] = torch.tensor(SIGNS_0) * 0.25
    x[0:16, 6] = torch.arange(16.0) - 7.5
    for dtype in FLOAT_DTYPES:
        for stochastic in (False, True):
            kwargs = dict(columnwise=True, hadamard_seed=0, stochastic_rounding=stochastic, seed=4)
            xd = x.to(dtype)
            assert_same(quant_core.quantize_nvfp4(xd, **kwargs), quant_core.quantize_nvfp4_reference(xd, **kwargs))
    zeros = quant_core.quantize_nvfp4(torch.zeros(32, 16), columnwise=True, hadamard_seed=0)
    assert zeros.columnwise_amax.item() == 0.0
    assert not zeros.columnwise_data.any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hadamard_amaxes_equals_reference(backend, dtype):
    # Any M: partial last runs (1, 7, 34 rows) are zero-padded.
    shapes = [(1, 16), (7, 3), (34, 50), (130, 258), (4, 6, 40), (1000, 64)]
    for shape in shapes:
        x = adversarial(shape, dtype, seed=sum(shape))
        views = [x] if x.dim() != 2 else [x, x.t(), x[::2, ::3]]
        for view in views:
            for seed in (0, 2**63 + 1):
                got = quant_core.hadamard_amaxes(view, seed)
                want = quant_core.hadamard_amaxes_reference(view, seed)
                assert torch.equal(bitwise(got), bitwise(want)), (shape, view.stride(), seed)
    x = adversarial((64, 32), dtype, seed=1)
    assert quant_core.hadamard_amaxes(x, 0)[0].item() == quant_core.amax(x).item()


def test_given_amaxes_are_used(backend):
    # Shards quantize with the whole tensor's amaxes (all-reduced), larger than their own.
    x = adversarial((64, 96), torch.bfloat16, seed=9)
    kwargs = dict(columnwise=True, hadamard_seed=5, global_amax=torch.tensor(1e31), columnwise_amax=torch.tensor(3e30))
    got = quant_core.quantize_nvfp4(x, **kwargs)
    assert_same(got, quant_core.quantize_nvfp4_reference(x, **kwargs))
    assert got.columnwise_amax.item() == torch.tensor(3e30).item()
    own = quant_core.quantize_nvfp4(x, columnwise=True, hadamard_seed=5)
    assert not torch.equal(got.columnwise_scale_inv.view(torch.uint8), own.columnwise_scale_inv.view(torch.uint8))
    # A given global amax alone: the columnwise one is still x's own.
    half = quant_core.quantize_nvfp4(x, columnwise=True, hadamard_seed=5, global_amax=torch.tensor(1e31))
    assert half.columnwise_amax.item() == own.columnwise_amax.item()


def test_quantize_refills_out_in_place(backend):
    first = quant_core.quantize_nvfp4(adversarial((64, 256), seed=1), rowwise=True, columnwise=True, hadamard_seed=2)
    x = adversarial((64, 256), torch.bfloat16, seed=2)
    result = quant_core.quantize_nvfp4(x, rowwise=True, columnwise=True, hadamard_seed=2, out=first)
    for field in FIELDS[:4]:
        assert getattr(result, field) is getattr(first, field), field
    assert_same(result, quant_core.quantize_nvfp4_reference(x, columnwise=True, hadamard_seed=2))


def test_transform_changes_only_the_columnwise_usage():
    x = adversarial((64, 128), torch.bfloat16, seed=4)
    plain = quant_core.quantize_nvfp4(x, rowwise=True, columnwise=True)
    transformed = quant_core.quantize_nvfp4(x, rowwise=True, columnwise=True, hadamard_seed=1)
    assert_same(
        dataclasses.replace(transformed, columnwise_data=None, columnwise_scale_inv=None, columnwise_amax=None),
        dataclasses.replace(plain, columnwise_data=None, columnwise_scale_inv=None),
    )
    assert not torch.equal(transformed.columnwise_data, plain.columnwise_data)
    assert plain.columnwise_amax is None


# ---- what the transform is for: the wgrad product, and the round trip ---------------------------


def _columnwise_values(q: quant_core.BlockQuantized) -> torch.Tensor:
    amax = q.amax if q.columnwise_amax is None else q.columnwise_amax
    return quant_core.dequantize_nvfp4(q.columnwise_data, q.columnwise_scale_inv, amax)


def test_transformed_operands_keep_the_wgrad_product():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=generator)
    dy = torch.randn(512, 128, generator=generator)
    # Outliers along M, which the transform spreads over their runs of 16.
    x[::97] *= 30.0
    exact = dy.t() @ x
    errors = {}
    for seed in (None, 11):
        qx = quant_core.quantize_nvfp4(x, rowwise=False, columnwise=True, hadamard_seed=seed)
        qdy = quant_core.quantize_nvfp4(dy, rowwise=False, columnwise=True, hadamard_seed=seed)
        dw = _columnwise_values(qdy) @ _columnwise_values(qx).t()
        errors[seed] = float((dw - exact).norm() / exact.norm())
    # NVFP4's relative L2 error on Gaussian operands is ~0.1 per operand (test_block_formats.py
    # bounds one at 0.12): the product of two stays below 0.2 with or without the transform.
    assert errors[None] < 0.2, errors
    assert errors[11] < 0.2, errors
    # Transformed operands without the inverse are not x^T: mixing seeds breaks the product.
    qx = quant_core.quantize_nvfp4(x, rowwise=False, columnwise=True, hadamard_seed=11)
    qdy = quant_core.quantize_nvfp4(dy, rowwise=False, columnwise=True, hadamard_seed=12)
    mixed = _columnwise_values(qdy) @ _columnwise_values(qx).t()
    assert float((mixed - exact).norm() / exact.norm()) > 0.5


def test_inverse_of_the_dequantized_columnwise_usage_approximates_x_transposed():
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    q = quant_core.quantize_nvfp4(x, rowwise=False, columnwise=True, hadamard_seed=3)
    restored = quant_core.hadamard_inverse_16(_columnwise_values(q), 3)
    error = float((restored - x.t()).norm() / x.norm())
    assert error < 0.12, error  # test_block_formats.py's NVFP4 round-trip bound


# ---- refusals ---------------------------------------------------------------------------------


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"M must be a multiple of 16; got M=24 .*Pad the tokens"):
        quant_core.quantize_nvfp4(torch.ones(24, 32), columnwise=True, hadamard_seed=0)
    with pytest.raises(ValueError, match=r"M must be a multiple of 16; got M=24"):
        quant_core.quantize_nvfp4_reference(torch.ones(24, 32), columnwise=True, hadamard_seed=0)
    with pytest.raises(ValueError, match=r"16 x 16 tiles \(weights\) take their columnwise usage by a lossless"):
        quant_core.quantize_nvfp4(torch.ones(32, 32), (16, 16), columnwise=True, hadamard_seed=0)
    with pytest.raises(ValueError, match="pass hadamard_seed too"):
        quant_core.quantize_nvfp4(torch.ones(32, 32), columnwise=True, columnwise_amax=torch.tensor(1.0))
    with pytest.raises(ValueError, match="columnwise_amax must be a one-element float32 tensor"):
        quant_core.quantize_nvfp4(torch.ones(32, 32), columnwise=True, hadamard_seed=0, columnwise_amax=torch.tensor(1))
    # Rowwise alone is never transformed: any M.
    q = quant_core.quantize_nvfp4(torch.ones(24, 32), hadamard_seed=0)
    assert q.columnwise_data is None
    assert q.columnwise_amax is None
