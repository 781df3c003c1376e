"""The Triton scale kernels and the one-operator quantize functions on CUDA equal the CPU
reference bit for bit (the CPU reference is the spec the C++ backend is pinned to). On machines
without a GPU, Triton's CPU interpreter checks the kernels' indexing and NaN logic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import quant_core
from quant_core.testing import FP8_DTYPES, adversarial, adversarial_amaxes, raw_bits

pytest.importorskip("triton")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")

CUDA = torch.device("cuda")
AMAXES = adversarial_amaxes()
STEP_AMAXES = adversarial_amaxes(8, seed=1).tolist()


def assert_bitwise(got: torch.Tensor | None, want: torch.Tensor | None, what: str = "") -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), what
        width = {1: torch.uint8, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.cpu().view(width), want.cpu().view(width)), what


def assert_same(got: quant_core.Float8Quantized, want: quant_core.Float8Quantized) -> None:
    for field in ("rowwise_data", "columnwise_data", "scale", "scale_inv", "amax"):
        assert_bitwise(getattr(got, field), getattr(want, field), field)


# Run in a fresh process: TRITON_INTERPRET is read when kernels are defined. The interpreter
# computes with numpy (IEEE fp32 division), so the results must equal the reference exactly.
_INTERPRETED = """
import torch
from quant_core.fp8 import _triton_scale
from quant_core.fp8._scale import DelayedFp8ScaleArgs, Fp8ScaleArgs, _delayed_scale_reference, _scale_reference
from quant_core.testing import adversarial_amaxes

def bits(t):
    return t.view(torch.int32).tolist()

amaxes = adversarial_amaxes(200)
for fmax, margin, power_2_scales in [(448.0, 0, False), (57344.0, -126, True), (448.0, 127, True)]:
    got = torch.empty_like(amaxes), torch.empty_like(amaxes)
    _triton_scale._fp8_scale(Fp8ScaleArgs(amaxes, fmax, margin, power_2_scales), *got)
    want = _scale_reference(amaxes, fmax, margin, power_2_scales)
    assert list(map(bits, got)) == list(map(bits, want)), (fmax, margin, power_2_scales)
for length, most_recent in [(1, False), (5, True), (17, False)]:
    history = torch.rand(length, generator=torch.Generator().manual_seed(length)) * 100
    expected = history.clone()
    for step, amax in enumerate(adversarial_amaxes(4, seed=1)):
        got = torch.empty(()), torch.empty(())
        algo = "most_recent" if most_recent else "max"
        _triton_scale._delayed_fp8_scale(DelayedFp8ScaleArgs(history, amax.reshape(()), 448.0, 1, True, algo), *got)
        want = _delayed_scale_reference(expected, amax.reshape(()), 448.0, 1, True, most_recent)
        assert list(map(bits, got)) == list(map(bits, want)), (length, step)
        assert bits(history) == bits(expected), (length, step)

# The fused quantize kernels ([Note: fused FP8 quantize on the GPU]) on fp32 input (the
# interpreter's integer FP8 encoding is exact): 2 x 3 programs of the cast with a transpose, 9 of
# the flat rowwise-only cast (partial amaxes of several programs are reduced either way).
from quant_core.fp8 import _triton as _triton_fp8
from quant_core.fp8._quantize import QuantizeFp8Args, QuantizeFp8DelayedArgs
from quant_core import quantize_fp8_delayed_reference, quantize_fp8_reference
from quant_core.testing import adversarial

def quantized(x, fp8_dtype, columnwise):
    rowwise = torch.empty(x.shape, dtype=fp8_dtype)
    transposed = torch.empty(x.shape[::-1], dtype=fp8_dtype) if columnwise else None
    return rowwise, transposed, torch.empty(()), torch.empty(()), torch.empty(())

def check(got, want, what):
    assert bits(got[0].view(torch.uint8)) == bits(want.rowwise_data.view(torch.uint8)), what
    if got[1] is not None:
        assert bits(got[1].view(torch.uint8)) == bits(want.columnwise_data.view(torch.uint8)), what
    assert bits(got[2]) == bits(want.scale_inv) and bits(got[3]) == bits(want.scale), what

for shape, columnwise in [((100, 700), True), ((9, 2000), False)]:
    for fp8_dtype, power_2_scales in [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True)]:
        x = adversarial(shape, seed=shape[0]) * 7.0
        for amax in (None, torch.tensor(3e3)):
            got = quantized(x, fp8_dtype, columnwise)
            _triton_fp8._quantize_fp8(QuantizeFp8Args(x, amax, fp8_dtype, power_2_scales, got[0], got[1], *got[2:]))
            want = quantize_fp8_reference(x, fp8_dtype, power_2_scales=power_2_scales, columnwise=columnwise, amax=amax)
            check(got, want, (shape, fp8_dtype, amax))
            assert amax is not None or bits(got[4]) == bits(want.amax), shape
        history, expected = torch.zeros(5), torch.zeros(5)
        for step in range(3):
            x = adversarial(shape, seed=step) * 10.0**step
            amax = torch.tensor(2e5) if step == 1 else None
            got = quantized(x, fp8_dtype, columnwise)
            options = dict(margin=1, power_2_scales=power_2_scales, amax_compute_algo="max")
            _triton_fp8._quantize_fp8_delayed(
                QuantizeFp8DelayedArgs(x, amax, history, fp8_dtype, 1, power_2_scales, "max", got[0], got[1], *got[2:])
            )
            want = quantize_fp8_delayed_reference(x, expected, fp8_dtype, columnwise=columnwise, amax=amax, **options)
            check(got, want, (shape, fp8_dtype, step))
            assert bits(history) == bits(expected), (shape, step)
            assert amax is not None or bits(got[4]) == bits(want.amax), (shape, step)
"""


@pytest.mark.triton_interpreter(_INTERPRETED)
def test_kernels_equal_the_reference_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("op", ["fp8_scale", "delayed_fp8_scale"])
def test_triton_runs_the_scale_ops(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("margin", [0, 3, -126, 127])
@pytest.mark.parametrize("power_2_scales", [False, True])
def test_fp8_scale_equals_reference(fp8_dtype, margin, power_2_scales):
    kwargs = dict(margin=margin, power_2_scales=power_2_scales)
    for amax in (AMAXES, AMAXES[:1].reshape(()).clone()):  # hundreds of amaxes (several programs), and one
        got = quant_core.fp8_scale(amax.to(CUDA), fp8_dtype, **kwargs)
        want = quant_core.fp8_scale_reference(amax, fp8_dtype, **kwargs)
        for g, w in zip(got, want, strict=True):
            assert_bitwise(g, w)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("history_len", [1, 5, 16, 1024])
@pytest.mark.parametrize("amax_compute_algo", ["max", "most_recent"])
def test_delayed_scale_equals_reference_across_steps(history_len, amax_compute_algo):
    for fp8_dtype, power_2_scales in itertools.product(FP8_DTYPES, (False, True)):
        kwargs = dict(margin=1, power_2_scales=power_2_scales, amax_compute_algo=amax_compute_algo)
        start = torch.rand(history_len, generator=torch.Generator().manual_seed(history_len)) * 100
        history, expected_history = start.to(CUDA), start.clone()
        for step, value in enumerate(STEP_AMAXES):
            got = quant_core.delayed_fp8_scale_(history, torch.tensor(value, device=CUDA), fp8_dtype, **kwargs)
            want = quant_core.delayed_fp8_scale_reference(expected_history, torch.tensor(value), fp8_dtype, **kwargs)
            for g, w in zip(got, want, strict=True):
                assert_bitwise(g, w, f"step {step}")
            assert_bitwise(history, expected_history, f"step {step}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(7,), (129, 257), (5, 3, 41), (1000, 3000)])
def test_quantize_in_one_operator_equals_reference(fp8_dtype, shape):
    x = adversarial(shape, torch.bfloat16, seed=len(shape))
    for amax in (None, torch.tensor(3e3)):
        given = None if amax is None else amax.to(CUDA)
        got = quant_core.quantize_fp8(x.to(CUDA), fp8_dtype, columnwise=True, amax=given)
        assert_same(got, quant_core.quantize_fp8_reference(x, fp8_dtype, columnwise=True, amax=amax))
    history, expected_history = torch.zeros(4, device=CUDA), torch.zeros(4)
    for step in range(4):
        x = adversarial(shape, torch.float32, seed=step) * 10.0**step
        got = quant_core.quantize_fp8_delayed(x.to(CUDA), history, fp8_dtype, margin=1, columnwise=True)
        want = quant_core.quantize_fp8_delayed_reference(x, expected_history, fp8_dtype, margin=1, columnwise=True)
        assert_same(got, want)
        assert_bitwise(history, expected_history, f"step {step}")
        scale_inv, rowwise = torch.empty((), device=CUDA), torch.empty(shape, dtype=fp8_dtype, device=CUDA)
        quant_core.quantize_fp8_into(x.to(CUDA), fp8_dtype, rowwise_out=rowwise, scale_inv_out=scale_inv)
        want = quant_core.quantize_fp8_reference(x, fp8_dtype)
        assert torch.equal(raw_bits(rowwise).cpu(), raw_bits(want.rowwise_data))
        assert_bitwise(scale_inv, want.scale_inv)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("power_2_scales", [False, True])
def test_quantize_of_a_strided_input_equals_reference_across_steps(power_2_scales):
    # A transposed view: the amax and cast kernels read it through its strides, many programs wide.
    history, expected_history = torch.zeros(16, device=CUDA), torch.zeros(16)
    for step in range(3):
        x = (adversarial((3000, 1000), torch.bfloat16, seed=step) * 10.0**step).t()
        for columnwise in (False, True):
            kwargs = dict(power_2_scales=power_2_scales, columnwise=columnwise)
            got = quant_core.quantize_fp8(x.to(CUDA), **kwargs)
            assert_same(got, quant_core.quantize_fp8_reference(x, **kwargs))
        kwargs = dict(power_2_scales=power_2_scales, amax_compute_algo="most_recent", columnwise=True)
        got = quant_core.quantize_fp8_delayed(x.to(CUDA), history, **kwargs)
        assert_same(got, quant_core.quantize_fp8_delayed_reference(x, expected_history, **kwargs))
        assert_bitwise(history, expected_history, f"step {step}")
