from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial


def test_reference_known_answers():
    x = torch.tensor([1.0, -3.0, float("nan"), float("inf"), -float("inf"), 2.5])
    assert quant_core.amax_reference(x).item() == 3.0
    assert quant_core.amax_reference(torch.tensor([float("nan"), float("inf")])).item() == 0.0
    assert quant_core.amax_reference(torch.empty(0, 5)).item() == 0.0
    assert quant_core.amax_reference(torch.tensor([-1e-45])).item() == pytest.approx(1.4e-45)
    assert quant_core.amax_reference(torch.tensor(-7.0)).dtype == torch.float32


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (300_001,), (33, 65), (3, 5, 129), (1024, 256), (0,), (0, 4), (4, 0)])
def test_kernel_equals_reference(backend, dtype, shape):
    x = adversarial(shape, dtype, seed=sum(shape))
    out = quant_core.amax(x)
    assert out.dtype == torch.float32
    assert out.shape == ()
    assert torch.equal(out, quant_core.amax_reference(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_kernel_reads_non_contiguous_views(backend, dtype):
    base = adversarial((96, 160), dtype, seed=3)
    for view in (base.t(), base[::3, 5::2], base.reshape(8, 12, 160).transpose(0, 1), base.expand(2, 96, 160)):
        assert torch.equal(quant_core.amax(view), quant_core.amax_reference(view))


def test_kernel_splits_long_rows_across_threads(backend):
    # A single long row and a tall thin matrix both take the element-split path.
    for x in (torch.zeros(1, 2_000_000), torch.zeros(2_000_000, 1)):
        x.view(-1)[1_999_999] = -5.0
        assert quant_core.amax(x).item() == 5.0


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 70),
    dtype=st.sampled_from(FLOAT_DTYPES),
    values=st.lists(st.floats(width=16, allow_nan=True, allow_infinity=True), min_size=1, max_size=64),
)
def test_kernel_equals_reference_on_generated_values(rows, cols, dtype, values):
    x = torch.tensor(values, dtype=torch.float32).repeat(rows * cols // len(values) + 1)[: rows * cols]
    x = x.reshape(rows, cols).to(dtype)
    expected = quant_core.amax_reference(x)
    for backend in quant_core.available_backends():
        with quant_core.use_backend(backend):
            assert torch.equal(quant_core.amax(x), expected), backend


@pytest.mark.parametrize("bad", [torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.complex64)])
def test_non_float_input_raises_type_error(bad):
    with pytest.raises(TypeError, match=r"x has dtype .*quantization reads float32, bfloat16 or float16"):
        quant_core.amax(bad)


def test_float64_input_raises_type_error_with_fix():
    with pytest.raises(TypeError, match=r"x\.float\(\)"):
        quant_core.amax(torch.ones(3, dtype=torch.float64))


def test_meta_input_raises():
    with pytest.raises(ValueError, match="meta device"):
        quant_core.amax(torch.empty(3, device="meta"))


def test_non_tensor_input_raises():
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        quant_core.amax([1.0, 2.0])  # type: ignore[arg-type]


# The bits of fp32 values that `amax_torch_ops` must reproduce: NaN and +-Inf skipped, -0.0 giving
# +0.0, denormals of every dtype kept (6e-8 is an fp16 denormal, 1e-40 an fp32 and bf16 one).
_TORCH_OPS_CASES = [
    [-0.0],
    [-0.0, float("nan"), -float("inf")],
    [float("nan"), -float("nan")],
    [float("inf"), -float("inf"), float("nan")],
    [1e-40, -3e-42, 0.0],
    [6e-8, -6e-8, float("nan")],
    [-5.0, 2.0, float("inf"), -0.0],
    [],
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_torch_ops_equal_reference_bitwise(dtype):
    inputs = [torch.tensor(values).to(dtype) for values in _TORCH_OPS_CASES]
    inputs += [adversarial(shape, dtype, seed=sum(shape)) for shape in [(7,), (33, 65), (3, 5, 129), (0, 4), (4, 0)]]
    for x in inputs:
        got, want = quant_core.amax_torch_ops(x), quant_core.amax_reference(x)
        assert got.dtype == torch.float32, x
        assert got.shape == (), x
        assert got.view(torch.int32) == want.view(torch.int32), (x, got, want)
