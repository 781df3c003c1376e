"""The shared reference numerics (quant_core.shared._numerics) against values worked out independently."""

from __future__ import annotations

import pytest
import torch

from quant_core.shared import _numerics
from quant_core.testing import BF16_STOCHASTIC_CASES, float32_from_bits, splitmix64_int


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**63 + 5, 2**64 - 1])
def test_splitmix64_matches_arbitrary_precision_integers(seed):
    indices = [0, 1, 2, 1000, 2**31 + 7, 2**40 + 3]
    got = _numerics.splitmix64(seed, torch.tensor(indices))
    assert [v & (2**64 - 1) for v in got.tolist()] == [splitmix64_int(seed, i) for i in indices]
    # SplitMix64's published first output for seed 0 (state 0x9E3779B97F4A7C15).
    assert splitmix64_int(0, 0) == 0xE220A8397B1DCDAF


def test_random24_is_the_top_24_bits():
    draws = _numerics.random24(42, torch.arange(5))
    assert draws.tolist() == [splitmix64_int(42, i) >> 40 for i in range(5)]
    assert all(0 <= d < 2**24 for d in draws.tolist())


def test_max_exponent_within_known_answers():
    amax = torch.tensor([448.0, 448.00003, 1.0, 224.0, 449.0, 2.0**-140, 3e38, 0.0])
    # s with amax * 2^s <= 448: 0, -1, 8 (256 <= 448 < 512), 1, -1, 148, -120, and 199 for zero.
    assert _numerics.max_exponent_within(amax, 448.0).tolist() == [0, -1, 8, 1, -1, 148, -120, 199]
    assert _numerics.max_exponent_within(torch.tensor([57344.0, 1.0]), 57344.0).tolist() == [0, 15]


def test_power_of_two_is_exact_down_to_the_subnormal_end():
    values = _numerics.power_of_two(torch.tensor([-127, -126, -1, 0, 1, 127])).tolist()
    assert values == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]


@pytest.mark.parametrize(
    ("dtype", "bits", "nan_bits"),
    [
        (torch.float32, torch.int32, 0x7FC00000),
        (torch.bfloat16, torch.int16, 0x7FC0),
        (torch.float16, torch.int16, 0x7E00),
    ],
)
def test_outputs_carry_the_canonical_nan(dtype, bits, nan_bits):
    values = -torch.tensor([float("nan"), 1.0])  # a negative NaN
    out = _numerics.to_output_dtype(values, dtype)
    assert out.view(bits)[0].item() == nan_bits
    assert out[1].item() == -1.0


def test_divide_is_a_single_rounding():
    assert _numerics.divide(448.0, torch.tensor([3.0])).view(torch.int32).item() == 0x43155555


def test_e2m1_decode_inverts_encode_on_the_grid():
    grid = torch.tensor(list(_numerics.E2M1_VALUES) + [-v for v in _numerics.E2M1_VALUES])
    assert torch.equal(_numerics.decode_e2m1(_numerics.encode_e2m1(grid)), grid)


def test_nibbles_pack_even_element_low():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = _numerics.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(_numerics.unpack_nibbles(packed), codes)


def test_random16_is_the_top_16_bits():
    draws = _numerics.random16(-7, torch.arange(5))
    assert draws.tolist() == [splitmix64_int(2**64 - 7, i) >> 48 for i in range(5)]
    counter = torch.tensor(2**63 - 1)  # seed + counter wraps modulo 2^64, as in the kernels
    assert _numerics.random16(counter + 3, torch.arange(2)).tolist() == [
        splitmix64_int(2**63 + 2, i) >> 48 for i in range(2)
    ]


def test_bf16_stochastic_rounding_known_answers():
    columns = zip(*BF16_STOCHASTIC_CASES, strict=True)
    bits, draws, expected = (torch.tensor(column, dtype=torch.int64) for column in columns)
    got = (
        _numerics.round_to_bfloat16_stochastic(float32_from_bits(bits), draws).view(torch.int16).to(torch.int64)
        & 0xFFFF
    )
    assert got.tolist() == expected.tolist()


def test_bf16_stochastic_rounding_is_add_and_truncate_on_every_non_nan():
    generator = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31, (100_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    draws = torch.randint(0, 2**16, (100_000,), generator=generator)
    got = _numerics.round_to_bfloat16_stochastic(v, draws).view(torch.int16).to(torch.int64) & 0xFFFF
    unsigned = bits.to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, torch.where(torch.isnan(v), 0x7FC0, (unsigned + draws) >> 16))


@pytest.mark.parametrize("fraction", [1 / 65536, 0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("base", [1.0, -3.0e-3, 1e-40])  # 1e-40: an fp32 subnormal
def test_bf16_stochastic_rounding_is_unbiased(base, fraction):
    # v between bf16 neighbours lo and hi = lo + ulp (about `fraction` of the way): over n draws
    # of the counter RNG, the mean result is v within 5 standard deviations (ulp * sqrt(f (1 - f)
    # / n)); fixed seed.
    lo = torch.tensor(base, dtype=torch.float32).bfloat16().float()
    ulp = (lo.view(torch.int32) + 0x10000).view(torch.float32) - lo  # towards larger magnitude
    v = lo + ulp * fraction
    n = 200_000
    rounded = _numerics.round_to_bfloat16_stochastic(v.expand(n), _numerics.random16(12345, torch.arange(n)))
    assert set(rounded.float().unique().tolist()) <= {lo.item(), (lo + ulp).item()}
    mean = rounded.double().mean()
    sigma = abs(ulp.double().item()) * (fraction * (1 - fraction) / n) ** 0.5
    assert abs(mean.item() - v.double().item()) <= 5 * sigma
