"""cast_to_fp8_many equals a cast_to_fp8 per tensor bit for bit, on every backend: dtypes mixed,
sizes across the Triton kernel's chunk boundaries, non-contiguous and empty inputs, every scale
kind; its checks. The Triton kernel runs in Triton's CPU interpreter here (fp32 inputs exact there)
and on the GPU in the `cuda` tests."""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def tensors_and_scales(device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs of every dtype and layout with scales of every kind (ordinary, huge, tiny, 1)."""
    xs = [adversarial((n,), FLOAT_DTYPES[n % 3], seed=n) for n in (1, 7, 16383, 16385, 40000)]
    base = adversarial((96, 160), torch.bfloat16, seed=3)
    xs += [base.t(), base[::3, 5::2], torch.empty(0, 4), adversarial((33, 65), torch.float16, seed=4)]
    scales = torch.tensor([3.5, 448.0 / 3e38, 1.0, 2.0**100, 0.75, 1e-3, 448.0, 1.0, 17.0])
    return [x.to(device) for x in xs], scales.to(device)


def one_by_one(xs: list[torch.Tensor], scales: torch.Tensor, fp8_dtype: torch.dtype) -> list[torch.Tensor]:
    return [quant_core.cast_to_fp8(x, s, fp8_dtype)[0] for x, s in zip(xs, scales.unbind(), strict=True)]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)), i


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("backend", quant_core.available_backends("cpu"))
def test_many_equals_one_cast_per_tensor(backend, fp8_dtype):
    xs, scales = tensors_and_scales()
    with quant_core.use_backend(backend):
        outs = [torch.empty(x.shape, dtype=fp8_dtype) for x in xs]
        quant_core.cast_to_fp8_many(xs, scales, fp8_dtype, outs)
        expected = one_by_one(xs, scales, fp8_dtype)
    assert_bitwise(outs, expected)


def test_bad_arguments_are_refused_with_the_fix():
    xs, scales = tensors_and_scales()
    outs = [torch.empty(x.shape, dtype=torch.float8_e4m3fn) for x in xs]
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="one out per x and at least one pair; got 9 xs and 8 outs"):
        quant_core.cast_to_fp8_many(xs, scales, e4m3, outs[:-1])
    with pytest.raises(ValueError, match=r"scales must be an fp32 tensor of shape \(9,\)"):
        quant_core.cast_to_fp8_many(xs, scales[:-1], e4m3, outs)
    with pytest.raises(ValueError, match=r"outs\[2\] must be a contiguous torch.float8_e4m3fn tensor"):
        quant_core.cast_to_fp8_many(xs, scales, e4m3, [*outs[:2], outs[2][::2], *outs[3:]])
    with pytest.raises(ValueError, match=r"outs\[0\] must be a contiguous torch.float8_e5m2 tensor"):
        quant_core.cast_to_fp8_many(xs, scales, torch.float8_e5m2, outs)
    with pytest.raises(ValueError, match=r"xs\[1\] must have at least one dim"):
        quant_core.cast_to_fp8_many([xs[0], torch.tensor(1.0)], scales[:2], e4m3, outs[:2])
    with pytest.raises(TypeError, match="sequences of tensors; for one tensor call cast_to_fp8"):
        quant_core.cast_to_fp8_many(xs[0], scales[:1], e4m3, outs[:1])
    with pytest.raises(TypeError, match=r"xs\[0\] has dtype torch.float64"):
        quant_core.cast_to_fp8_many([xs[0].double()], scales[:1], e4m3, outs[:1])


# Run in a fresh process: TRITON_INTERPRET is read when kernels are defined. fp32 inputs only (the
# interpreter flushes bf16 subnormals when converting them, NOTES.md); sizes around the chunk edges
# and a strided view, both FP8 dtypes.
_INTERPRETED = """
import torch
from quant_core.fp8 import _triton_cast_many as _triton
from quant_core.fp8._cast_many import CastToFp8ManyArgs
from quant_core.fp8._fp8 import cast_to_fp8_reference
from quant_core.testing import adversarial

C = _triton.CHUNK
xs = [adversarial((n,), torch.float32, seed=n) for n in (0, 1, 7, C + 1)]
xs += [adversarial((40, 30), torch.float32, seed=3).t()]
scales = torch.tensor([1.0, 3.5, 448.0 / 3e38, 2.0 ** 100, 0.75])
for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    outs = [torch.empty(x.shape, dtype=fp8_dtype) for x in xs]
    _triton._cast_to_fp8_many(CastToFp8ManyArgs(xs, scales, fp8_dtype, outs))
    for i, (x, s, out) in enumerate(zip(xs, scales, outs)):
        want, _ = cast_to_fp8_reference(x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1), s, fp8_dtype)
        assert out.reshape(-1).view(torch.uint8).tolist() == want.reshape(-1).view(torch.uint8).tolist(), (fp8_dtype, i)
"""


@pytest.mark.triton_interpreter(_INTERPRETED)
def test_kernel_equals_the_reference_in_the_triton_interpreter(triton_interpreter):
    pytest.importorskip("triton")
    triton_interpreter.check()


@pytest.mark.cuda
@needs_cuda
def test_triton_runs_cast_to_fp8_many():
    assert quant_core.selected_backend("cast_to_fp8_many", torch.device("cuda")) == "triton"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_one_launch_equals_one_cast_per_tensor_on_the_gpu(fp8_dtype):
    xs, scales = tensors_and_scales("cuda")
    outs = [torch.empty(x.shape, dtype=fp8_dtype, device="cuda") for x in xs]
    quant_core.cast_to_fp8_many(xs, scales, fp8_dtype, outs)
    assert_bitwise(outs, one_by_one(xs, scales, fp8_dtype))
    with quant_core.use_backend("reference"):
        assert_bitwise(outs, one_by_one(xs, scales, fp8_dtype))
