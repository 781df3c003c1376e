"""`quant_lab.demo.bf16_gemms_in_fp32`: bf16 GEMMs on the CPU computed the fp32 way."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quant_lab.demo import bf16_gemms_in_fp32

aten = torch.ops.aten


def _operands(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]


@pytest.mark.parametrize(
    ("op", "shapes", "kwargs"),
    [
        (aten.mm.default, [(48, 200), (200, 40)], {}),
        (aten.addmm.default, [(40,), (48, 200), (200, 40)], {"beta": 0.5, "alpha": 2.0}),
        (aten.bmm.default, [(3, 48, 200), (3, 200, 40)], {}),
        (aten.baddbmm.default, [(3, 48, 40), (3, 48, 200), (3, 200, 40)], {"beta": 0.5, "alpha": 2.0}),
    ],
    ids=["mm", "addmm", "bmm", "baddbmm"],
)
def test_bf16_gemms_run_as_fp32_gemms_rounded_once(op, shapes, kwargs):
    args = _operands(0, *shapes)
    with bf16_gemms_in_fp32():
        got = op(*args, **kwargs)
    want = op(*(a.float() for a in args), **kwargs).bfloat16()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # torch's own bf16 kernel sums in another order: within a bf16 ulp or so of the fp32 way.
    torch.testing.assert_close(op(*args, **kwargs).float(), want.float(), rtol=2**-7, atol=2**-7)


def test_other_dtypes_and_ops_run_as_they_would():
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    half_a, half_b = a.half(), b.half()
    x = _operands(1, (32, 64))[0]
    with bf16_gemms_in_fp32():
        fp32, fp16, gelu = a @ b, half_a @ half_b, torch.nn.functional.gelu(x)
    assert torch.equal(fp32, a @ b)
    assert torch.equal(fp16, half_a @ half_b)
    assert gelu.dtype == torch.bfloat16
    assert torch.equal(gelu, torch.nn.functional.gelu(x))


class _GemmOperands(TorchDispatchMode):
    """Records the operand dtypes of every GEMM that runs below the modes pushed after it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (aten.mm.default, aten.addmm.default):
            self.seen.append((func.overloadpacket.__name__, {a.dtype for a in args if isinstance(a, torch.Tensor)}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
def test_every_gemm_of_a_bf16_linear_runs_the_fp32_way(bias):
    """The forward (addmm with the bias Parameter itself, or mm) and both backward GEMMs run as
    fp32 GEMMs (at these sizes torch's bf16 kernel would give the same values: the spy tells)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=bias).bfloat16()
    x, dy = _operands(2, (16, 64), (16, 32))
    x.requires_grad_(True)
    with _GemmOperands() as spy, bf16_gemms_in_fp32():
        y = layer(x)
        y.backward(dy)
    assert spy.seen == [("addmm" if bias else "mm", {torch.float32}), ("mm", {torch.float32}), ("mm", {torch.float32})]
    weight = layer.weight.detach()
    want = x.detach().float() @ weight.float().t()
    if bias:
        want = want + layer.bias.detach().float()
    assert torch.equal(y, want.bfloat16())
    assert torch.equal(x.grad, (dy.float() @ weight.float()).bfloat16())
    assert torch.equal(layer.weight.grad, (dy.t().float() @ x.detach().float()).bfloat16())
