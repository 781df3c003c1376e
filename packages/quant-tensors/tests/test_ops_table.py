"""The shared op table of QuantizedTensor (quant_tensors._op_table) itself, and the ops outside it:
every table op is covered by a test_ops_*.py file, formats add no tables, ops outside the table raise
naming op and class, and the dequantize-fallback ops warn once per (class, op).
"""

from __future__ import annotations

import re
import warnings
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from quant_tensors_op_test_helpers import CASE_IDS, CASES, EXPECTED_CLASS, aten, quantized

import quant_tensors as qt

pytestmark = pytest.mark.usefixtures("fresh_fallback_warnings")  # every test starts with no fallback warned


# ---- the table itself ------------------------------------------------------------------------

# Every op of the shared table, and the tests of the test_ops_*.py files that exercise it.
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
    torch.ops._c10d_functional.all_gather_into_tensor.default: "test_full_tensor_and_distribute_tensor_move_every_buffer_exactly, test_shards_with_different_per_tensor_values_refuse_to_gather",
    torch.ops._c10d_functional.wait_tensor.default: "test_full_tensor_and_distribute_tensor_move_every_buffer_exactly",
    torch.ops._c10d_functional._wrap_tensor_autograd.default: "test_full_tensor_and_distribute_tensor_move_every_buffer_exactly",
    torch.ops.c10d.scatter_.default: "test_full_tensor_and_distribute_tensor_move_every_buffer_exactly",
}


def test_every_op_in_the_shared_table_is_covered_here():
    # A new entry in the table needs a test in the test_ops_*.py files first.
    assert set(qt.QuantizedTensor.__dict__["_ops"]) == set(COVERED_OPS)
    # ... and the tests named for each op are there (the op families live in separate files).
    sources = "".join(path.read_text() for path in Path(__file__).parent.glob("test_ops_*.py"))
    defined = set(re.findall(r"^def (test_\w+)\(", sources, re.MULTILINE))
    for op, tests in COVERED_OPS.items():
        for pattern in re.findall(r"test_\w+\*?", tests):
            assert any(fnmatch(name, pattern) for name in defined), f"{op}: no test {pattern} in test_ops_*.py"


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
