"""`dequantize_mxfp8_pair` and `dequantize_nvfp4_pair` ([Note: dequantizing two operands]) give
bit for bit what two single-operand calls give, on every backend (the CPU ones here, Triton's in
the `cuda` tests below and in the interpreter tests of test_triton_blocks_interpreter.py and
test_triton_nvfp4.py), for the operand pairs of every GEMM: either usage, 1 x 16 blocks with
16 x 16 tiles, tensor scale or none, leading dims, an empty operand."""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial, kernel_backends

CPU_BACKENDS = [b for b in kernel_backends() if b != "triton"]


def _mxfp8_operands(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(data, scale_inv) of rowwise 3-D, columnwise, partial blocks and an empty tensor."""
    a = quant_core.quantize_mxfp8(adversarial((2, 33, 70), seed=1).to(device), columnwise=True)
    b = quant_core.quantize_mxfp8(adversarial((40, 96), torch.bfloat16, seed=2).to(device))
    empty = quant_core.quantize_mxfp8(torch.empty(0, 64, device=device))
    return [
        (a.rowwise_data, a.rowwise_scale_inv),
        (a.columnwise_data, a.columnwise_scale_inv),
        (b.rowwise_data, b.rowwise_scale_inv),
        (empty.rowwise_data, empty.rowwise_scale_inv),
    ]


def _nvfp4_operands(device: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int]]]:
    """(data, scale_inv, global_amax or None, block_shape): 1 x 16 blocks of both usages, 16 x 16
    tiles, the block values without a tensor scale, partial tiles, an empty tensor."""
    x = quant_core.quantize_nvfp4(adversarial((34, 50), seed=3).to(device), columnwise=True)
    w = quant_core.quantize_nvfp4(adversarial((3, 20, 64), torch.bfloat16, seed=4).to(device), (16, 16))
    empty = quant_core.quantize_nvfp4(torch.empty(0, 32, device=device))
    return [
        (x.rowwise_data, x.rowwise_scale_inv, x.amax, (1, 16)),
        (x.columnwise_data, x.columnwise_scale_inv, None, (1, 16)),
        (w.rowwise_data, w.rowwise_scale_inv, None, (16, 16)),
        (w.rowwise_data, w.rowwise_scale_inv, w.amax, (16, 16)),
        (empty.rowwise_data, empty.rowwise_scale_inv, None, (1, 16)),
    ]


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got.shape, got.dtype) == (want.shape, want.dtype), what
    width = {4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got.view(width), want.view(width)), what


def check_mxfp8_pairs(device: str) -> None:
    operands = _mxfp8_operands(device)
    for i, a in enumerate(operands):
        for j, b in enumerate(operands):
            for dtype in FLOAT_DTYPES:
                got = quant_core.dequantize_mxfp8_pair(*a, *b, dtype)
                for k, (operand, values) in enumerate(zip((a, b), got, strict=True)):
                    want = quant_core.dequantize_mxfp8(*operand, dtype)
                    _assert_bitwise(values, want, f"operands {i}, {j}, {dtype}: {'ab'[k]}")


def check_nvfp4_pairs(device: str) -> None:
    operands = _nvfp4_operands(device)
    for i, a in enumerate(operands):
        for j, b in enumerate(operands):
            for dtype in FLOAT_DTYPES:
                got = quant_core.dequantize_nvfp4_pair(
                    *a[:3], *b[:3], a_block_shape=a[3], b_block_shape=b[3], dtype=dtype
                )
                for k, (operand, values) in enumerate(zip((a, b), got, strict=True)):
                    want = quant_core.dequantize_nvfp4(*operand, dtype)
                    _assert_bitwise(values, want, f"operands {i}, {j}, {dtype}: {'ab'[k]}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mxfp8_pair_equals_two_calls(backend):
    with quant_core.use_backend(backend):
        check_mxfp8_pairs("cpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nvfp4_pair_equals_two_calls(backend):
    with quant_core.use_backend(backend):
        check_nvfp4_pairs("cpu")


def test_pairs_refuse_bad_operands_naming_the_problem():
    (a_data, a_scale), (b_data, b_scale) = _mxfp8_operands("cpu")[:2]
    with pytest.raises(ValueError, match=r"scale_inv for data of shape \(66, 70\)"):
        quant_core.dequantize_mxfp8_pair(a_data, a_scale, a_data.reshape(66, 70), b_scale)
    with pytest.raises(ValueError, match="MXFP8 data must be a torch.float8_e4m3fn tensor"):
        quant_core.dequantize_mxfp8_pair(a_data, a_scale, b_data.view(torch.uint8), b_scale)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quant_core.dequantize_mxfp8_pair(a_data, a_scale, b_data, b_scale, torch.int32)
    with pytest.raises(ValueError, match="the two operands are on meta and cpu; dequantize them on one device"):
        quant_core.dequantize_mxfp8_pair(a_data.to("meta"), a_scale.to("meta"), b_data, b_scale)
    (x_data, x_scale, x_amax, _), (w_data, w_scale, _, w_shape) = _nvfp4_operands("cpu")[0], _nvfp4_operands("cpu")[2]
    with pytest.raises(ValueError, match=r"in \(1, 16\) blocks"):  # a tiled weight's scales read as 1 x 16 blocks
        quant_core.dequantize_nvfp4_pair(x_data, x_scale, x_amax, w_data, w_scale, None)
    with pytest.raises(ValueError, match="global_amax must be a one-element float32 tensor"):
        quant_core.dequantize_nvfp4_pair(
            x_data, x_scale, x_amax, w_data, w_scale, x_amax.double(), b_block_shape=w_shape
        )
    with pytest.raises(ValueError, match="the two operands are on cpu and meta"):
        quant_core.dequantize_nvfp4_pair(
            x_data, x_scale, x_amax, w_data.to("meta"), w_scale.to("meta"), None, b_block_shape=w_shape
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
def test_triton_pairs_equal_two_calls_and_launch_once():
    check_mxfp8_pairs("cuda")
    check_nvfp4_pairs("cuda")
    a, b = _mxfp8_operands("cuda")[:2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as profile:
        quant_core.dequantize_mxfp8_pair(*a, *b, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = [e.key for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_dequantize_blocks_pair_kernel"]
