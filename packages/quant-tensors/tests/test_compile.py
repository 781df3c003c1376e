"""torch.compile over qt.nn.Linear: every recipe, high-precision and quantized weights, no graph
breaks inside the layer, and eager's numbers ([Note: qt.nn.Linear under torch.compile])."""

from __future__ import annotations

import copy

import pytest
import torch

import quant_core
import quant_tensors as qt
from quant_core.testing import tracing_fused_kernels

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _model(name: str, quantized_weights: bool, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128, bias=False)).to(device)
    return qt.convert(model, qt.recipe_from_name(name), quantized_weights=quantized_weights)


def _run(model: torch.nn.Module, forward, steps: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, input gradient) of `steps` forward/backward passes. No optimizer: the weights stay,
    the quantizer states (histories, counters) advance."""
    results = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x = (torch.randn(4, 32, 128, generator=generator) * 4**step).to(device).requires_grad_(True)
        dy = (torch.randn(4, 32, 128, generator=generator) / 4**step).to(device)
        y = forward(x)
        y.backward(dy)
        results.append((y.detach(), x.grad))
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantized_weights", [False, True], ids=["hp-weights", "quantized-weights"])
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_layers_equal_eager_bitwise_across_steps(name, quantized_weights, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    torch._dynamo.reset()
    eager = _model(name, quantized_weights, device)
    compiled = copy.deepcopy(eager)
    expected = _run(eager, eager, 3, device)
    got = _run(compiled, torch.compile(compiled, fullgraph=True), 3, device)
    # Only qt.nn.Linear layers: the same quant-core kernels run, so quantizer states (delayed
    # histories, stochastic-rounding counters) are bitwise eager's, step after step, and so are
    # outputs and gradients where the same GEMM kernels run: on the CPU, and on CUDA for per-tensor
    # FP8 (torch._scaled_mm). On CUDA the other formats' bf16 tensor-core GEMMs (qt.ops,
    # [Note: exact bf16 operands]) may be chosen differently by Inductor: the same products summed
    # in another order, within a bf16 ulp or two.
    exact = device == "cpu" or name in ("fp8", "fp8-delayed")
    for step, ((y, dx), (compiled_y, compiled_dx)) in enumerate(zip(expected, got, strict=True)):
        for got_value, want in ((compiled_y, y), (compiled_dx, dx)):
            if exact:
                assert torch.equal(got_value, want), step
            else:
                torch.testing.assert_close(got_value, want, rtol=2**-7, atol=1e-5)
    compiled_states = dict(compiled.named_buffers())
    for key, state in eager.named_buffers():
        assert torch.equal(state, compiled_states[key]), key


@pytest.mark.parametrize("name", RECIPES)
def test_no_graph_break_inside_the_layer(name):
    torch._dynamo.reset()
    layer = qt.nn.Linear(128, 128, recipe=qt.recipe_from_name(name))
    explanation = torch._dynamo.explain(layer)(torch.randn(16, 128, requires_grad=True))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_equal_layers_share_compiled_code():
    # Quantizers compare by value, so a second layer of the same recipe reuses the first's graph.
    torch._dynamo.reset()
    layers = [qt.nn.Linear(128, 128, recipe=qt.Float8DelayedScaling()) for _ in range(3)]
    counts = torch._dynamo.utils.counters
    counts.clear()

    @torch.compile(fullgraph=True)
    def run(layer: qt.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    for layer in layers:
        run(layer, torch.randn(16, 128))
    assert counts["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("quantized_weights", [False, True], ids=["hp-weights", "quantized-weights"])
@pytest.mark.parametrize("name", ["fp8", "mxfp8", "fp8-block", "nvfp4"])
def test_compiled_layers_recompute_input_codes_rather_than_save_them(name, quantized_weights, monkeypatch):
    # [Note: recomputed quantizations] in quant_core._recompute. Delayed scaling is left out: its
    # quantize writes the amax history (a module buffer), so its codes stay saved.
    import torch._inductor.compile_fx as compile_fx

    partition = compile_fx.min_cut_rematerialization_partition
    saved: list[torch.Tensor] = []

    def recording(joint, inputs, **kwargs):
        forward, backward = partition(joint, inputs, **kwargs)
        outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        saved.extend(
            o.meta["val"]
            for o in outputs
            if isinstance(o.meta.get("val") if hasattr(o, "meta") else None, torch.Tensor)
        )
        return forward, backward

    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", recording)
    torch._dynamo.reset()
    model = _model(name, quantized_weights, "cpu")
    x = torch.randn(4, 96, 128, requires_grad=True)  # 384 tokens: a dim no weight has
    torch.compile(model, fullgraph=True)(x).sum().backward()
    codes = [tuple(t.shape) for t in saved if t.element_size() == 1 and {384, 192} & set(t.shape)]
    assert saved
    assert not codes, f"the compiled layers save the codes or scales of their inputs: {codes}"


@pytest.mark.parametrize("quantized_weights", [False, True])
@pytest.mark.parametrize("name", ["fp8", "fp8-delayed", "nvfp4"])
def test_compiled_layers_measure_per_tensor_amaxes_as_torch_ops(name, quantized_weights):
    # [Note: fused FP8 quantize] in quant_core: under torch.compile a per-tensor quantize not given
    # an amax gets x's from torch ops, which Inductor fuses into the kernel producing x, rather
    # than from the amax operator or a measuring step inside the quantize operator. With quantized
    # weights the input is quantized inside the weight's __torch_dispatch__, which AOTAutograd
    # traces (`quant_core.compiling`).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.Graph] = []

    def record(module: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(module.graph)
        return make_boxed_func(module.forward)

    torch._dynamo.reset()
    layer = qt.convert(
        torch.nn.Sequential(torch.nn.Linear(128, 128)), qt.recipe_from_name(name), quantized_weights=quantized_weights
    )
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(16, 128, requires_grad=True)).sum().backward()
    assert len(graphs) == 2  # forward and backward
    nodes = [node for graph in graphs for node in graph.nodes if node.op == "call_function"]
    operators = {}
    for node in nodes:  # quant_core's operators, those that fill buffers through auto_functionalized
        target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
        operators.setdefault(str(target).removesuffix(".default"), []).append(node)
    assert "quant_core.amax" not in operators
    quantizes = [
        node
        for op in ("quantize_fp8", "quantize_fp8_delayed", "quantize_nvfp4")
        for node in operators.get(f"quant_core.{op}", [])
    ]
    # x and (not quantized already) the weight in the forward, the output gradient in the
    # backward (NVFP4 also recasts a high-precision weight there, with the forward's amax)
    assert len(quantizes) >= (2 if quantized_weights else 3)
    for node in quantizes:
        amax = node.kwargs.get("amax", node.kwargs.get("global_amax"))
        assert isinstance(amax, torch.fx.Node), node.format_node()
    assert any(node.target == torch.ops.aten.amax.default for node in nodes)


# Compiled kernels "inductor" ([Note: kernels Inductor fuses] in quant_core._library): the
# quantizes (and MXFP8's dequantizes) are traced as torch ops that Inductor fuses with the ops
# beside them; here the first layer's output rounding to bf16, which Inductor elides when it fuses
# the second layer's quantize with it (forward, and the same for the gradients in the backward),
# and the results stay eager's bit for bit, step after step.
FUSED_RECIPES = [("fp8", False), ("mxfp8", True)]  # the GEMM of codes, and the one of dequantized values


def _bf16_steps(forward, steps: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    results = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x = (torch.randn(4, 32, 128, generator=generator) * 4**step).to(device, torch.bfloat16).requires_grad_(True)
        dy = (torch.randn(4, 32, 128, generator=generator) / 4**step).to(device, torch.bfloat16)
        y = forward(x)
        y.backward(dy)
        results.append((y.detach(), x.grad))
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "quantized_weights"), FUSED_RECIPES)
def test_inductor_kernels_equal_eager_bitwise_across_steps(name, quantized_weights, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128, bias=False))
    model = model.to(device=device, dtype=torch.bfloat16)
    eager = qt.convert(model, qt.recipe_from_name(name), quantized_weights=quantized_weights)
    compiled = copy.deepcopy(eager)
    expected = _bf16_steps(eager, 3, device)
    with quant_core.use_compiled_kernels("inductor"), fresh_cache(), tracing_fused_kernels() as traced:
        got = _bf16_steps(torch.compile(compiled, fullgraph=True), 3, device)
    assert traced[{"fp8": "quantize_fp8", "mxfp8": "quantize_mxfp8"}[name]] > 0  # the fused kernels ran
    # As in the test above: on CUDA only per-tensor FP8 runs the same GEMM kernels as eager.
    exact = device == "cpu" or name == "fp8"
    pairs = [(g, w) for (y, dx), (cy, cdx) in zip(expected, got, strict=True) for g, w in ((cy, y), (cdx, dx))]
    pairs += [(q.grad, p.grad) for p, q in zip(eager.parameters(), compiled.parameters(), strict=True) if p.dim() == 2]
    for got_value, want in pairs:  # weights' gradients too; a bias sums its gradient in Inductor's order
        if exact:
            assert torch.equal(got_value, want)
        else:
            torch.testing.assert_close(got_value, want, rtol=2**-7, atol=1e-5)
