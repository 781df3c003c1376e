"""QuantizedTensor's allocating and copying ops, for every recipe and role: new_zeros, new_empty,
empty_like, zeros_like, zero_; copy_ (quantized and high-precision sources and destinations); _to_copy.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from quant_tensors_op_test_helpers import (
    CASE_IDS,
    CASES,
    EXPECTED_CLASS,
    SHAPE_2D,
    assert_independent,
    assert_same_values,
    aten,
    columnwise_values,
    present_buffers,
    quantized,
    randn,
    raw,
)

import quant_tensors as qt

pytestmark = pytest.mark.usefixtures("fresh_fallback_warnings")  # every test starts with no fallback warned


# ---- new_zeros / new_empty / empty_like / zeros_like / zero_ ----------------------------------


def assert_all_zero_like(result, t, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == shape
    assert result.dtype == dtype
    assert result.usages == t.usages
    assert torch.equal(result.dequantize(), torch.zeros(shape, dtype=dtype))
    assert torch.equal(columnwise_values(result), torch.zeros(shape, dtype=dtype))
    # The layout follows t's: same buffer dtypes and, for the same shape, the same buffer shapes.
    for name_, buffer in present_buffers(result).items():
        assert buffer.dtype == getattr(t, name_).dtype, name_
        if shape == tuple(t.shape):
            assert buffer.shape == getattr(t, name_).shape, name_


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ["new_zeros", "new_empty"])
@pytest.mark.parametrize("shape", [SHAPE_2D, (128, 384), (2, 128, 384)], ids=str)
def test_new_zeros_and_new_empty(name, role, op, shape):
    _, t = quantized(name, role)
    before = t.dequantize()
    result = getattr(t, op)(shape)
    assert_all_zero_like(result, t, name, shape, torch.bfloat16)
    as_fp32 = getattr(t, op)(shape, dtype=torch.float32, device="cpu")
    assert_all_zero_like(as_fp32, t, name, shape, torch.float32)
    assert torch.equal(t.dequantize(), before)  # t itself untouched


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", [torch.empty_like, torch.zeros_like], ids=["empty_like", "zeros_like"])
def test_empty_like_and_zeros_like(name, role, op):
    _, t = quantized(name, role)
    before, before_columnwise = t.dequantize(), columnwise_values(t)
    result = op(t)
    assert_all_zero_like(result, t, name, SHAPE_2D, torch.bfloat16)
    assert_all_zero_like(op(t, dtype=torch.float32), t, name, SHAPE_2D, torch.float32)
    # A new tensor: writing it leaves t alone.
    result.copy_(randn(SHAPE_2D, seed=5))
    assert result.dequantize().any()
    assert torch.equal(t.dequantize(), before)
    assert torch.equal(columnwise_values(t), before_columnwise)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_zero_in_place(name, role):
    _, t = quantized(name, role)
    buffers = present_buffers(t)
    assert t.dequantize().any()
    result = t.zero_()
    assert result is t
    assert type(t) is EXPECTED_CLASS[name]
    assert t.shape == SHAPE_2D
    assert t.dtype == torch.bfloat16
    assert t.usages == (True, True)
    assert torch.equal(t.dequantize(), torch.zeros(SHAPE_2D, dtype=torch.bfloat16))
    assert torch.equal(columnwise_values(t), torch.zeros(SHAPE_2D, dtype=torch.bfloat16))
    for name_, buffer in present_buffers(t).items():
        assert buffer is buffers[name_], name_


# ---- copy_ ------------------------------------------------------------------------------------


def assert_copied_in_place(dst, src, name: str, *, expected) -> None:
    """dst.copy_(src) returns dst, keeps its type, shape, dtype and buffer objects, and leaves
    each buffer holding `expected`'s bytes."""
    buffers = present_buffers(dst)
    result = dst.copy_(src)
    assert result is dst
    assert type(dst) is EXPECTED_CLASS[name]
    assert dst.shape == SHAPE_2D
    assert dst.dtype == torch.bfloat16
    for name_, buffer in present_buffers(dst).items():
        assert buffer is buffers[name_], name_  # the same buffer objects, rewritten
        assert torch.equal(raw(buffer), raw(getattr(expected, name_))), name_


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_quantized_into_quantized_copies_raw_buffers(name, role):
    quantizer, src = quantized(name, role, seed=1)
    dst = quantizer.quantize(randn(SHAPE_2D, seed=2))
    assert not torch.equal(dst.dequantize(), src.dequantize())
    assert_copied_in_place(dst, src, name, expected=src)
    assert_same_values(dst, src.dequantize(), columnwise_values(src))
    assert_independent(src, dst)  # a copy, not an alias


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_quantized_into_a_chunk_writes_the_whole(name, role):
    # Chunks share their tensor's per-tensor state (FP8 scale_inv, NVFP4 global amax), which a raw copy
    # also writes: quantize both with one amax and one quantizer state, as FSDP2's shards are.
    quantizer = qt.recipe_from_name(name).quantizer(role)
    src_quantizer = copy.deepcopy(quantizer)
    x, y = randn(SHAPE_2D, seed=1), randn(SHAPE_2D, seed=2)
    amax = torch.maximum(x.float().abs().max(), y.float().abs().max())
    t, src = quantizer.quantize(x, amax=amax), src_quantizer.quantize(y, amax=amax)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    torch.chunk(t, 2)[1].copy_(torch.chunk(src, 2)[1])
    assert torch.equal(t.dequantize()[:128], expected[:128])
    assert torch.equal(t.dequantize()[128:], src.dequantize()[128:])
    assert torch.equal(columnwise_values(t)[:128], expected_columnwise[:128])
    assert torch.equal(columnwise_values(t)[128:], columnwise_values(src)[128:])


@pytest.mark.parametrize(
    ("dst_case", "src_case"),
    [
        (("fp8", "input"), ("mxfp8", "input")),
        (("mxfp8", "input"), ("fp8-block", "input")),
        (("fp8-block", "weight"), ("fp8-block", "input")),
        (("nvfp4", "weight"), ("nvfp4", "input")),
        (("nvfp4", "input"), ("mxfp8", "input")),
    ],
    ids=["fp8<-mxfp8", "mxfp8<-blockwise", "blockwise-128x128<-1x128", "nvfp4-16x16<-1x16", "nvfp4<-mxfp8"],
)
def test_copy_between_formats_raises(dst_case, src_case):
    _, dst = quantized(*dst_case, seed=1)
    _, src = quantized(*src_case, seed=2)
    before = {name: raw(b).clone() for name, b in present_buffers(dst).items()}
    with pytest.raises(ValueError, match="copy_"):
        dst.copy_(src)
    for name, buffer in present_buffers(dst).items():
        assert torch.equal(raw(buffer), before[name]), name  # nothing written


@pytest.mark.parametrize("name", ["fp8", "fp8-delayed", "fp8-block"])
def test_copy_between_e4m3_and_e5m2_raises(name):
    _, dst = quantized(name, "input", seed=1)  # E4M3 ("hybrid")
    _, src = quantized(name, "grad_output", seed=2)  # E5M2
    assert dst.rowwise_data.dtype == torch.float8_e4m3fn
    assert src.rowwise_data.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="copy_"):
        dst.copy_(src)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_quantized_of_another_shape_raises(name, role):
    quantizer, dst = quantized(name, role)
    src = quantizer.quantize(randn((128, 384), seed=2))
    with pytest.raises(ValueError, match="same format and shape"):
        dst.copy_(src)
    with pytest.raises(ValueError, match="same format and shape"):
        src.copy_(dst)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_quantized_from_a_source_missing_a_usage_raises(name, role):
    quantizer, dst = quantized(name, role)
    src = quantizer.with_usage(columnwise=False).quantize(randn(SHAPE_2D, seed=2))
    assert src.usages == (True, False)
    with pytest.raises(ValueError, match="columnwise_data"):
        dst.copy_(src)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_copy_high_precision_into_quantized_requantizes_in_place(name, role, src_dtype):
    quantizer, dst = quantized(name, role)
    src = randn(SHAPE_2D, seed=3, dtype=src_dtype)
    expected = copy.deepcopy(quantizer).quantize(src)  # the quantizer's state now (delayed history, SR calls)
    assert_copied_in_place(dst, src, name, expected=expected)
    assert torch.equal(dst.dequantize(), expected.dequantize(torch.bfloat16))
    assert torch.equal(columnwise_values(dst), columnwise_values(expected).to(torch.bfloat16))


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_high_precision_into_quantized_without_quantizer_raises(name, role):
    _, t = quantized(name, role)
    orphan = type(t)(t.shape, t.dtype, **t.buffers(), **{**t.metadata(), "quantizer": None})
    with pytest.raises(ValueError, match="without a quantizer"):
        orphan.copy_(randn(SHAPE_2D, seed=3))


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_copy_quantized_into_high_precision_dequantizes(name, role, dst_dtype):
    _, src = quantized(name, role)
    dst = torch.full(SHAPE_2D, float("nan"), dtype=dst_dtype)
    result = dst.copy_(src)
    assert result is dst
    assert type(dst) is torch.Tensor
    assert dst.dtype == dst_dtype
    assert torch.equal(dst, src.dequantize(dst_dtype))


# ---- _to_copy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_to_copy_changes_only_the_nominal_dtype(name, role, dtype):
    _, t = quantized(name, role)
    result = t.to(dtype)
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == dtype
    assert t.dtype == torch.bfloat16
    assert result.usages == t.usages
    for name_, buffer in present_buffers(t).items():
        assert torch.equal(raw(getattr(result, name_)), raw(buffer)), name_
    assert torch.equal(result.dequantize(), t.dequantize(dtype))
    assert torch.equal(result.dequantize(torch.bfloat16), t.dequantize())
    assert torch.equal(columnwise_values(result), columnwise_values(t.to(dtype)))


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_to_copy_to_the_cpu(name, role):
    _, t = quantized(name, role)
    for result in (t.to("cpu", copy=True), aten._to_copy.default(t, device=torch.device("cpu"))):
        assert type(result) is EXPECTED_CLASS[name]
        assert result.device == torch.device("cpu")
        assert result.shape == SHAPE_2D
        assert result.dtype == torch.bfloat16
        assert_same_values(result, t.dequantize(), columnwise_values(t))


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_to_copy_does_not_alias_its_source(name, role):
    _, t = quantized(name, role)
    assert_independent(t.to(torch.float32), t)
    assert_independent(t.to("cpu", copy=True), t)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn], ids=str)
def test_to_copy_to_a_non_high_precision_dtype_raises(name, role, dtype):
    _, t = quantized(name, role)
    with pytest.raises(ValueError, match=re.escape(f"cannot convert it to {dtype}")):
        t.to(dtype)
