"""FusedAdam's plain-torch step against torch.optim.Adam/AdamW and the reference quantization."""

from __future__ import annotations

import pytest
import torch

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


def gradients(step: int, shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_parameters_equal_torch_adam_bitwise(adam_w_mode, weight_decay):
    shapes = [(64, 32), (32,), (3, 5, 7)]
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        theirs, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, foreach=False
    )
    optimizer = FusedAdam(
        ours, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, adam_w_mode=adam_w_mode
    )
    for step in range(20):
        for p, q, g in zip(ours, theirs, gradients(step, shapes), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["exp_avg"], reference.state[q]["exp_avg"])
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"])


def test_bf16_parameters_step_an_fp32_master():
    torch.manual_seed(0)
    value = torch.randn(64, 32)
    p = torch.nn.Parameter(value.to(torch.bfloat16))
    master = torch.nn.Parameter(value.to(torch.bfloat16).float())
    optimizer = FusedAdam([p], lr=1e-2)
    reference = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.0, foreach=False)
    for step in range(20):
        (g,) = gradients(step, [(64, 32)])
        p.grad, master.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        optimizer.step()
        reference.step()
    assert torch.equal(optimizer.state[p]["master"], master)
    assert torch.equal(p, master.to(torch.bfloat16))


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_quantized_parameters_requantize_the_master_after_each_step(recipe_name):
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    torch.manual_seed(0)
    value = torch.randn(128, 128)
    p = qt.nn.quantized_parameter(value, quantizer)
    master = torch.nn.Parameter(value.clone())
    reference_quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    reference_quantizer.quantize(value)  # the same history as p's quantizer (delayed scaling)
    optimizer = FusedAdam([p], lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(20):
        (g,) = gradients(step, [(128, 128)])
        p.grad, master.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
        expected = reference_quantizer.quantize(master.detach())
        for name, buffer in expected.buffers().items():
            got = p.buffers()[name]
            assert (got is None) == (buffer is None), name
            if buffer is not None:
                assert torch.equal(raw_bits(got.reshape(-1)), raw_bits(buffer.reshape(-1))), (step, name)
    assert torch.equal(optimizer.state[p]["master"], master)


def test_a_non_finite_gradient_skips_the_whole_step():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    optimizer = FusedAdam([a, b], lr=1e-2)
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    optimizer.step()
    before = [t.clone() for t in (a, b, optimizer.state[a]["exp_avg"], optimizer.state[b]["exp_avg_sq"])]
    a.grad, b.grad = torch.ones(8), torch.tensor([1.0] * 7 + [float("nan")])
    optimizer.step()
    assert optimizer.last_step_skipped
    assert optimizer.skipped_steps == 1
    after = (a, b, optimizer.state[a]["exp_avg"], optimizer.state[b]["exp_avg_sq"])
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert float(optimizer.state[a]["step"]) == 1.0


def test_bad_arguments_are_refused():
    p = qt.nn.quantized_parameter(torch.randn(16, 16), qt.Float8CurrentScaling().quantizer("weight"))
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam([p], master_weights=False)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        FusedAdam([torch.nn.Parameter(torch.randn(2))], exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([torch.nn.Parameter(torch.randn(2))], betas=(1.0, 0.9))
