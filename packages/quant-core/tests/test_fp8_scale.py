"""Per-tensor FP8 scales (current, delayed) and the one-operator quantize functions: known answers,
and every backend equal to the reference bit for bit on random and adversarial amaxes."""

from __future__ import annotations

import itertools

import pytest
import torch

import quant_core
from quant_core.testing import FP8_DTYPES, adversarial, adversarial_amaxes, raw_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOAT32_MAX = torch.finfo(torch.float32).max

AMAXES = adversarial_amaxes()
# Amaxes pushed step by step into histories (NaN and Inf included: torch's max propagates NaN).
STEP_AMAXES = adversarial_amaxes(8, seed=1).tolist()


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert torch.equal(got.reshape(-1).view(torch.int32), want.reshape(-1).view(torch.int32)), what


def assert_same(got: quant_core.Float8Quantized, want: quant_core.Float8Quantized) -> None:
    for field in ("rowwise_data", "columnwise_data"):
        g, w = getattr(got, field), getattr(want, field)
        assert (g is None) == (w is None), field
        if g is not None:
            assert (g.dtype, g.shape) == (w.dtype, w.shape), field
            assert torch.equal(raw_bits(g), raw_bits(w)), field
    for field in ("scale", "scale_inv", "amax"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)


# ---- known answers (docs/design.md, 'Numerics') -----------------------------------------------


def test_scale_edge_known_answers():
    amax = torch.tensor([0.0, -1.0, float("nan"), float("inf"), 1e-45, 7.0])
    scale, scale_inv = quant_core.fp8_scale(amax, E4M3, margin=2)
    # 1 unless amax > 0; fmax / Inf = 0 (and 1 / 0 = Inf); a subnormal amax clamps; 448 / 7 / 4 = 16.
    assert scale.tolist() == [1.0, 1.0, 1.0, 0.0, FLOAT32_MAX, 16.0]
    smallest = (torch.tensor(1.0) / FLOAT32_MAX).item()  # subnormal: rounded in fp32
    assert scale_inv.tolist() == [1.0, 1.0, 1.0, float("inf"), smallest, 1 / 16]
    scale, _ = quant_core.fp8_scale(torch.tensor(1.0), E5M2, margin=-3, power_2_scales=True)
    assert scale.item() == 2.0**18  # 57344 * 8 = 1.75 * 2^18, rounded down
    assert scale.shape == ()


def test_delayed_scale_known_answers():
    history = torch.tensor([1.0, 5.0, 3.0])
    scale, scale_inv = quant_core.delayed_fp8_scale_(history, torch.tensor(7.0), E4M3, margin=1)
    # The scale of the history before the push: 448 / max(1, 5, 3) / 2, rounded once per division.
    want = torch.tensor(448.0) / torch.tensor(5.0) / torch.tensor(2.0)
    assert_bitwise(scale, want)
    assert_bitwise(scale_inv, 1 / want)
    assert history.tolist() == [7.0, 1.0, 5.0]  # newest first; the oldest (3) dropped
    scale, _ = quant_core.delayed_fp8_scale_(history, torch.tensor(2.0), E4M3, amax_compute_algo="most_recent")
    assert scale.item() == 64.0  # 448 / 7
    assert history.tolist() == [2.0, 7.0, 1.0]
    one = torch.zeros(1)
    scale, _ = quant_core.delayed_fp8_scale_(one, torch.tensor(4.0), E4M3)
    assert (scale.item(), one.tolist()) == (1.0, [4.0])  # an empty history scales by 1


def test_delayed_quantize_is_the_step_by_step_composition():
    # The semantics the quantizers had as separate ops: scale from the history, push, cast.
    history, expected_history = torch.tensor([2.0, 9.0, 0.5]), torch.tensor([2.0, 9.0, 0.5])
    for step in range(3):
        x = adversarial((20, 30), torch.bfloat16, seed=step)
        q = quant_core.quantize_fp8_delayed(x, history, E5M2, margin=1, columnwise=True)
        scale, scale_inv = quant_core.fp8_scale(quant_core.amax_from_history(expected_history), E5M2, margin=1)
        quant_core.push_amax_(expected_history, quant_core.amax(x))
        rowwise, columnwise = quant_core.cast_to_fp8(x, scale, E5M2, columnwise=True)
        assert_same(q, quant_core.Float8Quantized(rowwise, columnwise, scale, scale_inv, quant_core.amax(x)))
        assert_bitwise(history, expected_history)


# ---- every backend equals the reference ----------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(("margin", "power_2_scales"), [(0, False), (0, True), (3, False), (-126, True), (127, False)])
def test_fp8_scale_equals_reference(backend, fp8_dtype, margin, power_2_scales):
    kwargs = dict(margin=margin, power_2_scales=power_2_scales)
    for amax in (AMAXES, AMAXES.reshape(4, -1).t(), AMAXES[:1].reshape(()).clone(), AMAXES.bfloat16()):
        got = quant_core.fp8_scale(amax, fp8_dtype, **kwargs)
        want = quant_core.fp8_scale_reference(amax, fp8_dtype, **kwargs)
        for g, w in zip(got, want, strict=True):
            assert_bitwise(g, w, str(amax.shape))


@pytest.mark.parametrize("history_len", [1, 4, 16])
@pytest.mark.parametrize("amax_compute_algo", ["max", "most_recent"])
def test_delayed_scale_equals_reference_across_steps(backend, history_len, amax_compute_algo):
    for fp8_dtype, margin, power_2_scales in itertools.product(FP8_DTYPES, (0, 2), (False, True)):
        kwargs = dict(margin=margin, power_2_scales=power_2_scales, amax_compute_algo=amax_compute_algo)
        history, expected_history = torch.zeros(history_len), torch.zeros(history_len)
        for step, value in enumerate(STEP_AMAXES):
            amax = torch.tensor(value)
            got = quant_core.delayed_fp8_scale_(history, amax, fp8_dtype, **kwargs)
            want = quant_core.delayed_fp8_scale_reference(expected_history, amax, fp8_dtype, **kwargs)
            for g, w in zip(got, want, strict=True):
                assert_bitwise(g, w, f"step {step}")
            assert_bitwise(history, expected_history, f"step {step}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(70, 90), (3, 5, 40), (0, 8)])
def test_quantize_with_a_given_amax_and_into_buffers_equals_reference(backend, fp8_dtype, shape):
    x = adversarial(shape, torch.bfloat16, seed=4)
    M, K = (x.numel() // shape[-1], shape[-1])
    for amax, power_2_scales in ((None, False), (torch.tensor([1e4]), True), (torch.tensor(0.0), False)):
        kwargs = dict(power_2_scales=power_2_scales, amax=amax)
        want = quant_core.quantize_fp8_reference(x, fp8_dtype, columnwise=True, **kwargs)
        assert_same(quant_core.quantize_fp8(x, fp8_dtype, columnwise=True, **kwargs), want)
        rowwise, columnwise, scale_inv = (
            torch.full(shape, 0xA5, dtype=torch.uint8).view(fp8_dtype),
            torch.full((K, M), 0xA5, dtype=torch.uint8).view(fp8_dtype),
            torch.full((), -1.0),
        )
        quant_core.quantize_fp8_into(
            x, fp8_dtype, rowwise_out=rowwise, columnwise_out=columnwise, scale_inv_out=scale_inv, **kwargs
        )
        assert torch.equal(raw_bits(rowwise), raw_bits(want.rowwise_data))
        assert torch.equal(raw_bits(columnwise), raw_bits(want.columnwise_data))
        assert_bitwise(scale_inv, want.scale_inv)


@pytest.mark.parametrize("amax_compute_algo", ["max", "most_recent"])
def test_quantize_delayed_equals_reference_across_steps(backend, amax_compute_algo):
    kwargs = dict(margin=1, power_2_scales=amax_compute_algo == "max", amax_compute_algo=amax_compute_algo)
    history, expected_history = torch.zeros(4), torch.zeros(4)
    into_history = torch.zeros(4)
    usages = itertools.cycle([(True, False), (False, True), (True, True)])
    for step, fp8_dtype in zip(range(6), itertools.cycle(FP8_DTYPES), strict=False):
        x = adversarial((33, 40), torch.float32, seed=step) * 10.0 ** (step - 3)
        amax = torch.tensor(50.0) if step == 4 else None  # a step with an amax agreed elsewhere
        rowwise, columnwise = next(usages)
        got = quant_core.quantize_fp8_delayed(
            x, history, fp8_dtype, rowwise=rowwise, columnwise=columnwise, amax=amax, **kwargs
        )
        want = quant_core.quantize_fp8_delayed_reference(
            x, expected_history, fp8_dtype, rowwise=rowwise, columnwise=columnwise, amax=amax, **kwargs
        )
        assert_same(got, want)
        assert_bitwise(history, expected_history, f"step {step}")
        scale_inv = torch.empty(())
        rowwise_out = torch.empty(33, 40, dtype=fp8_dtype)
        quant_core.quantize_fp8_delayed_into(
            x, into_history, fp8_dtype, rowwise_out=rowwise_out, scale_inv_out=scale_inv, amax=amax, **kwargs
        )
        assert torch.equal(
            raw_bits(rowwise_out), raw_bits(quant_core.cast_to_fp8_reference(x, want.scale, fp8_dtype)[0])
        )
        assert_bitwise(scale_inv, want.scale_inv)
        assert_bitwise(into_history, expected_history)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [128, -127, 1.0, True])
def test_margin_outside_the_exact_range_raises(margin):
    with pytest.raises(ValueError, match=r"margin must be an int in \[-126, 127\]"):
        quant_core.fp8_scale(torch.tensor(1.0), E4M3, margin=margin)
    with pytest.raises(ValueError, match="margin must be an int"):
        quant_core.delayed_fp8_scale_(torch.zeros(3), torch.tensor(1.0), E4M3, margin=margin)


@pytest.mark.parametrize(
    ("history", "match"),
    [
        (torch.zeros(2, 2), "non-empty 1-D float32"),
        (torch.zeros(0), "non-empty 1-D float32"),
        (torch.zeros(3, dtype=torch.float64), "non-empty 1-D float32"),
        (torch.zeros(6)[::2], "must be contiguous"),
    ],
)
def test_bad_history_raises_and_changes_nothing(history, match):
    before = history.clone()
    with pytest.raises(ValueError, match=match):
        quant_core.quantize_fp8_delayed(torch.ones(4, 4), history)
    with pytest.raises(ValueError, match=match):
        quant_core.delayed_fp8_scale_(history, torch.tensor(1.0), E4M3)
    assert torch.equal(history, before)


def test_bad_delayed_arguments_raise():
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        quant_core.quantize_fp8_delayed(torch.ones(4, 4), torch.zeros(3), amax_compute_algo="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="amax must be a one-element float32"):
        quant_core.delayed_fp8_scale_(torch.zeros(3), torch.ones(2), E4M3)


def test_bad_into_arguments_raise():
    x = torch.ones(4, 6)
    with pytest.raises(ValueError, match="at least one code buffer"):
        quant_core.quantize_fp8_into(x, E4M3, scale_inv_out=torch.empty(()))
    with pytest.raises(ValueError, match="scale_inv_out must be a one-element float32"):
        quant_core.quantize_fp8_into(x, E4M3, rowwise_out=torch.empty(4, 6, dtype=E4M3), scale_inv_out=torch.empty(2))
    with pytest.raises(ValueError, match=r"columnwise_out must be a .* shape \(6, 4\)"):
        quant_core.quantize_fp8_into(
            x, E4M3, columnwise_out=torch.empty(4, 6, dtype=E4M3), scale_inv_out=torch.empty(())
        )
    with pytest.raises(ValueError, match="amax must be a one-element float32"):
        quant_core.quantize_fp8(x, amax=torch.tensor(1.0, dtype=torch.bfloat16))
