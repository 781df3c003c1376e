"""Shared inputs for quant-core tests: adversarial tensors and the backends to compare."""

from __future__ import annotations

import pytest
import torch

import quant_core

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Every backend that loaded here except the reference, which the others are compared against.
KERNEL_BACKENDS = tuple(b for b in quant_core.available_backends() if b != "reference")


def adversarial(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values over 16 decades plus zeros, denormals, +-Inf, NaN and values far above FP8 max."""
    generator = torch.Generator().manual_seed(seed)
    n = 1
    for size in shape:
        n *= size
    magnitudes = torch.logspace(-8, 8, max(n, 1))[torch.randperm(max(n, 1), generator=generator)][:n]
    x = torch.randn(n, generator=generator) * magnitudes
    specials = torch.tensor(
        [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40, -1e-42, 6e-8, 1e30, -3e5, 448.0]
    )
    positions = torch.randperm(n, generator=generator)[: min(n, len(specials))]
    x[positions] = specials[: len(positions)]
    return x.reshape(shape).to(dtype)


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """Raw bytes of an FP8 tensor, for bit-exact comparison (NaN == NaN bitwise)."""
    return None if t is None else t.view(torch.uint8)


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request: pytest.FixtureRequest):
    """Each non-reference backend available here, forced for the duration of the test."""
    with quant_core.use_backend(request.param):
        yield request.param
