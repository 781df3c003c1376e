"""qt.nn.Linear and qt.ops.scaled_mm against the same math done by hand with quant-core's references."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch

import quant_core
import quant_tensors as qt

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_operand(name: str, role: str, x: torch.Tensor, usage: str, calls: int = 0) -> torch.Tensor:
    """The fp32 matrix a usage of x stands for after quantization by (name, role), by hand from quant-core."""
    fp8_dtype = torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn
    if name in ("fp8", "fp8-delayed"):
        if name == "fp8":
            q = quant_core.quantize_fp8_reference(x, fp8_dtype, columnwise=True)
            scale_inv = q.scale_inv
            rowwise, columnwise = q.rowwise_data, q.columnwise_data
        else:  # first use of a fresh delayed-scaling quantizer: scale 1
            scale_inv = torch.tensor(1.0)
            rowwise, columnwise = quant_core.cast_to_fp8_reference(x, scale_inv, fp8_dtype, columnwise=True)
        data = rowwise.reshape(-1, x.shape[-1]) if usage == "rowwise" else columnwise
        return quant_core.dequantize_fp8_reference(data, scale_inv)
    tiled = role == "weight"
    if name == "mxfp8":
        q = quant_core.quantize_mxfp8_reference(x, columnwise=True)
        dequantize = lambda d, s: quant_core.dequantize_mxfp8_reference(d, s)  # noqa: E731
    elif name == "fp8-block":
        shape = (128, 128) if tiled else (1, 128)
        q = quant_core.quantize_fp8_blockwise_reference(x, shape, fp8_dtype, columnwise=True)
        dequantize = lambda d, s: quant_core.dequantize_fp8_blockwise_reference(d, s, shape)  # noqa: E731
    else:
        shape = (16, 16) if tiled else (1, 16)
        q = quant_core.quantize_nvfp4_reference(
            x, shape, columnwise=True, stochastic_rounding=role == "grad_output", seed=calls
        )
        dequantize = lambda d, s: quant_core.dequantize_nvfp4_reference(d, s, q.amax, shape)  # noqa: E731
    if usage == "rowwise":
        return dequantize(q.rowwise_data, q.rowwise_scale_inv).reshape(-1, x.shape[-1])
    return dequantize(q.columnwise_data, q.columnwise_scale_inv)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_backward_equal_the_math_by_hand(name, dtype, bias):
    torch.manual_seed(0)
    layer = qt.nn.Linear(256, 128, bias=bias, recipe=qt.recipe_from_name(name), dtype=dtype)
    x = torch.randn(2, 64, 256, generator=gen(1)).to(dtype).requires_grad_(True)
    dy = torch.randn(2, 64, 128, generator=gen(2)).to(dtype)
    y = layer(x)
    y.backward(dy)

    x2d, dy2d, w = x.detach().reshape(-1, 256), dy.reshape(-1, 128), layer.weight.detach()
    expected_y = torch.matmul(
        reference_operand(name, "input", x2d, "rowwise"), reference_operand(name, "weight", w, "rowwise").t()
    )
    if bias:
        expected_y = expected_y + layer.bias.detach().float()
    expected_dx = torch.matmul(
        reference_operand(name, "grad_output", dy2d, "rowwise"), reference_operand(name, "weight", w, "columnwise").t()
    )
    expected_dw = torch.matmul(
        reference_operand(name, "grad_output", dy2d, "columnwise"),
        reference_operand(name, "input", x2d, "columnwise").t(),
    )
    assert torch.equal(y, expected_y.to(dtype).reshape(2, 64, 128))
    assert torch.equal(x.grad, expected_dx.to(dtype).reshape(2, 64, 256))
    assert torch.equal(layer.weight.grad, expected_dw.to(dtype))
    if bias:
        assert torch.equal(layer.bias.grad, dy2d.sum(dim=0))


@pytest.mark.parametrize("name", ["fp8", "fp8-block", "nvfp4"])
def test_on_demand_columnwise_weight_gives_the_same_gradients(name):
    x = torch.randn(64, 256, generator=gen(3)).requires_grad_(True)
    results = []
    for on_demand in (False, True):
        recipe = dataclasses.replace(qt.recipe_from_name(name), weight_columnwise_on_demand=on_demand)
        torch.manual_seed(0)
        model = qt.convert(torch.nn.Sequential(torch.nn.Linear(256, 128)), recipe, quantized_weights=True)
        assert model[0].weight.usages == (True, not on_demand)
        x.grad = None
        model(x).sum().backward()
        assert model[0].weight.usages == (True, not on_demand)  # the derived columnwise was dropped again
        results.append((x.grad.clone(), model[0].weight.grad.clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", RECIPES)
def test_prequantized_input_equals_quantizing_inside_the_layer(name):
    """Linear.linear takes an input already quantized by input_quantizer (as sequence-parallel
    gathers hand it over): same output and gradients as quantizing inside, and the input is
    neither requantized nor stripped of its usages."""
    torch.manual_seed(0)
    layer = qt.nn.Linear(256, 128, recipe=dataclasses.replace(qt.recipe_from_name(name), stochastic_rounding=False)
                         if name == "nvfp4" else qt.recipe_from_name(name))  # fmt: skip
    twin = copy.deepcopy(layer)
    x = torch.randn(128, 256, generator=gen(4))
    dy = torch.randn(128, 128, generator=gen(5))
    quantizer = copy.deepcopy(layer.input_quantizer).with_usage(rowwise=True, columnwise=True)
    qx = quantizer.quantize(x).requires_grad_(True)
    usages = qx.usages
    y = layer.linear(qx, layer.weight, layer.bias)
    y.backward(dy)
    plain = x.clone().requires_grad_(True)
    want = twin(plain)
    want.backward(dy)
    assert torch.equal(y, want)
    assert torch.equal(qx.grad, plain.grad)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    assert qx.usages == usages


def _counting_input_quantizes(monkeypatch, layer: qt.nn.Linear, rows: int) -> list[int]:
    """A list that grows by one for each quantize of a (rows, K) tensor by the layer's quantizer class."""
    calls: list[int] = []
    cls = type(layer.input_quantizer)
    original = cls._quantize  # below both `quantize` and the layer's unchecked entry

    def quantize(self, x, **kwargs):
        if x.shape[0] == rows:
            calls.append(rows)
        return original(self, x, **kwargs)

    monkeypatch.setattr(cls, "_quantize", quantize)
    return calls


@pytest.mark.parametrize("name", RECIPES)
def test_sibling_layers_share_one_quantized_input(name, monkeypatch):
    """Three layers fed one tensor (q/k/v projections) quantize it once and save one copy of its
    columnwise data, with the outputs and gradients of quantizing it per layer; delayed scaling
    (every layer's own history) quantizes per layer ([Note: sibling layers share one quantized input])."""
    torch.manual_seed(0)
    layers = [qt.nn.Linear(256, 384, recipe=qt.recipe_from_name(name)) for _ in range(3)]
    twins = copy.deepcopy(layers)
    x = torch.randn(2, 32, 256, generator=gen(6)).requires_grad_(True)
    dys = [torch.randn(2, 32, 384, generator=gen(7 + i)) for i in range(3)]
    calls = _counting_input_quantizes(monkeypatch, layers[0], rows=64)
    ys = [layer(x) for layer in layers]
    assert len(calls) == (3 if name == "fp8-delayed" else 1)
    saved = [y.grad_fn.saved_tensors[0] for y in ys]
    assert all(s.rowwise_data is None for s in saved)  # the wgrad GEMM's columnwise data only
    pointers = {s.columnwise_data.untyped_storage().data_ptr() for s in saved}
    assert len(pointers) == (3 if name == "fp8-delayed" else 1)
    for y, dy, layer, twin in zip(ys, dys, layers, twins, strict=True):
        alone = x.detach().clone().requires_grad_(True)  # another tensor: quantized for this layer only
        want = twin(alone)
        got_grads = torch.autograd.grad(y, (x, layer.weight, layer.bias), dy)
        want_grads = torch.autograd.grad(want, (alone, twin.weight, twin.bias), dy)
        assert torch.equal(y, want)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


def test_an_input_modified_in_place_is_quantized_again(monkeypatch):
    layers = [qt.nn.Linear(256, 384, recipe=qt.Float8CurrentScaling()) for _ in range(2)]
    x = torch.randn(64, 256, generator=gen(8))
    calls = _counting_input_quantizes(monkeypatch, layers[0], rows=64)
    layers[0](x)
    x.mul_(3)
    y = layers[1](x)
    assert len(calls) == 2
    assert torch.equal(y, layers[1](x.clone()))


@pytest.mark.parametrize("name", RECIPES)
def test_a_high_precision_weight_is_saved_as_itself(name):
    """[Note: weights recast in backward]: no quantized copy of a high-precision weight lives from
    forward to backward; what is saved besides the parameter and the input's columnwise data is a
    few 0-d tensors (the recast key), and the weight's gradients stay those of the by-hand math
    (test_linear_matches_hand_computation)."""
    layer = qt.nn.Linear(256, 128, recipe=qt.recipe_from_name(name))
    y = layer(torch.randn(64, 256, requires_grad=True))
    saved_x, saved_weight, *key = y.grad_fn.saved_tensors
    assert saved_weight.data_ptr() == layer.weight.data_ptr()
    assert not isinstance(saved_weight, qt.QuantizedTensor)
    assert saved_x.usages == (False, True)
    assert all(t.dim() == 0 for t in key)
    assert len(key) == {"fp8": 2, "fp8-delayed": 2, "nvfp4": 1}.get(name, 0)


def test_a_weight_changed_before_backward_is_refused():
    layer = qt.nn.Linear(256, 128, recipe=qt.Float8CurrentScaling())
    y = layer(torch.randn(64, 256, requires_grad=True))
    with torch.no_grad():
        layer.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("name", RECIPES)
def test_recast_columnwise_is_the_forwards_columnwise_quantization(name):
    """recast_columnwise after quantize_recastable: the bytes and scales of quantizing both usages
    at once, bit for bit; delayed scaling's history advances once, as for one quantize."""
    recipe = qt.recipe_from_name(name)
    once, recastable = recipe.quantizer("weight"), recipe.quantizer("weight")
    if once.state is not None:  # a history with an amax that the current weight's would not reproduce
        for quantizer in (once, recastable):
            quantizer.state.copy_(torch.arange(quantizer.state.numel(), dtype=torch.float32) + 3.0)
    w = torch.randn(256, 128, generator=gen(0)).bfloat16()
    both = once.quantize(w, rowwise=True, columnwise=True)
    rowwise, key = recastable.quantize_recastable(w)
    columnwise = recastable.recast_columnwise(w, key)
    assert rowwise.usages == (True, False)
    assert columnwise.usages == (False, True)

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    for buffer in both.__tensor_flatten__()[0]:
        want = getattr(both, buffer)
        assert same_bits(want, getattr(columnwise if buffer.startswith("columnwise") else rowwise, buffer)), buffer
        if not buffer.startswith("rowwise"):  # scales and amaxes: the columnwise tensor holds them too
            assert same_bits(want, getattr(columnwise, buffer)), buffer
    if once.state is not None:
        assert torch.equal(once.state, recastable.state)


def test_prequantized_input_without_what_the_gemms_need_is_refused():
    layer = qt.nn.Linear(256, 128, recipe=qt.MXFP8BlockScaling())
    rowwise_only = layer.input_quantizer.with_usage(rowwise=True, columnwise=False).quantize(torch.randn(64, 256))
    with pytest.raises(ValueError, match="needs the quantized input's columnwise data.*columnwise=True"):
        layer(rowwise_only)
    three_dims = layer.input_quantizer.with_usage(rowwise=True, columnwise=True).quantize(torch.randn(2, 32, 256))
    with pytest.raises(ValueError, match="quantized input of 2 dims.*x.reshape"):
        layer(three_dims)
    fp8 = qt.nn.Linear(256, 128, recipe=qt.Float8CurrentScaling())
    derivable = fp8.input_quantizer.with_usage(rowwise=True, columnwise=False).quantize(torch.randn(64, 256))
    fp8(derivable).sum().backward()  # per-tensor FP8 derives the columnwise data (a lossless transpose)
    assert fp8.weight.grad is not None


class _QuantizedGradient(torch.autograd.Function):
    """The identity whose backward hands the gradient on quantized (as a sequence-parallel gather does)."""

    @staticmethod
    def forward(ctx, y, quantizer):
        ctx.quantizer = quantizer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.quantizer.quantize(grad), None


@pytest.mark.parametrize("name", RECIPES)
def test_prequantized_gradient_equals_quantizing_inside_the_layer(name):
    torch.manual_seed(0)
    recipe = qt.recipe_from_name(name)
    if name == "nvfp4":  # stochastic rounding would draw from the two quantizers' own streams
        recipe = dataclasses.replace(recipe, stochastic_rounding=False)
    layer = qt.nn.Linear(256, 128, bias=False, recipe=recipe)
    twin = copy.deepcopy(layer)
    x = torch.randn(128, 256, generator=gen(6))
    dy = torch.randn(128, 128, generator=gen(7))
    got_x, want_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    quantizer = copy.deepcopy(layer.grad_output_quantizer).with_usage(rowwise=True, columnwise=True)
    _QuantizedGradient.apply(layer(got_x), quantizer).backward(dy)
    twin(want_x).backward(dy)
    assert torch.equal(got_x.grad, want_x.grad)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    with_bias = qt.nn.Linear(256, 128, recipe=recipe)
    with pytest.raises(ValueError, match="bias gradient is the sum of the high-precision gradient"):
        _QuantizedGradient.apply(with_bias(x), quantizer).backward(dy)


def test_scaled_mm_reports_its_path_and_checks_operands():
    q = qt.Float8CurrentScaling().quantizer("input")
    a, b = q.quantize(torch.randn(64, 128)), q.quantize(torch.randn(32, 128))
    assert qt.ops.scaled_mm_path(a, b) == "emulated"  # no GPU here
    assert qt.ops.scaled_mm(a, b, torch.float32).shape == (64, 32)
    with pytest.raises(ValueError, match="reduction dims differ"):
        qt.ops.scaled_mm(a, b, torch.float32, b_usage="columnwise")
    with pytest.raises(TypeError, match="two QuantizedTensors"):
        qt.ops.scaled_mm(a, torch.randn(32, 128), torch.float32)  # type: ignore[arg-type]
    rowwise_only = (
        qt.Float8CurrentScaling().quantizer("weight").with_usage(columnwise=False).quantize(torch.randn(32, 128))
    )
    with pytest.raises(ValueError, match=r"no columnwise data; call update_usage\(columnwise=True\)"):
        qt.ops.scaled_mm(q.quantize(torch.randn(64, 32)), rowwise_only, torch.float32, b_usage="columnwise")


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_a_gradient_for_the_bias_alone_needs_no_quantized_gradient(name):
    layer = qt.nn.Linear(64, 32, recipe=qt.recipe_from_name(name))
    layer.weight.requires_grad_(False)
    dy = torch.randn(8, 32)
    layer(torch.randn(8, 64)).backward(dy)
    assert torch.equal(layer.bias.grad, dy.sum(dim=0))


FORMAT_PAIRS = [("fp8", "mxfp8"), ("mxfp8", "nvfp4"), ("fp8-block", "fp8"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4")]


@pytest.mark.parametrize(("a_name", "b_name"), FORMAT_PAIRS)
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_scaled_mm_multiplies_operands_of_any_two_formats(a_name, b_name, usage):
    """Each tensor class gives its GEMM operands ([Note: GEMM operand protocol] in quant_tensors._gemm):
    operands of one format or two multiply as their dequantized values do."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((64, 128), (32, 128)) if usage == "rowwise" else ((128, 64), (128, 32))
    a = qt.recipe_from_name(a_name).quantizer("input").quantize(torch.randn(shapes[0], generator=generator))
    b = qt.recipe_from_name(b_name).quantizer("grad_output").quantize(torch.randn(shapes[1], generator=generator))
    bias = torch.randn(32, generator=generator)
    got = qt.ops.scaled_mm(a, b, torch.bfloat16, a_usage=usage, b_usage=usage, bias=bias)
    values = [qt.ops.operand_values(t, usage) for t in (a, b)]
    assert torch.equal(got, (torch.matmul(values[0], values[1].t()) + bias).to(torch.bfloat16))


def test_the_gemm_names_no_format():
    source = inspect.getsource(qt.ops)
    for cls in (qt.Float8Tensor, qt.MXFP8Tensor, qt.Float8BlockwiseTensor, qt.NVFP4Tensor):
        assert cls.__name__ not in source  # the tensor classes' methods choose their operands


def test_unquantizable_weight_falls_back_to_high_precision_with_a_warning():
    with pytest.warns(UserWarning, match="in_features=100 is not a multiple of 128.*computes in high precision"):
        layer = qt.nn.Linear(100, 256, recipe=qt.Float8BlockScaling())
    x = torch.randn(8, 100)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert "high precision" in repr(layer)


def test_linear_rejects_a_non_recipe():
    with pytest.raises(TypeError, match="recipe must be a quant_tensors recipe"):
        qt.nn.Linear(32, 32, recipe="fp8")  # type: ignore[arg-type]


# ---- convert ----------------------------------------------------------------------------------


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    )


def test_convert_swaps_linears_in_place_keeping_parameters_and_names():
    model = small_model()
    names = [name for name, _ in model.named_parameters()]
    weights = [model[0].weight, model[2][0].weight]
    assert qt.convert(model, qt.MXFP8BlockScaling()) is model
    assert type(model[0]) is qt.nn.Linear
    assert type(model[2][0]) is qt.nn.Linear
    assert [name for name, _ in model.named_parameters()] == names
    assert model[0].weight is weights[0]
    assert model[2][0].weight is weights[1]
    assert model[2][0].bias is None


def test_convert_filter_chooses_layers():
    model = qt.convert(small_model(), qt.Float8CurrentScaling(), module_filter_fn=lambda m, name: name != "0")
    assert type(model[0]) is torch.nn.Linear
    assert type(model[2][0]) is qt.nn.Linear


@pytest.mark.parametrize("name", RECIPES)
def test_quantized_weights_keep_their_high_precision_value_once(name):
    torch.manual_seed(0)
    model = small_model()
    original = model[0].weight.detach().clone()
    qt.convert(model, qt.recipe_from_name(name), quantized_weights=True)
    weight = model[0].weight
    assert isinstance(weight, torch.nn.Parameter)
    assert isinstance(weight, qt.QuantizedTensor)
    assert weight.requires_grad
    assert torch.equal(qt.high_precision_init_value(weight), original)
    assert qt.high_precision_init_value(weight) is None  # freed when taken
    expected = qt.recipe_from_name(name).quantizer("weight").quantize(original)
    assert torch.equal(weight.dequantize(), expected.dequantize())


def test_quantized_weight_in_either_form_is_recognised():
    quantized = qt.convert(small_model(), qt.recipe_from_name("fp8-block"), quantized_weights=True)[0].weight
    high_precision = torch.nn.Parameter(torch.randn(128, 128))
    assert qt.nn.is_quantized_weight(quantized)
    assert not qt.nn.is_quantized_weight(high_precision)
    qt.nn.mark_quantized_weight(high_precision)  # e.g. quant-fsdp's alignment fallback
    assert qt.nn.is_quantized_weight(high_precision)
    assert not qt.nn.is_quantized_weight(torch.nn.Parameter(torch.randn(128, 128)))


@pytest.mark.parametrize("name", RECIPES)
def test_meta_device_model_materialises_with_to_empty_and_reset_parameters(name):
    with torch.device("meta"):
        model = small_model()
    qt.convert(model, qt.recipe_from_name(name), quantized_weights=True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model[0], model[2][0]):
        layer.reset_parameters()
    torch.manual_seed(0)
    expected = torch.empty(256, 128)
    torch.nn.init.kaiming_uniform_(expected, a=5**0.5)
    weight = model[0].weight
    assert isinstance(weight, qt.QuantizedTensor)
    assert weight.device.type == "cpu"
    assert torch.equal(qt.high_precision_init_value(weight), expected)
    assert torch.equal(
        weight.dequantize(), qt.recipe_from_name(name).quantizer("weight").quantize(expected).dequantize()
    )


@pytest.mark.parametrize("name", RECIPES)
def test_plain_optimizer_writes_back_through_copy(name):
    # Quantized primary weights without a fused optimizer: step an fp32 master, then p.copy_(master).
    torch.manual_seed(0)
    model = qt.convert(small_model(), qt.recipe_from_name(name), quantized_weights=True)
    weight = model[0].weight
    master = qt.high_precision_init_value(weight).float().requires_grad_(True)
    optimizer = torch.optim.SGD([master], lr=0.1)
    model(torch.randn(16, 128)).square().mean().backward()
    master.grad = weight.grad.float()
    before = weight.dequantize()
    optimizer.step()
    quantizer_before = copy.deepcopy(weight.quantizer)  # delayed scaling: the history as of this write
    with torch.no_grad():
        weight.copy_(master)
    expected = quantizer_before.quantize(master.detach())
    assert torch.equal(weight.dequantize(), expected.dequantize())
    assert not torch.equal(weight.dequantize(), before)  # the step reached the quantized parameter


def test_copy_from_another_format_raises():
    weight = qt.Float8CurrentScaling().quantizer("weight").quantize(torch.randn(128, 128))
    other = qt.MXFP8BlockScaling().quantizer("weight").quantize(torch.randn(128, 128))
    with pytest.raises(ValueError, match="raw copies need the same format"):
        weight.copy_(other)


@pytest.mark.parametrize(("name", "fast"), [("fp8", True), ("fp8", False), ("fp8-delayed", True), ("mxfp8", False)])
def test_only_the_forward_gemm_takes_the_recipes_fast_accumulation(monkeypatch, name, fast):
    recipe = qt.recipe_from_name(name)
    if recipe.fprop_fast_accumulation != fast:
        recipe = dataclasses.replace(recipe, fprop_fast_accumulation=fast)
    layer = qt.nn.Linear(64, 32, recipe=recipe, dtype=torch.bfloat16)
    seen = []

    def spy(a, b, out_dtype, *, a_usage="rowwise", b_usage="rowwise", bias=None, fast_accumulation=False):
        seen.append((a_usage, b_usage, fast_accumulation))
        return qt.ops.scaled_mm(a, b, out_dtype, a_usage=a_usage, b_usage=b_usage, bias=bias)

    def unchecked_spy(a, b, out_dtype, a_usage, b_usage, bias, fast_accumulation, path):
        return spy(a, b, out_dtype, a_usage=a_usage, b_usage=b_usage, bias=bias, fast_accumulation=fast_accumulation)

    monkeypatch.setattr(qt.nn, "scaled_mm", spy)  # the layer's GEMMs of operands quantized by its caller
    monkeypatch.setattr(qt.nn, "scaled_mm_unchecked", unchecked_spy)  # of operands it quantized
    layer(torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert seen == [
        ("rowwise", "rowwise", fast),  # fprop
        ("rowwise", "columnwise", False),  # dgrad
        ("columnwise", "columnwise", False),  # wgrad
    ]


@pytest.mark.parametrize("fast", [False, True])
def test_scaled_mm_hands_fast_accumulation_to_torch_scaled_mm(monkeypatch, fast):
    # The hardware path on this CPU machine (torch._scaled_mm runs on CPU tensors too): the flag
    # reaches the kernel call for per-tensor FP8, and its result is the call's.
    calls = []
    original = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs["use_fast_accum"])
        return original(*args, **kwargs)

    monkeypatch.setattr(qt.ops, "scaled_mm_path", lambda *args, **kwargs: "torch._scaled_mm")
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    recipe = qt.Float8CurrentScaling()
    a = recipe.quantizer("input").quantize(torch.randn(32, 64, generator=gen(0)))
    b = recipe.quantizer("weight").quantize(torch.randn(48, 64, generator=gen(1)))
    out = qt.ops.scaled_mm(a, b, torch.bfloat16, fast_accumulation=fast)
    assert calls == [fast]
    assert out.shape == (32, 48)
