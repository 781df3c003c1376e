"""qt.nn.Linear across steps: quantizer state as module buffers, inference, and user errors.

Each multi-step test failed before quantizer state became module state (issue 14): the delayed
histories stayed zero on the wrong device, and the stochastic-rounding counter advanced on
per-call copies of the quantizer, so every step reused one random stream.
"""

from __future__ import annotations

import io

import pytest
import torch

import quant_core
import quant_tensors as qt

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skip_without_cuda(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")


def _step(layer: qt.nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward; returns (dx, dW)."""
    x = x.clone().requires_grad_(True)
    layer.weight.grad = None
    layer(x).backward(dy)
    return x.grad, layer.weight.grad


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_histories_record_every_steps_amax(device):
    _skip_without_cuda(device)
    layer = qt.nn.Linear(64, 32, recipe=qt.Float8DelayedScaling(amax_history_len=4), device=device)
    expected: dict[str, list[float]] = {"input": [], "weight": [], "grad_output": []}
    for step in range(3):
        x = (torch.randn(16, 64, generator=gen(step)) * 10 ** (step + 1)).to(device)
        dy = (torch.randn(16, 32, generator=gen(10 + step)) * 10**-step).to(device)
        _step(layer, x, dy)
        expected["input"].insert(0, quant_core.amax(x).item())
        expected["weight"].insert(0, quant_core.amax(layer.weight.detach()).item())
        expected["grad_output"].insert(0, quant_core.amax(dy).item())
    for role, amaxes in expected.items():
        history = getattr(layer, f"{role}_quantizer_state")
        assert history.device.type == device
        assert history.tolist() == [*amaxes, 0.0], role
        assert getattr(layer, f"{role}_quantizer").amax_history is history  # bound, not a copy


def test_delayed_step_scales_with_the_previous_steps_amax():
    # Step 2's input is quantized with scale fmax / amax(step 1's input): y shows it.
    layer = qt.nn.Linear(64, 32, bias=False, recipe=qt.Float8DelayedScaling())
    first, second = torch.randn(16, 64, generator=gen(1)) * 1000, torch.randn(16, 64, generator=gen(2))
    with torch.no_grad():
        layer(first)
        y = layer(second)
    scale, scale_inv = quant_core.fp8_scale(quant_core.amax(first), torch.float8_e4m3fn)
    codes, _ = quant_core.cast_to_fp8_reference(second, scale, torch.float8_e4m3fn)
    x_values = quant_core.dequantize_fp8_reference(codes, scale_inv)
    # The weight's history holds the amax of the same weight from step 1.
    weight_scale, weight_scale_inv = quant_core.fp8_scale(quant_core.amax(layer.weight), torch.float8_e4m3fn)
    weight_codes, _ = quant_core.cast_to_fp8_reference(layer.weight.detach(), weight_scale, torch.float8_e4m3fn)
    w_values = quant_core.dequantize_fp8_reference(weight_codes, weight_scale_inv)
    torch.testing.assert_close(y, x_values @ w_values.t(), rtol=1e-6, atol=1e-5)


def test_states_are_buffers_that_move_save_and_survive_half():
    layer = qt.nn.Linear(64, 32, recipe=qt.Float8DelayedScaling(amax_history_len=3))
    _step(layer, torch.randn(16, 64) * 3, torch.randn(16, 32))
    names = {name for name, _ in layer.named_buffers()}
    assert names == {"input_quantizer_state", "weight_quantizer_state", "grad_output_quantizer_state"}
    history = layer.input_quantizer_state.clone()
    layer.half()  # floating buffers would become fp16: histories keep fp32 (and their values)
    assert layer.input_quantizer_state.dtype == torch.float32
    assert torch.equal(layer.input_quantizer_state, history)
    assert layer.input_quantizer.state is layer.input_quantizer_state
    assert "input_quantizer_state" in layer.state_dict()
    assert not any(
        name.endswith("_state") for name, _ in qt.nn.Linear(64, 32, recipe=qt.MXFP8BlockScaling()).named_buffers()
    )


def _nvfp4_layer(seed: int = 0) -> qt.nn.Linear:
    torch.manual_seed(seed)
    return qt.nn.Linear(64, 32, bias=False, recipe=qt.NVFP4BlockScaling())


def test_stochastic_rounding_stream_advances_every_step_and_resumes_from_state_dict():
    layer = _nvfp4_layer()
    x, dy = torch.randn(16, 64, generator=gen(1)), torch.randn(16, 32, generator=gen(2))
    dx_first, _ = _step(layer, x, dy)
    dx_second, _ = _step(layer, x, dy)
    assert not torch.equal(dx_first, dx_second)  # same input and gradient, a new random stream
    assert layer.grad_output_quantizer_state.item() == 2
    assert layer.grad_output_quantizer.calls == 2

    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    resumed = _nvfp4_layer(seed=1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.grad_output_quantizer.calls == 2
    assert torch.equal(_step(resumed, x, dy)[0], _step(layer, x, dy)[0])  # continues the stream: step 3


def test_moving_a_layer_keeps_its_quantizers_bound_to_its_buffers():
    layer = qt.nn.Linear(64, 32, recipe=qt.NVFP4BlockScaling())
    layer.to(torch.float64).to(torch.float32)  # buffers are replaced by _apply
    _step(layer, torch.randn(16, 64), torch.randn(16, 32))
    assert layer.grad_output_quantizer.state is layer.grad_output_quantizer_state
    assert layer.grad_output_quantizer_state.item() == 1


def test_quantized_weight_shares_the_layers_bound_weight_quantizer():
    model = qt.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), qt.Float8DelayedScaling(), quantized_weights=True)
    layer = model[0]
    layer.float()
    assert layer.weight.quantizer is layer.weight_quantizer
    assert layer.weight.quantizer.amax_history is layer.weight_quantizer_state


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("quantized_weights", [False, True])
def test_inference_quantizes_only_forward_operands_for_any_token_count(name, tokens, quantized_weights):
    recipe = qt.recipe_from_name(name)
    model = qt.convert(torch.nn.Sequential(torch.nn.Linear(256, 128)), recipe, quantized_weights=quantized_weights)
    layer = model[0]
    x = torch.randn(1, tokens, 256, generator=gen(3), dtype=torch.bfloat16)
    layer.to(torch.bfloat16)
    states = {name: state.clone() for name, state in layer.named_buffers()}
    with torch.no_grad():
        y = layer(x)
    # The same math from forward-only operands: x rowwise, the weight rowwise.
    qx = layer.input_quantizer.quantize(
        x.reshape(-1, 256), state=states.get("input_quantizer_state"), rowwise=True, columnwise=False
    )
    qw = layer.weight
    if not quantized_weights:
        qw = layer.weight_quantizer.quantize(qw, state=states.get("weight_quantizer_state"), columnwise=False)
    expected = qt.ops.scaled_mm(qx, qw, torch.bfloat16, bias=layer.bias)
    assert y.shape == (1, tokens, 128)
    assert torch.equal(y.reshape(tokens, 128), expected)


def test_inference_and_frozen_weights_skip_the_columnwise_quantization(monkeypatch):
    layer = qt.nn.Linear(64, 32, recipe=qt.Float8CurrentScaling())
    requested = []
    quantizer_class = type(layer.input_quantizer)
    # The entries below both the public methods and the layer's unchecked calls
    original = quantizer_class._quantize, quantizer_class._quantize_recastable, quantizer_class._recast_columnwise

    def quantize(self, x, **kwargs):
        requested.append(kwargs["usages"])  # (rowwise, columnwise)
        return original[0](self, x, **kwargs)

    def quantize_recastable(self, x, state):
        requested.append("weight rowwise, recastable")
        return original[1](self, x, state)

    def recast_columnwise(self, x, key):
        requested.append("weight columnwise, recast")
        return original[2](self, x, key)

    monkeypatch.setattr(quantizer_class, "_quantize", quantize)
    monkeypatch.setattr(quantizer_class, "_quantize_recastable", quantize_recastable)
    monkeypatch.setattr(quantizer_class, "_recast_columnwise", recast_columnwise)
    with torch.no_grad():
        layer(torch.randn(4, 64))
    assert requested == [(True, False), (True, False)]  # input, weight: rowwise only
    requested.clear()
    layer.weight.requires_grad_(False)
    layer(torch.randn(4, 64, requires_grad=True)).sum().backward()
    # input rowwise only (no wgrad); the weight's columnwise data for dgrad, recast in backward
    # ([Note: weights recast in backward]); grad_output rowwise only (no wgrad)
    assert requested == [
        (True, False),
        "weight rowwise, recastable",
        "weight columnwise, recast",
        (True, False),
    ]


def test_torch_optimizer_on_quantized_weights_names_fused_adam():
    model = qt.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)), qt.Float8CurrentScaling(), quantized_weights=True)
    model(torch.randn(4, 64)).sum().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NotImplementedError, match="quant_optim.FusedAdam"):
        optimizer.step()


@pytest.mark.cuda
def test_fp32_layer_with_bias_runs_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    layer = qt.nn.Linear(256, 128, recipe=qt.Float8CurrentScaling(), device="cuda")
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    y = layer(x)
    y.sum().backward()
    qx = layer.input_quantizer.quantize(x.detach(), columnwise=False)
    qw = layer.weight_quantizer.quantize(layer.weight.detach(), columnwise=False)
    without_bias = qt.ops.scaled_mm(qx, qw, torch.float32, fast_accumulation=layer.recipe.fprop_fast_accumulation)
    torch.testing.assert_close(y, without_bias + layer.bias, rtol=0, atol=1e-5)
    assert torch.equal(layer.bias.grad, torch.full_like(layer.bias, 64.0))  # sum of a ones gradient
    assert x.grad.shape == x.shape
