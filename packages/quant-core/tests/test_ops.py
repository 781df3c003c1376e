"""The torch.ops.quant_core operators ([Note: custom ops]): schemas, fake kernels, tracing, and the
unchecked entry points giving what the public functions give.

`torch.library.opcheck` checks each operator's fake kernel against the real one, its autograd
registration and AOT tracing with dynamic shapes. Its schema test compares tensors with allclose,
which torch has no FP8 kernels for, so ops with FP8 tensors have their mutation claims checked
here bytewise instead (`test_schema_declares_exactly_the_buffers_written`).
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

import quant_core

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPS = torch.ops.quant_core


def _x(shape=(6, 48), dtype=torch.bfloat16, seed=0):
    """Finite values: opcheck compares outputs with assert_close, where NaN is unequal to itself
    (the bitwise tests of each format cover NaN and Inf)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)


def _buffers(q: quant_core.BlockQuantized) -> tuple[torch.Tensor | None, ...]:
    """The four buffers of a result, rowwise data as the (M, K / codes per byte) view kernels take."""
    rowwise = None if q.rowwise_data is None else q.rowwise_data.reshape(-1, q.rowwise_data.shape[-1])
    return rowwise, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv


def _sentinel(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fresh buffer filled with a byte no correct kernel leaves everywhere."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape, size), 0xA5, dtype=torch.uint8).view(dtype).reshape(shape)


def _empty_like_result(q: quant_core.BlockQuantized) -> tuple[torch.Tensor | None, ...]:
    """Fresh buffers shaped like a result's (see _sentinel)."""
    return tuple(None if b is None else _sentinel(tuple(b.shape), b.dtype) for b in _buffers(q))


def _many_buffers(results: list[quant_core.BlockQuantized]) -> tuple[list, ...]:
    """The multi-tensor quantize operators' usage flags and lists of the buffers present (fresh
    ones, see _sentinel) for these results' tensors: (rowwise, columnwise, four buffer lists)."""
    buffers = [_empty_like_result(q) for q in results]
    flags = ([b[0] is not None for b in buffers], [b[2] is not None for b in buffers])
    return *flags, *([b[k] for b in buffers if b[k] is not None] for k in range(4))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _cases() -> dict[str, tuple[torch._ops.OpOverload, tuple]]:
    """Each operator with cheap arguments: partial edge blocks, both usages, strided inputs."""
    x = _x()
    x_strided = _x((48, 12)).t()  # (12, 48) with strides (1, 12)
    scale = torch.tensor(3.0)
    fp8 = quant_core.quantize_fp8(x, columnwise=True)
    mx = quant_core.quantize_mxfp8(x_strided, columnwise=True)
    bw = quant_core.quantize_fp8_blockwise(x, (128, 128), columnwise=True)
    nv = quant_core.quantize_nvfp4(x, (16, 16), columnwise=True)
    x_hadamard = _x((12, 48)).t()  # (48, 12) with strides (1, 48): M a multiple of 16, a partial block along K
    nv_hadamard = quant_core.quantize_nvfp4(x_hadamard, columnwise=True, hadamard_seed=-(2**62) + 1)
    x_rows = x.float()[::2]  # (3, 48) with strides (96, 1)
    empty = torch.empty(0, 40)
    mx_many = [mx, quant_core.quantize_mxfp8(x), quant_core.quantize_mxfp8(x_rows, rowwise=False, columnwise=True)]
    bw_many = [
        quant_core.quantize_fp8_blockwise(t, fp8_dtype=torch.float8_e5m2, power_2_scales=False, **usage)
        for t, usage in [
            (x_strided, {"columnwise": True}),
            (empty, {"rowwise": False, "columnwise": True}),
            (x_rows, {}),
        ]
    ]
    seed = torch.tensor(-7, dtype=torch.int64)
    one = torch.tensor(1.0)
    return {
        "amax": (OPS.amax.default, (x_strided,)),
        "amax_many": (OPS.amax_many.default, ([x_strided, torch.empty(0, 3), x.float()[::2], torch.tensor(-2.0)],)),
        "cast_to_fp8_many": (
            OPS.cast_to_fp8_many.default,
            (
                [x_strided, torch.empty(0, 3), x.float()[::2]],
                torch.tensor([0.5, 2.0, 7.0]),
                torch.float8_e5m2,
                [torch.empty(s, dtype=torch.float8_e5m2) for s in (x_strided.shape, (0, 3), x.float()[::2].shape)],
            ),
        ),
        "fp8_scale": (OPS.fp8_scale.default, (torch.tensor([[3.0, 0.0], [1e-40, 7e5]]), 448.0, 2, True)),
        "delayed_fp8_scale": (
            OPS.delayed_fp8_scale.default,
            (torch.tensor([5.0, 0.5, 9.0]), torch.tensor(2.0), 57344.0, -1, False, "max"),
        ),
        "quantize_fp8": (
            OPS.quantize_fp8.default,
            (
                x_strided,
                None,
                E4M3,
                False,
                _sentinel((12, 48), E4M3),
                _sentinel((48, 12), E4M3),
                one.clone(),
                None,
                one.clone(),
            ),
        ),
        "quantize_fp8_given_amax": (
            OPS.quantize_fp8.default,
            (
                x,
                torch.tensor(1e3),
                torch.float8_e5m2,
                True,
                None,
                _sentinel((48, 6), torch.float8_e5m2),
                one.clone(),
                one.clone(),
                None,
            ),
        ),
        "quantize_fp8_delayed": (
            OPS.quantize_fp8_delayed.default,
            (
                x_strided,
                None,
                torch.tensor([5.0, 0.5, 9.0]),
                E4M3,
                1,
                True,
                "most_recent",
                _sentinel((12, 48), E4M3),
                None,
                one.clone(),
                one.clone(),
                one.clone(),
            ),
        ),
        "cast_to_fp8": (
            OPS.cast_to_fp8.default,
            (x_strided, scale, E4M3, _sentinel((12, 48), E4M3), _sentinel((48, 12), E4M3)),
        ),
        "cast_to_fp8_columnwise_only": (
            OPS.cast_to_fp8.default,
            (x, scale, torch.float8_e5m2, None, _sentinel((48, 6), torch.float8_e5m2)),
        ),
        "dequantize_fp8": (OPS.dequantize_fp8.default, (fp8.columnwise_data, fp8.scale_inv, torch.float16)),
        "transpose_bytes": (OPS.transpose_bytes.default, (fp8.rowwise_data.view(torch.uint8)[:, 3:],)),
        "quantize_mxfp8": (OPS.quantize_mxfp8.default, (x_strided, *_empty_like_result(mx))),
        "quantize_mxfp8_many": (OPS.quantize_mxfp8_many.default, ([x_strided, x, x_rows], *_many_buffers(mx_many))),
        "quantize_fp8_blockwise_many": (
            OPS.quantize_fp8_blockwise_many.default,
            ([x_strided, empty, x_rows], 1, torch.float8_e5m2, False, *_many_buffers(bw_many)),
        ),
        "dequantize_mxfp8": (
            OPS.dequantize_mxfp8.default,
            (mx.columnwise_data, mx.columnwise_scale_inv, torch.float32),
        ),
        "dequantize_mxfp8_pair": (
            OPS.dequantize_mxfp8_pair.default,
            (mx.columnwise_data, mx.columnwise_scale_inv, mx.rowwise_data, mx.rowwise_scale_inv, torch.bfloat16),
        ),
        "quantize_fp8_blockwise": (
            OPS.quantize_fp8_blockwise.default,
            (x, 128, E4M3, True, *_empty_like_result(bw)),
        ),
        "dequantize_fp8_blockwise": (
            OPS.dequantize_fp8_blockwise.default,
            (bw.rowwise_data, bw.rowwise_scale_inv, 128, torch.bfloat16),
        ),
        "quantize_nvfp4": (
            OPS.quantize_nvfp4.default,
            (x, 16, nv.amax, True, seed, nv.amax, None, *_empty_like_result(nv)),
        ),
        "quantize_nvfp4_hadamard": (
            OPS.quantize_nvfp4.default,
            (
                x_hadamard,
                1,
                nv_hadamard.amax,
                True,
                seed,
                nv_hadamard.columnwise_amax,
                -(2**62) + 1,
                *_empty_like_result(nv_hadamard),
            ),
        ),
        "dequantize_nvfp4": (
            OPS.dequantize_nvfp4.default,
            (nv.rowwise_data, nv.rowwise_scale_inv, 16, nv.amax, torch.float32),
        ),
        "dequantize_nvfp4_pair": (
            OPS.dequantize_nvfp4_pair.default,
            (*_buffers(nv), 16, nv.amax, 16, None, torch.float16),
        ),
        "nvfp4_gemm_output": (
            OPS.nvfp4_gemm_output.default,
            (_x((6, 40), torch.float32), nv.amax, torch.tensor(0.0), _x((40,), seed=1), torch.bfloat16),
        ),
        "transpose_nvfp4": (OPS.transpose_nvfp4.default, (nv.rowwise_data, nv.rowwise_scale_inv)),
        "hadamard_transform_16": (OPS.hadamard_transform_16.default, (x_strided, -3)),
        "hadamard_inverse_16": (OPS.hadamard_inverse_16.default, (x_strided, -(2**63) + 5)),
        "hadamard_amaxes": (OPS.hadamard_amaxes.default, (x_strided, 2**62)),
        "adam_step": (  # fp32 params, bf16 moments, outs, a verdict, lr as a tensor
            OPS.adam_step.default,
            (
                [torch.randn(5), torch.randn(3, 7)],
                [torch.randn(5), torch.randn(7, 3).t()],
                [torch.zeros(5), torch.zeros(3, 7)],
                [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, 7, dtype=torch.bfloat16)],
                [torch.zeros(()), torch.tensor(4.0)],
                [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, 7, dtype=torch.bfloat16)],
                torch.zeros(1),
                torch.tensor(1e-2),
                [0.0, 0.9, 0.99, 1e-8, 0.1],
                True,
                True,
            ),
        ),
        "adam_step_stochastic": (  # bf16 masters rounded stochastically, counters written
            OPS.adam_step.default,
            (
                [torch.randn(5).bfloat16(), torch.randn(3, 7).bfloat16()],
                [torch.randn(5), torch.randn(7, 3).t()],
                [torch.zeros(5), torch.zeros(3, 7)],
                [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, 7, dtype=torch.bfloat16)],
                [torch.zeros(()), torch.tensor(4.0)],
                [torch.zeros(5), torch.zeros(3, 7)],
                torch.zeros(1),
                torch.tensor(1e-2),
                [0.0, 0.9, 0.99, 1e-8, 0.1],
                True,
                True,
                2**40,
                [torch.tensor(0), torch.tensor(2**62)],
            ),
        ),
        "adam_moment_amaxes": (  # fp8 moments: nothing written
            OPS.adam_moment_amaxes.default,
            (
                [torch.randn(5), torch.randn(3, 7)],
                [torch.randn(5), torch.randn(7, 3).t()],
                [_fp8_moment((5,), E4M3), _fp8_moment((3, 7), E4M3)],
                [torch.zeros(5), torch.zeros(3, 7)],
                [torch.tensor(0.5), torch.tensor(2.0)],
                list(dataclasses.astuple(_scalars(adam_w_mode=False))),
            ),
        ),
        "adam_step_fp8_moments": (  # codes and scale_invs written; no verdict
            OPS.adam_step.default,
            (
                [torch.randn(5), torch.randn(3, 7)],
                [torch.randn(5), torch.randn(7, 3).t()],
                [torch.zeros(5), torch.zeros(3, 7)],
                [_fp8_moment((5,), E4M3), _fp8_moment((3, 7), E4M3)],
                [torch.zeros(()), torch.tensor(4.0)],
                [],
                None,
                None,
                [1e-2, 0.9, 0.99, 1e-8, 0.1],
                False,
                True,
                0,
                None,
                [torch.tensor(1.0), torch.tensor(0.5)],
                torch.tensor([[0.5, 2.0]]),
            ),
        ),
        "has_non_finite": (OPS.has_non_finite.default, ([x, torch.empty(0), x_strided.float()],)),
        # x: 2 chunks of 144 elements in blocks of 32 (a partial last block).
        "quantize_fp8_chunks": (
            OPS.quantize_fp8_chunks.default,
            (
                x,
                32,
                E5M2,
                True,
                3,
                seed,
                torch.zeros(x.numel()),
                _sentinel((2, quant_core.chunk_row_bytes(144, 32)), torch.uint8),
            ),
        ),
        "dequantize_sum_fp8_chunks": (
            OPS.dequantize_sum_fp8_chunks.default,
            (quant_core.quantize_fp8_chunks(x, 2, 32, E5M2), 32, E5M2, True, _sentinel((144,), torch.bfloat16)),
        ),
    }


def _fp8_moment(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Codes of small random values with scale_inv 1, as a moment after a few steps holds them."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 0.1).to(dtype)


def _scalars(adam_w_mode: bool = True) -> quant_core.AdamScalars:
    return quant_core.AdamScalars.of(
        lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, adam_w_mode=adam_w_mode
    )


def _tensors(args: tuple) -> list[tuple[int, torch.Tensor]]:
    """(argument index, tensor) of every tensor argument, list elements included."""
    found = []
    for i, arg in enumerate(args):
        for t in arg if isinstance(arg, list) else [arg]:
            if isinstance(t, torch.Tensor):
                found.append((i, t))
    return found


def _has_fp8(args: tuple) -> bool:
    return any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for _, t in _tensors(args))


def test_every_kernel_op_is_an_operator_and_every_operator_is_checked():
    # One operator per kernel dispatch point, each with a reference kernel (any device).
    operators = set(quant_core._library.OPERATORS)
    assert all(hasattr(OPS, name) for name in operators)
    assert all("reference" in op.kernels for op in quant_core._library.OPERATORS.values())
    assert {op._schema.name.removeprefix("quant_core::") for op, _ in _cases().values()} == operators


@pytest.mark.parametrize("name", sorted(quant_core._library.OPERATORS))
def test_schema_is_the_arguments_tuple(name):
    # [Note: operator arguments]: the schema has the tuple's fields in order, its defaults, exactly
    # `mutates_args` written, optional tensor lists as `Tensor[]?`, and parses back to itself.
    operator = quant_core._library.OPERATORS[name]
    schema = operator.overload._schema
    assert torch._C.parse_schema(str(schema)) == schema
    assert [a.name for a in schema.arguments] == list(operator.arguments._fields)
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == set(operator.mutates_args)
    annotations = typing.get_type_hints(operator.arguments)
    defaults = operator.arguments._field_defaults
    for argument in schema.arguments:
        assert argument.has_default_value() == (argument.name in defaults), argument.name
        if argument.name in defaults:
            assert argument.default_value == defaults[argument.name], argument.name
        if annotations[argument.name] == list[torch.Tensor] | None:
            assert str(argument.type) == "Optional[List[Tensor]]", argument.name


@pytest.mark.parametrize("name", sorted(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if not _has_fp8(args):
        tests = ("test_schema", *tests)
    torch.library.opcheck(op, args, test_utils=tests)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_schema_declares_exactly_the_buffers_written(name):
    op, args = _cases()[name]
    written = {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    before = [(i, _bytes(t).clone(), t._version) for i, t in _tensors(args)]
    op(*args)
    for (i, old, version), (_, t) in zip(before, _tensors(args), strict=True):
        changed = not torch.equal(old, _bytes(t))
        assert changed == (i in written and old.numel() > 0), (op._schema.arguments[i].name, changed)
        # Autograd sees every write: the version of a written buffer moves (C++ writes through pointers).
        assert (t._version > version) == (i in written), (op._schema.arguments[i].name, "version")


@pytest.mark.parametrize("name", sorted(_cases()))
def test_call_gives_what_the_operator_gives(name):
    """`_library.call` ([Note: eager operator calls]): the same outputs, bytes written and version bumps."""
    op, args = _cases()[name]
    copies = [tuple(_copy(a) for a in args) for _ in range(2)]
    versions = [[t._version for _, t in _tensors(c)] for c in copies]
    want = op(*copies[0])
    got = quant_core._library.call(op._schema.name.removeprefix("quant_core::"), *copies[1])
    for a, b in zip(_tensors((want,)), _tensors((got,)), strict=True):
        assert torch.equal(_bytes(a[1]), _bytes(b[1]))
    for (_, a), (_, b), va, vb in zip(_tensors(copies[0]), _tensors(copies[1]), *versions, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))
        assert (a._version > va) == (b._version > vb)


def _copy(arg):
    if isinstance(arg, torch.Tensor):
        return arg.clone()
    return [_copy(a) for a in arg] if isinstance(arg, list) else arg


class _Marked(torch.Tensor):
    """A tensor subclass with no behaviour of its own: the dispatcher, not `call`, must see it."""


def test_call_runs_the_implementation_directly_only_in_plain_eager_code(monkeypatch):
    x = _x((4, 32), torch.float32)
    operator = quant_core._library.OPERATORS["amax"]
    run = operator.implementations[operator.select("cpu", None)]
    direct = []
    monkeypatch.setitem(operator.eager, "cpu", lambda *a: direct.append(1) or run(*a))

    seen: list[str] = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    want = OPS.amax(x)
    assert torch.equal(quant_core._library.call("amax", x), want)
    assert direct == [1]
    with Seen():
        assert torch.equal(quant_core._library.call("amax", x), want)
    assert "quant_core.amax.default" in seen
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        quant_core._library.call("amax", x)
    assert any(e.key == "quant_core::amax" for e in profile.key_averages())
    quant_core._library.call("amax", x.as_subclass(_Marked))
    assert direct == [1]  # none of the three took the direct path
    quant_core._library.call("amax", torch.nn.Parameter(x))
    assert direct == [1, 1]


def test_operators_do_not_record_autograd_history():
    x = _x((4, 32), torch.float32).requires_grad_()
    with quant_core.use_backend("reference"):  # torch ops inside: they would record without no_grad
        assert not OPS.amax(x).requires_grad
        assert not OPS.hadamard_transform_16(x, 1).requires_grad
    assert not OPS.amax(x).requires_grad


def test_unchecked_operators_equal_the_public_functions():
    x = _x((40, 64), torch.float32, seed=3)
    q = quant_core.quantize_nvfp4(x, columnwise=True, stochastic_rounding=True, seed=2**63 + 9)
    buffers = _empty_like_result(q)
    OPS.quantize_nvfp4(x, 1, q.amax, True, torch.tensor(-(2**63) + 9), q.amax, None, *buffers)
    for got, want in zip(buffers, _buffers(q), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    rows = x[:32]  # whole runs of 16 rows for the transform
    q = quant_core.quantize_nvfp4(rows, columnwise=True, hadamard_seed=2**63 + 3)
    buffers = _empty_like_result(q)
    OPS.quantize_nvfp4(rows, 1, q.amax, False, torch.tensor(0), q.columnwise_amax, -(2**63) + 3, *buffers)
    for got, want in zip(buffers, _buffers(q), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(OPS.hadamard_amaxes(rows, -(2**63) + 3), torch.stack((q.amax, q.columnwise_amax)))
    scale = torch.tensor(0.75)
    rowwise, columnwise = quant_core.cast_to_fp8(x, scale, E4M3, columnwise=True)
    buffers = (_sentinel((40, 64), E4M3), _sentinel((64, 40), E4M3))
    OPS.cast_to_fp8(x, scale, E4M3, *buffers)
    assert torch.equal(buffers[0].view(torch.uint8), rowwise.view(torch.uint8))
    assert torch.equal(buffers[1].view(torch.uint8), columnwise.view(torch.uint8))


def test_operators_handle_empty_inputs():
    empty = torch.empty(0, 32)
    assert OPS.amax(empty).item() == 0.0
    assert OPS.amax_many([empty, empty.t()]).tolist() == [0.0, 0.0]
    assert OPS.transpose_bytes(torch.empty(0, 5, dtype=torch.uint8)).shape == (5, 0)
    assert OPS.dequantize_mxfp8(
        torch.empty(0, 32, dtype=E4M3), torch.empty(0, 1, dtype=torch.uint8), torch.float32
    ).shape == (0, 32)
    OPS.quantize_mxfp8(empty, torch.empty(0, 32, dtype=E4M3), torch.empty(0, 1, dtype=torch.uint8), None, None)
    one = torch.ones(())
    output = OPS.nvfp4_gemm_output(empty, one, one, torch.zeros(32), torch.bfloat16)
    assert (output.shape, output.dtype) == ((0, 32), torch.bfloat16)
