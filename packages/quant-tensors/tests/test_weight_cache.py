"""qt.nn.weight_cache: high-precision weights quantized once per weight version across the
micro-batches of a step ([Note: weight cache across micro-batches] in quant_tensors.nn)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import quant_tensors as qt

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
STATELESS = ("fp8", "mxfp8", "fp8-block", "nvfp4")
STEPS, MICRO_BATCHES = 2, 3


def _model(name: str, *, quantized_weights: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    return qt.convert(layers, qt.recipe_from_name(name), quantized_weights=quantized_weights)


def _train(model: torch.nn.Module, *, cached: bool) -> list[torch.Tensor]:
    """STEPS SGD steps of MICRO_BATCHES accumulated micro-batches; every output, input gradient,
    then the parameters and buffers at the end."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(STEPS, MICRO_BATCHES, 32, 128, generator=torch.Generator().manual_seed(1))
    seen = []
    for step in range(STEPS):
        with qt.nn.weight_cache(model) if cached else contextlib.nullcontext():
            for micro_batch in range(MICRO_BATCHES):
                x = inputs[step, micro_batch].clone().requires_grad_(True)
                y = model(x)
                y.square().mean().backward()
                seen += [y.detach(), x.grad]
        optimizer.step()
        optimizer.zero_grad()
    return seen + [p.detach() for p in model.parameters()] + list(model.buffers())


def _count_weight_quantizations(monkeypatch, model: torch.nn.Module) -> list[int]:
    """Counts weight quantizations: the weight quantizers' outermost `_quantize` (below `quantize`
    and the layer's unchecked calls), `_quantize_recastable` or `_recast_columnwise` calls (the last
    two may call `_quantize` themselves)."""
    calls, depth = [0], [0]
    weight_quantizers = {id(m.weight_quantizer) for m in model.modules() if isinstance(m, qt.nn.Linear)}
    for method in ("_quantize", "_quantize_recastable", "_recast_columnwise"):
        for cls in {type(m.weight_quantizer) for m in model.modules() if isinstance(m, qt.nn.Linear)}:
            original = getattr(cls, method)

            def counted(self, *args, _original=original, **kwargs):
                calls[0] += id(self) in weight_quantizers and depth[0] == 0
                depth[0] += 1
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    depth[0] -= 1

            monkeypatch.setattr(cls, method, counted)
    return calls


@pytest.mark.parametrize("name", STATELESS)
def test_cached_training_equals_quantizing_every_micro_batch(name):
    uncached, cached = _train(_model(name), cached=False), _train(_model(name), cached=True)
    assert all(torch.equal(a, b) for a, b in zip(uncached, cached, strict=True))


@pytest.mark.parametrize("name", RECIPES)
def test_each_weight_is_quantized_once_per_version(monkeypatch, name):
    model = _model(name)
    calls = _count_weight_quantizations(monkeypatch, model)
    _train(model, cached=True)
    assert calls[0] == 2 * STEPS  # two layers, one quantization (both usages) each per optimizer step
    calls[0] = 0
    _train(model, cached=False)
    assert calls[0] == 2 * STEPS * MICRO_BATCHES * 2  # each forward's, and each backward's recast


def test_delayed_scaling_records_one_weight_amax_per_version():
    model = _model("fp8-delayed")
    _train(model, cached=True)
    for layer in (model[0], model[2]):
        weight_history = layer.weight_quantizer_state
        assert int((weight_history != 0).sum()) == STEPS
        assert int((layer.input_quantizer_state != 0).sum()) == STEPS * MICRO_BATCHES  # activations: every forward


def test_an_in_place_weight_change_inside_the_block_is_quantized_again():
    cached, fresh = _model("fp8"), _model("fp8")
    x = torch.randn(32, 128)
    with qt.nn.weight_cache(cached):
        cached(x)
        for model in (cached, fresh):
            with torch.no_grad():
                model[0].weight.mul_(3.0)
        assert torch.equal(cached(x), fresh(x))


def test_the_block_drops_its_quantizations_on_exit_even_after_an_error():
    model = _model("fp8")
    kept = []

    def train_then_fail() -> None:
        with qt.nn.weight_cache(model):
            model(torch.randn(32, 128, requires_grad=True)).sum().backward()
            kept.append(weakref.ref(model[0]._weight_cache["weight"]))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train_then_fail()
    gc.collect()
    assert kept[0]() is None
    assert model[0]._weight_cache is None
    assert model[2]._weight_cache is None


def test_no_grad_keeps_rowwise_only_until_a_gradient_needs_columnwise():
    model = _model("mxfp8")
    with qt.nn.weight_cache(model):
        with torch.no_grad():
            model(torch.randn(32, 128))
        assert model[0]._weight_cache["weight"].usages == (True, False)
        x = torch.randn(32, 128, requires_grad=True)
        y = model(x)
        assert model[0]._weight_cache["weight"].usages == (True, True)
        y.sum().backward()
    reference = _model("mxfp8")
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(model[0].weight.grad, reference[0].weight.grad)


def test_an_inference_loop_quantizes_each_weight_once(monkeypatch):
    model = _model("nvfp4")
    x = torch.randn(4, 128)
    expected = model(x).detach()
    calls = _count_weight_quantizations(monkeypatch, model)
    with qt.nn.weight_cache(model), torch.inference_mode():
        outputs = [model(x) for _ in range(3)]
    assert calls[0] == 2  # two layers, once each
    assert all(torch.equal(y, expected) for y in outputs)


def test_quantized_weights_are_used_as_they_are():
    model = _model("fp8", quantized_weights=True)
    with qt.nn.weight_cache(model):
        model(torch.randn(32, 128, requires_grad=True)).sum().backward()
        assert model[0]._weight_cache == {}


def test_nested_blocks_are_refused():
    model = _model("fp8")
    with (
        qt.nn.weight_cache(model),
        pytest.raises(RuntimeError, match="already inside a weight_cache block"),
        qt.nn.weight_cache(model[0]),
    ):
        pass


def test_dtensor_weights_are_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model("fp8")
        mesh = init_device_mesh("cpu", (1,))
        model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
        with (
            pytest.raises(ValueError, match=r"layer '0' has a DTensor weight .*quantize_on_gather=True"),
            qt.nn.weight_cache(model),
        ):
            pass
        assert model[2]._weight_cache is None  # refused before anything was set up
    finally:
        dist.destroy_process_group()


def test_compiled_models_do_not_read_the_cache():
    model = _model("fp8")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 128)
    expected = model(x)
    with qt.nn.weight_cache(model):
        assert torch.equal(compiled(x), expected)
        assert model[0]._weight_cache == {}  # the graph quantized; nothing was kept
