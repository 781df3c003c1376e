"""QuantizedTensor's aliasing and view ops, for every recipe and role: detach, alias, clone, deepcopy;
view, reshape, _unsafe_view; split, chunk, split_with_sizes; slice, narrow, as_strided.

Views must share buffers with their source; copies (clone, deepcopy) must not. Values are compared
bitwise (`dequantize()` is exact), on the rowwise and on the columnwise data.
"""

from __future__ import annotations

import copy

import pytest
import torch
from quant_tensors_op_test_helpers import (
    BLOCK_CASE_IDS,
    BLOCK_CASES,
    CASE_IDS,
    CASES,
    EXPECTED_CLASS,
    ONE_D_CASE_IDS,
    ONE_D_CASES,
    PER_TENSOR_CASE_IDS,
    PER_TENSOR_CASES,
    ROW_ALIGNMENT,
    SHAPE_2D,
    SHAPE_3D,
    assert_independent,
    assert_same_values,
    assert_shares_buffers,
    aten,
    columnwise_values,
    present_buffers,
    quantized,
    randn,
    raw,
)

import quant_tensors as qt

pytestmark = pytest.mark.usefixtures("fresh_fallback_warnings")  # every test starts with no fallback warned


# ---- detach, alias, clone, deepcopy ----------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ["detach", "alias"])
def test_detach_and_alias_share_every_buffer(name, role, op):
    _, t = quantized(name, role)
    t.requires_grad_(op == "detach")  # detach also drops requires_grad
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    result = t.detach() if op == "detach" else aten.alias.default(t)
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == torch.bfloat16
    assert result.usages == t.usages == (True, True)
    if op == "detach":
        assert not result.requires_grad
    assert_same_values(result, expected, expected_columnwise)
    for name_, buffer in present_buffers(result).items():
        assert buffer.data_ptr() == getattr(t, name_).data_ptr(), name_
    t.requires_grad_(False)
    assert_shares_buffers(result, t)  # writing the result shows in t ...
    assert_shares_buffers(t, result)  # ... and the other way round


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_clone_copies_every_buffer(name, role):
    _, t = quantized(name, role)
    result = t.clone()
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == torch.bfloat16
    assert result.usages == t.usages
    assert result.quantizer is t.quantizer
    for name_, buffer in present_buffers(t).items():
        assert torch.equal(raw(getattr(result, name_)), raw(buffer)), name_
    assert_same_values(result, t.dequantize(), columnwise_values(t))
    assert_independent(result, t)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_deepcopy_copies_buffers_and_quantizer(name, role):
    _, t = quantized(name, role)
    t.requires_grad_(True)
    result = copy.deepcopy(t)
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == torch.bfloat16
    assert result.requires_grad
    assert result.usages == t.usages
    assert type(result.quantizer) is type(t.quantizer)
    assert result.quantizer is not t.quantizer
    for name_, buffer in present_buffers(t).items():
        assert torch.equal(raw(getattr(result, name_)), raw(buffer)), name_
    t.requires_grad_(False)
    result.requires_grad_(False)
    assert_same_values(result, t.dequantize(), columnwise_values(t))
    assert_independent(result, t)


# ---- view / reshape / _unsafe_view -----------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ["view", "reshape", "_unsafe_view"])
def test_view_and_reshape_keeping_the_last_dim(name, role, op):
    apply = {
        "view": lambda t, shape: t.view(*shape),
        "reshape": lambda t, shape: t.reshape(*shape),
        "_unsafe_view": lambda t, shape: aten._unsafe_view.default(t, list(shape)),
    }[op]
    _, t3 = quantized(name, role, SHAPE_3D)
    expected, expected_columnwise = t3.dequantize(), columnwise_values(t3)
    assert expected.shape == SHAPE_3D

    flat = apply(t3, (256, 256))  # 3-D -> 2-D
    assert type(flat) is EXPECTED_CLASS[name]
    assert flat.shape == (256, 256)
    assert flat.dtype == torch.bfloat16
    assert flat.usages == t3.usages
    assert_same_values(flat, expected.reshape(256, 256), expected_columnwise.reshape(256, 256))

    inferred = apply(t3, (-1, 256))
    assert inferred.shape == (256, 256)
    assert torch.equal(inferred.dequantize(), expected.reshape(256, 256))

    back = apply(flat, SHAPE_3D)  # 2-D -> 3-D
    assert type(back) is EXPECTED_CLASS[name]
    assert back.shape == SHAPE_3D
    assert back.dtype == torch.bfloat16
    assert_same_values(back, expected, expected_columnwise)

    other_leading = apply(t3, (4, 64, 256))
    assert other_leading.shape == (4, 64, 256)
    assert torch.equal(other_leading.dequantize(), expected.reshape(4, 64, 256))

    # A view aliases: writes through either show in the other.
    assert_shares_buffers(flat, t3)
    assert_shares_buffers(t3, back)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_view_of_a_2d_tensor_to_3d(name, role):
    _, t = quantized(name, role)
    result = t.view(2, 128, 384)
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == (2, 128, 384)
    assert result.dtype == torch.bfloat16
    assert_same_values(result, t.dequantize().view(2, 128, 384), columnwise_values(t).view(2, 128, 384))


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    ("source_shape", "target_shape"),
    [(SHAPE_2D, (384, 256)), (SHAPE_2D, (128, 768)), (SHAPE_3D, (2, 128 * 256))],
    ids=["transpose-shape", "wider-last-dim", "merge-last-dims"],
)
@pytest.mark.parametrize("op", ["view", "reshape", "_unsafe_view"])
def test_view_changing_the_last_dim_raises(name, role, source_shape, target_shape, op):
    _, t = quantized(name, role, source_shape)
    apply = {
        "view": lambda: t.view(*target_shape),
        "reshape": lambda: t.reshape(*target_shape),
        "_unsafe_view": lambda: aten._unsafe_view.default(t, list(target_shape)),
    }[op]
    with pytest.raises(NotImplementedError, match="last dim kept"):
        apply()


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("source_shape", [SHAPE_2D, SHAPE_3D], ids=["2d", "3d"])
def test_flat_view_only_views_back(name, role, source_shape):
    # FSDP2 keeps padded_shard.view(-1) for bookkeeping: a flat view over the same buffers.
    _, t = quantized(name, role, source_shape)
    flat = t.view(-1)
    assert type(flat) is type(t)
    assert flat.shape == (t.numel(),)
    assert flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert flat.detach().shape == (t.numel(),)
    assert flat.view(t.numel()).shape == (t.numel(),)
    back = flat.detach().view(*source_shape)
    assert type(back) is type(t)
    assert back.shape == t.shape
    for name_, buffer in t.buffers().items():
        assert (buffer is None) == (getattr(back, name_) is None)
        if buffer is not None:
            assert getattr(back, name_).data_ptr() == buffer.data_ptr()
    assert torch.equal(back.dequantize(), t.dequantize())
    for misuse in (lambda: flat.clone(), lambda: flat.view(4, -1), lambda: flat[:8], lambda: flat.dequantize()):
        with pytest.raises(NotImplementedError, match="flat view"):
            misuse()


# ---- split / chunk / split_with_sizes ---------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("how", ["split-block", "split-128", "chunk-2", "chunk-4"])
def test_split_and_chunk_on_block_boundaries(name, role, how):
    _, t = quantized(name, role)
    block = max(ROW_ALIGNMENT[name], 16)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    if how == "split-block":
        parts, sizes = torch.split(t, block), [block] * (256 // block)
    elif how == "split-128":
        parts, sizes = torch.split(t, 128), [128, 128]
    else:
        n = int(how.split("-")[1])
        if (256 // n) % block:
            n = 256 // block  # 64-row chunks would split 128-row blocks: as many chunks as blocks
        parts, sizes = torch.chunk(t, n), [256 // n] * n
    assert [p.shape[0] for p in parts] == sizes
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        assert type(part) is EXPECTED_CLASS[name]
        assert part.shape == (size, 384)
        assert part.dtype == torch.bfloat16
        assert part.usages == t.usages
        assert_same_values(part, expected[start : start + size], expected_columnwise[start : start + size])
        start += size
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), expected)
    assert torch.equal(torch.cat([columnwise_values(p) for p in parts]), expected_columnwise)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_split_chunks_are_views_of_the_whole(name, role):
    _, t = quantized(name, role)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    first, second = torch.chunk(t, 2)
    second.zero_()  # writes through to the second half of every data buffer of t
    assert not t.dequantize()[128:].any()
    assert not columnwise_values(t)[128:].any()
    assert torch.equal(t.dequantize()[:128], expected[:128])
    assert torch.equal(columnwise_values(t)[:128], expected_columnwise[:128])
    assert torch.equal(first.dequantize(), expected[:128])


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_split_with_sizes_on_block_boundaries(name, role):
    _, t = quantized(name, role)
    block = max(ROW_ALIGNMENT[name], 16)
    sizes = [block, 256 - 2 * block, block] if 2 * block < 256 else [block, 256 - block]
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    for parts in (torch.split(t, sizes), aten.split_with_sizes.default(t, sizes)):
        assert len(parts) == len(sizes)
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            assert type(part) is EXPECTED_CLASS[name]
            assert part.shape == (size, 384)
            assert part.dtype == torch.bfloat16
            assert_same_values(part, expected[start : start + size], expected_columnwise[start : start + size])
            start += size
        assert torch.equal(torch.cat([p.dequantize() for p in parts]), expected)


@pytest.mark.parametrize(("name", "role"), PER_TENSOR_CASES, ids=PER_TENSOR_CASE_IDS)
@pytest.mark.parametrize("sizes", [[100, 156], [1, 254, 1], [37, 91, 128]], ids=str)
def test_per_tensor_fp8_splits_anywhere(name, role, sizes):
    _, t = quantized(name, role)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    parts = torch.split(t, sizes)
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        assert type(part) is qt.Float8Tensor
        assert part.shape == (size, 384)
        assert_same_values(part, expected[start : start + size], expected_columnwise[start : start + size])
        start += size
    uneven = torch.split(t, 100)
    assert [p.shape[0] for p in uneven] == [100, 100, 56]
    assert torch.equal(torch.cat([p.dequantize() for p in uneven]), expected)
    assert [p.shape[0] for p in torch.chunk(t, 3)] == [86, 86, 84]
    assert torch.equal(torch.cat([p.dequantize() for p in torch.chunk(t, 3)]), expected)


@pytest.mark.parametrize(("name", "role"), ONE_D_CASES, ids=ONE_D_CASE_IDS)
def test_rowwise_only_1d_blocks_split_anywhere(name, role):
    # Without columnwise data, 1 x b blocks lie within single rows: any row is a block boundary.
    quantizer = qt.recipe_from_name(name).quantizer(role).with_usage(columnwise=False)
    t = quantizer.quantize(randn(SHAPE_2D))
    assert t.usages == (True, False)
    expected = t.dequantize()
    parts = torch.split(t, [100, 156])
    assert [type(p) for p in parts] == [EXPECTED_CLASS[name]] * 2
    assert torch.equal(parts[0].dequantize(), expected[:100])
    assert torch.equal(parts[1].dequantize(), expected[100:])


@pytest.mark.parametrize(("name", "role"), BLOCK_CASES, ids=BLOCK_CASE_IDS)
@pytest.mark.parametrize("how", ["split", "split_with_sizes", "chunk-3"])
def test_misaligned_split_raises_naming_the_block_boundary(name, role, how):
    _, t = quantized(name, role)
    alignment = ROW_ALIGNMENT[name]
    boundary = f"{alignment}-row block boundary"
    apply = {
        "split": lambda: torch.split(t, alignment // 2),
        "split_with_sizes": lambda: torch.split(t, [alignment // 2, 256 - alignment // 2]),
        "chunk-3": lambda: torch.chunk(t, 3),  # 86 rows: on no block boundary of any format
    }[how]
    with pytest.raises(ValueError, match=boundary):
        apply()


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dim", [1, -1])
def test_split_along_another_dim_raises(name, role, dim):
    _, t = quantized(name, role)
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        torch.split(t, 128, dim=dim)
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        torch.split(t, [128, 256], dim=dim)
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        torch.chunk(t, 3, dim=dim)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_split_of_a_3d_tensor_along_dim_0(name, role):
    _, t3 = quantized(name, role, SHAPE_3D)
    expected = t3.dequantize()
    parts = torch.split(t3, 1)
    for index, part in enumerate(parts):
        assert type(part) is EXPECTED_CLASS[name]
        assert part.shape == (1, 128, 256)
        assert torch.equal(part.dequantize(), expected[index : index + 1])
    assert torch.equal(t3.narrow(0, 1, 1).dequantize(), expected[1:])


# ---- slice / narrow / as_strided ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("form", ["t[:]", "t[0:256]", "t[:, :]", "aten-dim1"])
def test_full_slice_is_an_alias(name, role, form):
    _, t = quantized(name, role)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    result = {
        "t[:]": lambda: t[:],
        "t[0:256]": lambda: t[0:256],
        "t[:, :]": lambda: t[:, :],
        "aten-dim1": lambda: aten.slice.Tensor(t, 1, 0, 384),
    }[form]()
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == torch.bfloat16
    assert_same_values(result, expected, expected_columnwise)
    for name_, buffer in present_buffers(result).items():
        assert buffer.data_ptr() == getattr(t, name_).data_ptr(), name_
    assert_shares_buffers(result, t)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_narrow_on_block_boundaries(name, role):
    _, t = quantized(name, role)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    alignment = ROW_ALIGNMENT[name]
    starts_lengths = [(128, 128), (0, 128), (alignment, alignment)] if alignment > 1 else [(128, 128), (37, 91)]
    for start, length in starts_lengths:
        result = t.narrow(0, start, length)
        assert type(result) is EXPECTED_CLASS[name]
        assert result.shape == (length, 384)
        assert result.dtype == torch.bfloat16
        assert result.usages == t.usages
        rows = slice(start, start + length)
        assert_same_values(result, expected[rows], expected_columnwise[rows])
    tail = t[128:]  # end = sys.maxsize, clamped
    assert type(tail) is EXPECTED_CLASS[name]
    assert tail.shape == (128, 384)
    assert_same_values(tail, expected[128:], expected_columnwise[128:])


@pytest.mark.parametrize(("name", "role"), BLOCK_CASES, ids=BLOCK_CASE_IDS)
def test_misaligned_narrow_raises_naming_the_block_boundary(name, role):
    _, t = quantized(name, role)
    alignment = ROW_ALIGNMENT[name]
    with pytest.raises(ValueError, match=f"{alignment}-row block boundary"):
        t.narrow(0, alignment // 2, alignment)
    with pytest.raises(ValueError, match=f"{alignment}-row block boundary"):
        t[: alignment + alignment // 2]


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_other_slices_raise(name, role):
    _, t = quantized(name, role)
    with pytest.raises(NotImplementedError, match="step 2"):
        t[::2]
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        t[:, :128]
    with pytest.raises(NotImplementedError, match="dim 0 only"):
        t.narrow(1, 0, 128)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_as_strided_no_op_is_an_alias(name, role):
    _, t = quantized(name, role)
    expected, expected_columnwise = t.dequantize(), columnwise_values(t)
    result = t.as_strided(t.shape, t.stride())
    assert type(result) is EXPECTED_CLASS[name]
    assert result.shape == SHAPE_2D
    assert result.dtype == torch.bfloat16
    assert_same_values(result, expected, expected_columnwise)
    assert_shares_buffers(result, t)
    explicit = aten.as_strided.default(t, list(t.shape), list(t.stride()), 0)
    assert type(explicit) is EXPECTED_CLASS[name]
    assert torch.equal(explicit.dequantize(), t.dequantize())


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [((128, 384), (384, 1), 0), ((256, 384), (384, 1), 384), ((256, 384), (1, 256), 0), ((384, 256), (256, 1), 0)],
    ids=["smaller", "offset", "transposed-strides", "other-shape"],
)
def test_as_strided_other_forms_raise(name, role, size, stride, offset):
    _, t = quantized(name, role)
    with pytest.raises(NotImplementedError, match=rf"as_strided of {EXPECTED_CLASS[name].__name__}.*no-op form"):
        t.as_strided(size, stride, offset)
