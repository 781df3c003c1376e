"""The fp8 moments' store on a skipped step whose verdict stayed on the device ([Note: fp8 moments
on a skipped step] in quant_optim._write_back): encoding the decoded codes again with the
reciprocal of their scale_inv gives back every finite code, on every quant-core backend, over the
range of scales fp8_scale makes (its largest, whose scale_inv is subnormal, included)."""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import raw_bits

FLOAT32_MAX = torch.finfo(torch.float32).max


def finite_codes(dtype: torch.dtype) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return codes[codes.float().isfinite()].reshape(1, -1)


def scales_inv(dtype: torch.dtype) -> list[torch.Tensor]:
    """scale_inv of fp8_scale over amaxes from the smallest subnormal float to the largest."""
    amaxes = [torch.tensor(1e-45), torch.tensor(1e-40), torch.tensor(FLOAT32_MAX)]
    amaxes += [torch.tensor(2.0**e * m) for e in range(-140, 128, 7) for m in (1.0, 1.37, 1.9999)]
    amaxes += list(torch.rand(40, generator=torch.Generator().manual_seed(0)) * 3.0)
    return [quant_core.fp8_scale(a, dtype)[1] for a in amaxes]


@pytest.mark.parametrize("backend", quant_core.available_backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decoded_codes_encode_back_to_themselves_with_their_scale(dtype, backend):
    codes = finite_codes(dtype)
    with quant_core.use_backend(backend):
        for scale_inv in scales_inv(dtype):
            values = quant_core.dequantize_fp8(codes, scale_inv)
            scale = torch.reciprocal(scale_inv).clamp_(max=FLOAT32_MAX)
            again, _ = quant_core.cast_to_fp8(values, scale, dtype)
            assert torch.equal(raw_bits(again), raw_bits(codes)), float(scale_inv)
