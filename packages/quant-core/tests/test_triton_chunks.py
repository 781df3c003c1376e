"""The Triton kernels of the FP8 reduce-scatter chunks equal the reference bit for bit (CUDA only).

The Triton backend runs on CUDA tensors, the reference on CPU copies of the same inputs (the CPU
reference is the spec, see test_triton_fp8.py). Layouts cover every block size, several programs
per row with a partial last tile (a program holds 1024 elements), chunks that are not a whole
number of blocks, an empty chunk, and 256 MiB of fp32 over 8 ranks (the size
benchmarks/kernel_speed.py times).
"""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import adversarial

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]

CUDA = torch.device("cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (world_size, chunk, block_size)
LAYOUTS = [(1, 70, 16), (2, 300, 128), (3, 200, 32), (4, 129, 64), (2, 0, 128), (8, 3 * 1024 + 5, 128)]
LARGE = (8, 8 * 1024 * 1024, 128)  # 256 MiB of fp32
ROUNDINGS = [  # (stochastic_rounding, counter, error feedback)
    (False, None, False),
    (True, 7, True),
    (True, None, False),
]


def _quantize_both(x, world_size, block_size, fp8_dtype, stochastic, counter, feedback):
    """(Triton rows, residual), (reference rows, residual) of x; residuals None without feedback."""
    start = adversarial((x.numel(),), seed=3).nan_to_num(0.0, 0.0, 0.0) if feedback else None
    results = []
    for device, backend in ((CUDA, "triton"), (torch.device("cpu"), "reference")):
        residual = None if start is None else start.to(device, copy=True)
        with quant_core.use_backend(backend):
            rows = quant_core.quantize_fp8_chunks(
                x.to(device),
                world_size,
                block_size,
                fp8_dtype,
                stochastic_rounding=stochastic,
                seed=2**63 + 5,
                counter=None if counter is None else torch.tensor(counter, device=device),
                residual=residual,
            )
        results.append((rows.cpu(), None if residual is None else residual.cpu()))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
def test_quantize_equals_the_reference(layout, fp8_dtype, dtype):
    world_size, chunk, block_size = layout
    x = adversarial((world_size * chunk,), dtype, seed=chunk)
    for stochastic, counter, feedback in ROUNDINGS:
        (got, got_residual), (want, want_residual) = _quantize_both(
            x, world_size, block_size, fp8_dtype, stochastic, counter, feedback
        )
        case = (layout, stochastic, feedback)
        assert torch.equal(got, want), case
        if feedback:
            assert torch.equal(got_residual.view(torch.int32), want_residual.view(torch.int32)), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
def test_dequantize_sum_of_random_rows_equals_the_reference(layout, fp8_dtype, dtype):
    # Random bytes: NaN, Inf, subnormal and zero codes and scales.
    world_size, chunk, block_size = layout
    generator = torch.Generator().manual_seed(chunk)
    received = torch.randint(
        0, 256, (world_size, quant_core.chunk_row_bytes(chunk, block_size)), dtype=torch.uint8, generator=generator
    )
    for average in (False, True):
        with quant_core.use_backend("triton"):
            got = quant_core.dequantize_sum_fp8_chunks(
                received.to(CUDA), chunk, block_size, fp8_dtype, average=average, dtype=dtype
            )
        want = quant_core.dequantize_sum_fp8_chunks_reference(
            received, chunk, block_size, fp8_dtype, average=average, dtype=dtype
        )
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (layout, average)


def test_256_mib_of_gradients_round_trip_like_the_reference():
    # The timed size: 8 ranks' chunks of fp32 gradients quantized, then dequantized and summed as
    # rows received (a rank receives rows of this layout, one from each rank).
    world_size, chunk, block_size = LARGE
    x = torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(0)) * 1e-3
    (got, _), (want, _) = _quantize_both(x, world_size, block_size, E4M3, False, None, False)
    assert torch.equal(got, want)
    with quant_core.use_backend("triton"):
        got_sum = quant_core.dequantize_sum_fp8_chunks(want.to(CUDA), chunk, block_size, average=True)
    want_sum = quant_core.dequantize_sum_fp8_chunks_reference(want, chunk, block_size, average=True)
    assert torch.equal(got_sum.cpu().view(torch.int32), want_sum.view(torch.int32))


def test_a_chunk_of_more_tiles_than_a_second_grid_axis_holds_equals_the_reference():
    # A row's tiles run along the grid's first axis: 65536 tiles of 1024 elements and more per
    # chunk (FSDP2 hands one flat input per parameter group, e.g. a large embedding at 2 ranks)
    # would not launch on the second axis, which stops at 65535 programs.
    world_size, chunk, block_size = 2, 65536 * 1024 + 1000, 128
    x = torch.randn(world_size * chunk, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with quant_core.use_backend("triton"):
        got = quant_core.quantize_fp8_chunks(x.to(CUDA), world_size, block_size)
    want = quant_core.quantize_fp8_chunks_reference(x, world_size, block_size)
    assert torch.equal(got.cpu(), want)
    with quant_core.use_backend("triton"):
        got_sum = quant_core.dequantize_sum_fp8_chunks(want.to(CUDA), chunk, block_size, average=True)
    want_sum = quant_core.dequantize_sum_fp8_chunks_reference(want, chunk, block_size, average=True)
    assert torch.equal(got_sum.cpu().view(torch.int32), want_sum.view(torch.int32))
