"""The Triton kernels of per-tensor FP8 equal the reference bit for bit (CUDA only).

References run on CPU copies of the inputs: the CPU reference is the spec the C++ backend is
pinned to (torch's CUDA `tensor / float` multiplies by a reciprocal, so its reference can differ).
"""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, FP8_DTYPES, adversarial

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
numerics = pytest.importorskip("quant_core.shared._triton_numerics")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]

CUDA = torch.device("cuda")
SHAPES = [(1,), (7,), (3, 33), (129, 257), (5, 3, 41), (300, 520)]
USAGES = [(True, False), (False, True), (True, True)]


def views_of(x: torch.Tensor) -> list[torch.Tensor]:
    """x on the GPU and non-contiguous views of it there: transposed, strided columns, strided rows
    and columns (the reference reads `view.cpu()`)."""
    x = x.to(CUDA)
    if x.dim() != 2:
        return [x]
    return [x, x.t(), x[::3, 1::2]]


def assert_bitwise(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), what
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.cpu().view(width), want.cpu().view(width)), what


@pytest.mark.parametrize("op", ["amax", "cast_to_fp8", "dequantize_fp8", "transpose_bytes"])
def test_triton_runs_every_per_tensor_op(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@triton.jit
def _disagreements_kernel(count_ptr, E4M3: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Counts the fp32 bit patterns whose hardware FP8 code differs from the integer-rounded one,
    and the codes whose hardware decode differs from the integer decode (NaN equal to NaN)."""
    first = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    wrong = tl.zeros((BLOCK,), dtype=tl.int32)
    for step in range(STEPS):
        v = (first + step * BLOCK + tl.arange(0, BLOCK)).to(tl.int32).to(tl.float32, bitcast=True)
        wrong += (numerics.encode_fp8(v, E4M3, True) != numerics.encode_fp8(v, E4M3, False)).to(tl.int32)
    tl.atomic_add(count_ptr, tl.sum(wrong))
    if tl.program_id(0) == 0:
        codes = tl.arange(0, 256).to(tl.uint8)
        hardware, integer = numerics.decode_fp8(codes, E4M3, True), numerics.decode_fp8(codes, E4M3, False)
        same = (hardware.to(tl.int32, bitcast=True) == integer.to(tl.int32, bitcast=True)) | (
            (hardware != hardware) & (integer != integer)
        )
        tl.atomic_add(count_ptr + 1, tl.sum((~same).to(tl.int32)))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_hardware_fp8_casts_equal_integer_rounding_on_every_fp32(fp8_dtype):
    # [Note: Triton FP8 casts]: the hardware path the kernels take agrees with the integer mirror of
    # csrc/common.h (and so with the reference) on all 2^32 inputs and all 256 codes.
    count = torch.zeros(2, dtype=torch.int32, device=CUDA)
    block, steps = 1024, 64
    _disagreements_kernel[(2**32 // (block * steps),)](
        count, E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK=block, STEPS=steps, enable_fp_fusion=False
    )
    assert count.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_amax_equals_reference(dtype):
    for shape in SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape))
        for view in views_of(x):
            assert_bitwise(quant_core.amax(view), quant_core.amax_reference(view.cpu()), f"{shape}")
    big = torch.randn(2048, 4099, dtype=dtype)  # many programs, one atomic each
    big[1234, 17] = -77.0
    assert quant_core.amax(big.to(CUDA)).item() == 77.0


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_equals_reference(fp8_dtype, dtype):
    for shape in SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape) + 1)
        for view, power_2_scales, (rowwise, columnwise) in zip(
            views_of(x) * 3, (False, True) * 6, USAGES * 4, strict=False
        ):
            kwargs = dict(power_2_scales=power_2_scales, rowwise=rowwise, columnwise=columnwise)
            got = quant_core.quantize_fp8(view, fp8_dtype, **kwargs)
            want = quant_core.quantize_fp8_reference(view.cpu(), fp8_dtype, **kwargs)
            for field in ("rowwise_data", "columnwise_data", "scale", "scale_inv", "amax"):
                assert_bitwise(getattr(got, field), getattr(want, field), f"{shape} {kwargs} {field}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_covers_the_fp32_grid_into_given_buffers(fp8_dtype):
    # Every sign/exponent/top-mantissa pattern with low bits around both formats' rounding points.
    high = torch.arange(1 << 17, dtype=torch.int64) << 15
    scale = torch.ones((), device=CUDA)
    for low in (0, 0x3FFF, 0x4000, 0x4001, 0x7FFFF, 0x80000, 0x80001, 0x100000):
        patterns = (high | low) & 0xFFFFFFFF
        x = torch.where(patterns >= 2**31, patterns - 2**32, patterns).to(torch.int32).view(torch.float32)
        x = x.reshape(512, 256)
        rowwise = torch.empty(512, 256, dtype=fp8_dtype, device=CUDA)
        columnwise = torch.empty(256, 512, dtype=fp8_dtype, device=CUDA)
        quant_core.cast_to_fp8(
            x.to(CUDA), scale, fp8_dtype, columnwise=True, rowwise_out=rowwise, columnwise_out=columnwise
        )
        want, want_t = quant_core.cast_to_fp8_reference(x, scale.cpu(), fp8_dtype, columnwise=True)
        assert_bitwise(rowwise, want, hex(low))
        assert_bitwise(columnwise, want_t, hex(low))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_dequantize_equals_reference(fp8_dtype, out_dtype):
    codes = torch.arange(256, dtype=torch.uint8).repeat(41).reshape(41, 256).view(fp8_dtype)
    for scale_inv in (1.0, 3.0e-3, 2.0**-140, 7.5e33):  # exact, rounding, subnormal results, overflow
        scale_inv = torch.tensor(scale_inv)
        got = quant_core.dequantize_fp8(codes.to(CUDA), scale_inv.to(CUDA), out_dtype)
        assert_bitwise(got, quant_core.dequantize_fp8_reference(codes, scale_inv, out_dtype), f"{scale_inv}")


@pytest.mark.parametrize("shape", [(1,), (3, 33), (129, 257), (5, 3, 41), (513, 200)])
def test_transpose_equals_reference(shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for view in views_of(data):
        want = view.cpu().reshape(-1, view.shape[-1]).t().contiguous()
        assert_bitwise(quant_core.transpose_fp8(view), want, f"{shape}")
