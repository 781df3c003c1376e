"""The Triton kernels of NVFP4 equal the reference bit for bit (CUDA only): quantize (1 x 16 and
16 x 16, stochastic rounding), dequantize, the nibble transpose and the Hadamard transform.

References run on CPU copies of the inputs (see test_triton_fp8.py for why).
"""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]

CUDA = torch.device("cuda")
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")
USAGES = [
    dict(rowwise=True, columnwise=False),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True),
]
# (M, K) views with even dims (codes pack in pairs along both): partial edge blocks, 3-D, several tiles.
SHAPES = [(2, 16), (34, 50), (130, 258), (4, 6, 160), (256, 384)]


def views_of(x: torch.Tensor) -> list[torch.Tensor]:
    """x on the GPU and non-contiguous views of it there with an even last dim."""
    x = x.to(CUDA)
    if x.dim() != 2:
        return [x]
    return [x, x.t(), x[::2, ::2][:, : x.shape[1] // 4 * 2]]


def assert_bitwise(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), what
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.cpu().view(width), want.cpu().view(width)), what


@pytest.mark.parametrize("op", ["quantize_nvfp4", "dequantize_nvfp4", "transpose_nvfp4", "hadamard_transform_16"])
def test_triton_runs_every_nvfp4_op(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
@pytest.mark.parametrize("stochastic_rounding", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_and_dequantize_equal_reference(block_shape, stochastic_rounding, dtype):
    kwargs = dict(block_shape=block_shape, stochastic_rounding=stochastic_rounding, seed=2**63 + 12345)
    for shape in SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape))
        for i, view in enumerate(views_of(x)):
            M = view.numel() // view.shape[-1]
            for usage in USAGES if M % 2 == 0 else USAGES[:1]:
                got = quant_core.quantize_nvfp4(view, **kwargs, **usage)
                want = quant_core.quantize_nvfp4_reference(view.cpu(), **kwargs, **usage)
                for field in FIELDS:
                    assert_bitwise(getattr(got, field), getattr(want, field), f"{shape} view {i} {usage} {field}")
        want = quant_core.quantize_nvfp4_reference(x, **kwargs, rowwise=True, columnwise=True)
        for data, scale_inv in (
            (want.rowwise_data, want.rowwise_scale_inv),
            (want.columnwise_data, want.columnwise_scale_inv),
        ):
            for out_dtype in FLOAT_DTYPES:
                got = quant_core.dequantize_nvfp4(
                    data.to(CUDA), scale_inv.to(CUDA), want.amax.to(CUDA), block_shape, out_dtype
                )
                expected = quant_core.dequantize_nvfp4_reference(data, scale_inv, want.amax, block_shape, out_dtype)
                assert_bitwise(got, expected, f"{shape} {out_dtype}")


def test_stochastic_rounding_takes_the_seed_as_int_or_tensor():
    x = torch.randn(64, 128, device=CUDA)
    by_int = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=7)
    by_tensor = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=torch.tensor(7, device=CUDA))
    other = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=8)
    assert torch.equal(by_int.rowwise_data, by_tensor.rowwise_data)
    assert not torch.equal(by_int.rowwise_data, other.rowwise_data)


def test_given_global_amax_is_used():
    x = adversarial((64, 96), torch.bfloat16, seed=9)
    global_amax = torch.tensor(1.0e6)
    got = quant_core.quantize_nvfp4(x.to(CUDA), global_amax=global_amax.to(CUDA), rowwise=True, columnwise=True)
    want = quant_core.quantize_nvfp4_reference(x, global_amax=global_amax, rowwise=True, columnwise=True)
    for field in FIELDS:
        assert_bitwise(getattr(got, field), getattr(want, field), field)


@pytest.mark.parametrize("shape", [(2, 16), (34, 50), (130, 258), (256, 384)])
def test_transpose_equals_columnwise(shape):
    x = adversarial(shape, torch.bfloat16, seed=sum(shape)).to(CUDA)
    q = quant_core.quantize_nvfp4(x, (16, 16), rowwise=True, columnwise=True)
    data_t, scale_t = quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)
    assert_bitwise(data_t, q.columnwise_data, "data")
    assert_bitwise(scale_t, q.columnwise_scale_inv, "scale_inv")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hadamard_equals_reference(dtype):
    inputs = [
        adversarial(shape, dtype, seed=sum(shape)).to(CUDA) for shape in [(1, 16), (3, 48), (130, 256), (2, 3, 160)]
    ]
    strided = adversarial((260, 256), dtype, seed=1).to(CUDA)
    inputs += [strided[::2], strided[:48].t()]  # row stride 2K; a transposed view (stride_k = 256)
    for x in inputs:
        for seed in (0, 77, -(2**62)):
            got = quant_core.hadamard_transform_16(x, seed=seed)
            want = quant_core.hadamard_transform_16_reference(x.cpu(), seed=seed)
            assert_bitwise(got, want, f"{tuple(x.shape)} {x.stride()} seed {seed}")
