"""The shared op table of QuantizedTensor (quant_tensors._op_table), op by op, for every recipe and role.

Each test checks the result's type (the format's subclass, or a plain tensor where that is the
contract), shape, nominal dtype and values: `dequantize()` is exact and deterministic, so values are
compared bitwise, on the rowwise and on the columnwise data. Ops that are views (detach, alias,
view, split, slice) must share buffers with their source; copies (clone, deepcopy) must not.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import quant_tensors as qt

aten = torch.ops.aten

RECIPE_NAMES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CASES = [(name, role) for name in RECIPE_NAMES for role in qt.ROLES]
CASE_IDS = [f"{name}-{role}" for name, role in CASES]

# Class and dim-0 block boundary (rows of the (M, K) view) of each recipe's tensors. The recipes'
# quantizers produce both usages, so 1-D-blocked formats need their columnwise blocks (which run
# along M) whole too: 32 for MXFP8, 128 for blockwise 1x128 and 128x128, 16 for NVFP4 1x16 and 16x16.
EXPECTED_CLASS = {
    "fp8": qt.Float8Tensor,
    "fp8-delayed": qt.Float8Tensor,
    "mxfp8": qt.MXFP8Tensor,
    "fp8-block": qt.Float8BlockwiseTensor,
    "nvfp4": qt.NVFP4Tensor,
}
ROW_ALIGNMENT = {"fp8": 1, "fp8-delayed": 1, "mxfp8": 32, "fp8-block": 128, "nvfp4": 16}
BLOCK_CASES = [case for case in CASES if ROW_ALIGNMENT[case[0]] > 1]
BLOCK_CASE_IDS = [f"{name}-{role}" for name, role in BLOCK_CASES]
PER_TENSOR_CASES = [case for case in CASES if ROW_ALIGNMENT[case[0]] == 1]
PER_TENSOR_CASE_IDS = [f"{name}-{role}" for name, role in PER_TENSOR_CASES]
# Formats whose blocks are 1-D along K: without columnwise data their rows are independent.
ONE_D_CASES = [(name, role) for name, role in BLOCK_CASES if not (role == "weight" and name != "mxfp8")]
ONE_D_CASE_IDS = [f"{name}-{role}" for name, role in ONE_D_CASES]

SHAPE_2D = (256, 384)
SHAPE_3D = (2, 128, 256)


@pytest.fixture(autouse=True)
def fresh_fallback_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-(class, op) fallback warning set is global: start every test from an empty one."""
    monkeypatch.setattr(qt.QuantizedTensor, "_warned_fallbacks", set())


# ---- helpers ---------------------------------------------------------------------------------


def randn(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def quantized(name: str, role: str, shape: tuple[int, ...] = SHAPE_2D, seed: int = 0):
    """(quantizer, quantized tensor of a seeded bf16 input) for a recipe and role."""
    quantizer = qt.recipe_from_name(name).quantizer(role)
    return quantizer, quantizer.quantize(randn(shape, seed))


def columnwise_values(t: qt.QuantizedTensor) -> torch.Tensor:
    """t's values as its columnwise data gives them (an alias of t with rowwise dropped)."""
    alias = aten.alias.default(t)
    alias.update_usage(rowwise=False)
    assert alias.usages == (False, True)
    return alias.dequantize()


def raw(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer's bytes, for bitwise comparisons (works for 0-d and non-contiguous buffers)."""
    return buffer.reshape(-1).contiguous().view(torch.uint8)


def present_buffers(t: qt.QuantizedTensor) -> dict[str, torch.Tensor]:
    return {name: b for name, b in t.buffers().items() if b is not None}


def assert_same_values(result: qt.QuantizedTensor, expected_rowwise: torch.Tensor, expected_columnwise=None) -> None:
    assert torch.equal(result.dequantize(), expected_rowwise)
    if expected_columnwise is not None:
        assert torch.equal(columnwise_values(result), expected_columnwise)


def assert_shares_buffers(written: qt.QuantizedTensor, other: qt.QuantizedTensor) -> None:
    """Requantizes `written` in place from new values; `other` must see all of it (data and scales)."""
    source = randn(tuple(written.shape), seed=99)
    expected = copy.deepcopy(written.quantizer).quantize(source)  # same quantizer state (delayed, SR)
    written.copy_(source)
    assert torch.equal(other.dequantize(), expected.dequantize().reshape(other.shape))
    assert torch.equal(columnwise_values(other), columnwise_values(expected).reshape(other.shape))


def assert_independent(copy_: qt.QuantizedTensor, original: qt.QuantizedTensor) -> None:
    """No buffer of `copy_` is (part of) a buffer of `original`: zeroing the copy leaves it unchanged."""
    before_rowwise, before_columnwise = original.dequantize(), columnwise_values(original)
    original_storages = {b.untyped_storage().data_ptr() for b in present_buffers(original).values()}
    for name, buffer in present_buffers(copy_).items():
        assert buffer.untyped_storage().data_ptr() not in original_storages, name
    copy_.zero_()
    assert not copy_.dequantize().any()
    assert torch.equal(original.dequantize(), before_rowwise)
    assert torch.equal(columnwise_values(original), before_columnwise)


# ---- the table itself ------------------------------------------------------------------------

# Every op of the shared table, and the tests below that exercise it.
COVERED_OPS = {
    aten.detach.default: "test_detach_and_alias_share_every_buffer",
    aten.alias.default: "test_detach_and_alias_share_every_buffer",
    aten.clone.default: "test_clone_copies_every_buffer",
    aten._to_copy.default: "test_to_copy_changes_only_the_nominal_dtype",
    aten.view.default: "test_view_and_reshape_keeping_the_last_dim",
    aten._unsafe_view.default: "test_view_and_reshape_keeping_the_last_dim",
    aten.reshape.default: "test_view_and_reshape_keeping_the_last_dim (decomposes to view)",
    aten.split.Tensor: "test_split_and_chunk_on_block_boundaries",
    aten.split_with_sizes.default: "test_split_with_sizes_on_block_boundaries",
    aten.slice.Tensor: "test_full_slice_is_an_alias, test_narrow_on_block_boundaries",
    aten.as_strided.default: "test_as_strided_no_op_is_an_alias",
    aten.new_zeros.default: "test_new_zeros_and_new_empty",
    aten.new_empty.default: "test_new_zeros_and_new_empty",
    aten.empty_like.default: "test_empty_like_and_zeros_like",
    aten.zeros_like.default: "test_empty_like_and_zeros_like",
    aten.zero_.default: "test_zero_in_place",
    aten.copy_.default: "test_copy_*",
    aten.record_stream.default: "test_record_stream_holds_every_buffer_for_the_stream",
    aten.is_pinned.default: "test_is_pinned_is_false_on_plain_cpu_buffers, test_pin_memory_pins_every_buffer",
    aten._pin_memory.default: "test_pin_memory_pins_every_buffer",
}


def test_every_op_in_the_shared_table_is_covered_here():
    # A new entry in the table needs a test in this file first.
    assert set(qt.QuantizedTensor.__dict__["_ops"]) == set(COVERED_OPS)


def test_formats_have_no_tables_of_their_own():
    # One shared table on the base: the formats plug in layout hooks, not ops.
    for cls in (qt.Float8Tensor, qt.BlockScaledTensor, qt.MXFP8Tensor, qt.Float8BlockwiseTensor, qt.NVFP4Tensor):
        assert "_ops" not in cls.__dict__, cls.__name__


def test_registering_an_op_twice_in_one_class_raises():
    class ScratchTensor(qt.QuantizedTensor):
        pass

    def first(func, args, kwargs):
        return "first"

    def second(func, args, kwargs):
        return "second"

    ScratchTensor.implements(aten.sin.default)(first)
    with pytest.raises(RuntimeError, match=r"aten\.sin\.default is registered twice for ScratchTensor"):
        ScratchTensor.implements(aten.sin.default)(second)
    assert ScratchTensor._handler(aten.sin.default) is first  # the failed registration replaced nothing

    # One table per class: an op of the base table can be overridden in a subclass, and the base
    # table stays untouched.
    base_clone = qt.QuantizedTensor._handler(aten.clone.default)
    ScratchTensor.implements(aten.clone.default)(second)
    assert ScratchTensor._handler(aten.clone.default) is second
    assert qt.QuantizedTensor._handler(aten.clone.default) is base_clone
    assert aten.sin.default not in qt.QuantizedTensor.__dict__["_ops"]
    assert qt.Float8Tensor._handler(aten.sin.default) is None


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


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_copy_quantized_into_quantized_copies_raw_buffers(name, role):
    quantizer, src = quantized(name, role, seed=1)
    dst = quantizer.quantize(randn(SHAPE_2D, seed=2))
    assert not torch.equal(dst.dequantize(), src.dequantize())
    dst_buffers = present_buffers(dst)
    result = dst.copy_(src)
    assert result is dst
    assert type(dst) is EXPECTED_CLASS[name]
    assert dst.shape == SHAPE_2D
    assert dst.dtype == torch.bfloat16
    for name_, buffer in present_buffers(dst).items():
        assert buffer is dst_buffers[name_], name_  # in place
        assert torch.equal(raw(buffer), raw(getattr(src, name_))), name_
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
    buffers = present_buffers(dst)
    result = dst.copy_(src)
    assert result is dst
    assert type(dst) is EXPECTED_CLASS[name]
    assert dst.shape == SHAPE_2D
    assert dst.dtype == torch.bfloat16
    for name_, buffer in present_buffers(dst).items():
        assert buffer is buffers[name_], name_  # the same buffer objects, rewritten
        assert torch.equal(raw(buffer), raw(getattr(expected, name_))), name_
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


# ---- storage, numel, pinning, streams -------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_untyped_storage_is_the_data_buffers(name, role):
    _, t = quantized(name, role)
    storage = t.untyped_storage()
    assert isinstance(storage, torch.UntypedStorage)
    assert storage.data_ptr() == t.rowwise_data.untyped_storage().data_ptr()
    assert storage.nbytes() == t.rowwise_data.untyped_storage().nbytes() == t.rowwise_data.nbytes
    # A view reports the storage of the buffer it shares.
    assert t.view(2, 128, 384).untyped_storage().data_ptr() == storage.data_ptr()
    # Without rowwise data, the columnwise data's storage.
    alias = aten.alias.default(t)
    alias.update_usage(rowwise=False)
    assert alias.untyped_storage().data_ptr() == t.columnwise_data.untyped_storage().data_ptr()
    assert alias.untyped_storage().nbytes() == t.columnwise_data.nbytes


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_numel_counts_logical_elements(name, role):
    _, t = quantized(name, role)
    assert t.numel() == 256 * 384
    _, t3 = quantized(name, role, SHAPE_3D)
    assert t3.numel() == 2 * 128 * 256
    if name == "nvfp4":  # two codes per byte: the data buffer holds half as many elements
        assert t.rowwise_data.numel() == t.numel() // 2


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_is_pinned_is_false_on_plain_cpu_buffers(name, role):
    _, t = quantized(name, role)
    assert t.is_pinned() is False
    assert not any(b.is_pinned() for b in present_buffers(t).values())


@pytest.mark.cuda  # pinning needs an accelerator in recent torch ("Cannot access accelerator device")
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_pin_memory_pins_every_buffer(name, role):
    _, t = quantized(name, role)
    pinned = t.pin_memory()
    assert type(pinned) is EXPECTED_CLASS[name]
    assert pinned.shape == SHAPE_2D
    assert pinned.dtype == torch.bfloat16
    assert pinned.device.type == "cpu"
    assert pinned.is_pinned() is True
    assert t.is_pinned() is False
    assert all(b.is_pinned() for b in present_buffers(pinned).values())
    assert_same_values(pinned, t.dequantize(), columnwise_values(t))
    via_to = aten._to_copy.default(t, pin_memory=True)
    assert type(via_to) is EXPECTED_CLASS[name]
    assert via_to.is_pinned() is True
    assert torch.equal(via_to.dequantize(), t.dequantize())


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_to_copy_between_cpu_and_cuda(name, role):
    _, t = quantized(name, role)
    on_gpu = t.to("cuda")
    assert type(on_gpu) is EXPECTED_CLASS[name]
    assert on_gpu.device.type == "cuda"
    assert on_gpu.shape == SHAPE_2D
    assert on_gpu.dtype == torch.bfloat16
    assert all(b.device.type == "cuda" for b in present_buffers(on_gpu).values())
    for name_, buffer in present_buffers(t).items():
        assert torch.equal(raw(getattr(on_gpu, name_)).cpu(), raw(buffer)), name_
    back = on_gpu.to("cpu")
    assert type(back) is EXPECTED_CLASS[name]
    assert back.device.type == "cpu"
    assert_same_values(back, t.dequantize(), columnwise_values(t))


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_record_stream_holds_every_buffer_for_the_stream(name, role):
    # The caching allocator reuses a freed block at once on its own stream unless another stream
    # recorded a use of it; then only after that stream's queued work is done.
    _, t_cpu = quantized(name, role)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = t_cpu.to("cuda")  # every buffer allocated on the side stream
    side.synchronize()
    pointers = {b.data_ptr() for b in present_buffers(t).values()}
    sizes = [b.untyped_storage().nbytes() for b in present_buffers(t).values()]
    main = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # keeps the main stream busy for a while
    assert t.record_stream(main) is None
    del t
    with torch.cuda.stream(side):
        while_busy = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    assert not pointers & {b.data_ptr() for b in while_busy}, "a buffer was reused while the stream used it"
    del while_busy
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        after = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    assert pointers & {b.data_ptr() for b in after}, "the freed buffers should be reusable once the stream is done"


# ---- ops outside the table ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    ("op_name", "call"),
    [
        ("aten.add.Tensor", lambda t: torch.add(t, t)),
        ("aten.sin.default", lambda t: t.sin()),
        ("aten.mul.Tensor", lambda t: t * 2),
        ("aten.t.default", lambda t: t.t()),
        ("aten.mm.default", lambda t: torch.mm(t, torch.ones(384, 8, dtype=torch.bfloat16))),
        ("aten.unsqueeze.default", lambda t: t.unsqueeze(0)),
    ],
    ids=["add", "sin", "mul", "t", "mm", "unsqueeze"],
)
def test_ops_outside_the_table_raise_naming_op_and_class(name, role, op_name, call):
    _, t = quantized(name, role)
    class_name = EXPECTED_CLASS[name].__name__
    with pytest.raises(NotImplementedError, match=rf"{re.escape(op_name)} is not supported on {class_name}"):
        call(t)


# (id, call, the table entry, the ops the warnings name). torch.isfinite decomposes before dispatch
# into abs and eq, so the warnings name those two rather than its own table entry.
FALLBACK_CASES = [
    ("abs", lambda t: t.abs(), aten.abs.default, {"aten.abs.default"}),
    ("sum", lambda t: torch.sum(t), aten.sum.default, {"aten.sum.default"}),
    ("sum-dim", lambda t: torch.sum(t, dim=0), aten.sum.dim_IntList, {"aten.sum.dim_IntList"}),
    ("mean", lambda t: t.mean(), aten.mean.default, {"aten.mean.default"}),
    ("mean-dim", lambda t: t.mean(dim=1), aten.mean.dim, {"aten.mean.dim"}),
    ("max", lambda t: t.max(), aten.max.default, {"aten.max.default"}),
    ("min", lambda t: t.min(), aten.min.default, {"aten.min.default"}),
    (
        "norm",
        lambda t: torch.linalg.vector_norm(t),
        aten.linalg_vector_norm.default,
        {"aten.linalg_vector_norm.default"},
    ),
    ("isnan", lambda t: torch.isnan(t), aten.isnan.default, {"aten.isnan.default"}),
    ("isfinite", lambda t: torch.isfinite(t), aten.isfinite.default, {"aten.abs.default", "aten.eq.Tensor"}),
    ("eq", lambda t: t == t, aten.eq.Tensor, {"aten.eq.Tensor"}),
    ("allclose", lambda t: torch.allclose(t, t), aten.allclose.default, {"aten.allclose.default"}),
    ("equal", lambda t: torch.equal(t, t), aten.equal.default, {"aten.equal.default"}),
]


def test_fallback_cases_cover_every_fallback_op():
    assert {case[2] for case in FALLBACK_CASES} == set(qt.DEQUANTIZE_FALLBACK_OPS)


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("call", "warned_ops"), [c[1::2] for c in FALLBACK_CASES], ids=[c[0] for c in FALLBACK_CASES])
def test_fallback_ops_dequantize_with_a_one_time_warning(name, role, call, warned_ops):
    _, t = quantized(name, role)
    expected = call(t.dequantize())
    class_name = EXPECTED_CLASS[name].__name__
    with pytest.warns(UserWarning, match=f"not implemented for {class_name}") as record:
        first = call(t)
    warned = {str(w.message).split(" is not implemented")[0] for w in record if issubclass(w.category, UserWarning)}
    assert warned == warned_ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same op on the same class warns only once
        second = call(t)
    for result in (first, second):
        assert not isinstance(result, qt.QuantizedTensor)
        if isinstance(result, torch.Tensor):
            assert type(result) is torch.Tensor
            assert result.dtype == expected.dtype
            assert result.shape == expected.shape
            assert torch.equal(result, expected)
        else:
            assert result == expected


def test_fallback_warning_is_once_per_class_and_op():
    _, fp8 = quantized("fp8", "input")
    _, mxfp8 = quantized("mxfp8", "input")
    with pytest.warns(UserWarning, match=r"aten\.abs\.default is not implemented for Float8Tensor"):
        fp8.abs()
    with pytest.warns(UserWarning, match=r"aten\.abs\.default is not implemented for MXFP8Tensor"):
        mxfp8.abs()  # another class: warns again
    with pytest.warns(UserWarning, match=r"aten\.sum\.default is not implemented for Float8Tensor"):
        torch.sum(fp8)  # another op: warns again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.abs()
        mxfp8.abs()
        torch.sum(fp8)
    assert qt.QuantizedTensor._warned_fallbacks == {
        (qt.Float8Tensor, aten.abs.default),
        (qt.MXFP8Tensor, aten.abs.default),
        (qt.Float8Tensor, aten.sum.default),
    }
