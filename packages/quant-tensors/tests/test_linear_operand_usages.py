"""Which usage of each operand qt.nn.Linear's three GEMMs read, checked by value ([Note: GEMM operands]
in quant_tensors.ops; docs/design.md, 'Tensor subclasses and the quantized Linear'):

fprop  y  = x W^T : input rowwise          x weight rowwise
dgrad  dx = dy W  : grad_output rowwise    x weight columnwise
wgrad  dW = dy^T x: grad_output columnwise x input columnwise

Every operand holds both usages when a GEMM reads it: the weight is quantized with both (as a layer
keeps it with `weight_columnwise_on_demand=False`), x and dy get both because the input and the
weight need gradients. The two usages stand for different values: the columnwise codes' signs are
flipped, and every operand is square and not symmetric, so a GEMM that reads the other usage still
multiplies, into other values. Each result must equal, bit for bit, the fp32 product of the
dequantized usages the table names (on the CPU the GEMM is that fp32 product), both where the layer
quantizes x and dy itself and where the caller hands them over quantized (each path has its own
GEMM calls).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import quant_tensors as qt

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
SIZE = 128  # tokens = in_features = out_features: the weight's 128 x 128 tiles (fp8-block) fit once


def _with_distinct_usages(q: qt.QuantizedTensor) -> qt.QuantizedTensor:
    """q with the sign bit of every columnwise code flipped, in place: the columnwise usage stands for
    the negated values, so it differs from the rowwise usage even where it is rowwise's exact transpose."""
    assert q.usages == (True, True)
    codes = q.columnwise_data.view(torch.uint8)
    codes ^= 0x88 if isinstance(q, qt.NVFP4Tensor) else 0x80  # two E2M1 codes per byte, or one FP8 code
    return q


def _usage_matrix(q: qt.QuantizedTensor, usage: str) -> torch.Tensor:
    """The fp32 matrix one usage's codes stand for, read from that usage alone: (M, K) rowwise, (K, M) columnwise."""
    alone = q.detach()
    alone.update_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    values = alone.dequantize(torch.float32).reshape(-1, q.shape[-1])
    return (values if usage == "rowwise" else values.t()).contiguous()


def _product(a: qt.QuantizedTensor, a_usage: str, b: qt.QuantizedTensor, b_usage: str) -> torch.Tensor:
    """A @ B^T from the named usages of a and b, in fp32."""
    return torch.matmul(_usage_matrix(a, a_usage), _usage_matrix(b, b_usage).t())


class _QuantizedGradient(torch.autograd.Function):
    """The identity whose backward hands on a given quantized gradient (as a sequence-parallel gather does)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, gradient: qt.QuantizedTensor) -> torch.Tensor:
        ctx.gradient = gradient
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.gradient, None


@dataclasses.dataclass
class _Run:
    """One forward and backward of a layer: its results and the quantized operands its GEMMs read."""

    y: torch.Tensor
    dx: torch.Tensor
    dw: torch.Tensor
    qx: qt.QuantizedTensor
    qw: qt.QuantizedTensor
    qdy: qt.QuantizedTensor


def _run(name: str, caller_quantizes: bool, monkeypatch: pytest.MonkeyPatch) -> _Run:
    recipe = dataclasses.replace(qt.recipe_from_name(name), weight_columnwise_on_demand=False)
    generator = torch.Generator().manual_seed(0)
    w, x, dy = (torch.randn(SIZE, SIZE, generator=generator) for _ in range(3))
    layer = qt.nn.Linear(SIZE, SIZE, bias=False, recipe=recipe)
    qw = _with_distinct_usages(layer.weight_quantizer.quantize(w, rowwise=True, columnwise=True))
    layer.weight = torch.nn.Parameter(qw)
    if caller_quantizes:
        qx = _with_distinct_usages(recipe.quantizer("input").quantize(x, rowwise=True, columnwise=True))
        qdy = _with_distinct_usages(recipe.quantizer("grad_output").quantize(dy, rowwise=True, columnwise=True))
        y = layer(qx.requires_grad_(True))
        _QuantizedGradient.apply(y, qdy).backward(dy)
        return _Run(y.detach(), qx.grad, layer.weight.grad, qx, qw, qdy)
    # The layer quantizes x in its forward and dy in its backward: each result, as made, gets distinct usages.
    made = []
    for cls in {type(layer.input_quantizer), type(layer.grad_output_quantizer)}:
        monkeypatch.setattr(cls, "_quantize", _recording(cls._quantize, made))
    x.requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    (qx,) = [q for quantizer, q in made if quantizer is layer.input_quantizer]
    (qdy,) = [q for quantizer, q in made if quantizer is layer.grad_output_quantizer]
    return _Run(y.detach(), x.grad, layer.weight.grad, qx, qw, qdy)


def _recording(quantize: Any, made: list) -> Any:
    def recorded(self: qt.Quantizer, x: torch.Tensor, **kwargs: Any) -> qt.QuantizedTensor:
        q = _with_distinct_usages(quantize(self, x, **kwargs))
        made.append((self, q))
        return q

    return recorded


@pytest.fixture(
    scope="module",
    params=[(name, caller) for name in RECIPES for caller in (False, True)],
    ids=lambda p: f"{p[0]}-{'caller' if p[1] else 'layer'}-quantizes",
)
def run(request: pytest.FixtureRequest) -> _Run:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run(*request.param, monkeypatch)


def test_fprop_reads_input_rowwise_and_weight_rowwise(run):
    assert torch.equal(run.y, _product(run.qx, "rowwise", run.qw, "rowwise"))


def test_dgrad_reads_grad_output_rowwise_and_weight_columnwise(run):
    assert torch.equal(run.dx, _product(run.qdy, "rowwise", run.qw, "columnwise"))


def test_wgrad_reads_grad_output_columnwise_and_input_columnwise(run):
    assert torch.equal(run.dw, _product(run.qdy, "columnwise", run.qx, "columnwise"))
