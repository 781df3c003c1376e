"""Compiled kernels "inductor" ([Note: kernels Inductor fuses] in quant_core._library): the
operators with a fused kernel trace as torch ops that Inductor fuses with their neighbours, and
every result is eager's bit for bit; the switch, its environment variable and the compile
caches' tag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import quant_core
from quant_core import _library
from quant_core.testing import adversarial, assert_results_bitwise_equal, tracing_fused_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FUSED_OPS = ("quantize_fp8", "quantize_mxfp8", "dequantize_mxfp8", "dequantize_mxfp8_pair", "quantize_fp8_blockwise")


def _fp8(x: torch.Tensor) -> object:
    q = quant_core.quantize_fp8(x, E4M3, rowwise=True, columnwise=True)
    given = quant_core.quantize_fp8(x, E5M2, amax=torch.tensor(3.0, device=x.device))
    return q, given


def _mxfp8(x: torch.Tensor) -> object:
    q = quant_core.quantize_mxfp8(x, rowwise=True, columnwise=True)
    rowwise, columnwise = quant_core.dequantize_mxfp8_pair(
        q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv, torch.bfloat16
    )
    return q, rowwise, columnwise, quant_core.dequantize_mxfp8(q.columnwise_data, q.columnwise_scale_inv)


def _blockwise(x: torch.Tensor) -> object:
    activations = quant_core.quantize_fp8_blockwise(x, (1, 128), rowwise=True, columnwise=True)
    gradients = quant_core.quantize_fp8_blockwise(x, (1, 128), E5M2, rowwise=False, columnwise=True)
    weights = quant_core.quantize_fp8_blockwise(x, (128, 128), rowwise=True, columnwise=True)
    columnwise_only = quant_core.quantize_fp8_blockwise(x, (128, 128), E5M2, rowwise=False, columnwise=True)
    divided = quant_core.quantize_fp8_blockwise(x, (1, 128), power_2_scales=False, columnwise=True)  # not fused
    return activations, gradients, weights, columnwise_only, divided


def test_every_fused_op_has_its_kernel():
    assert {name for name, op in _library.OPERATORS.items() if op.fused_kernel is not None} == set(FUSED_OPS)


# The fused kernels' arithmetic, traced and run by aot_eager (no code generation): eager's bits for
# every dtype, with blocks that tile x (the blocked path) or leave partial edge blocks (the
# reference's padded path) along either dim, specials and 16 decades of magnitudes included.
SHAPES = {
    "tiled": (96, 320),
    "tiled-128": (256, 384),
    "partial-rows": (200, 320),
    "partial-columns": (96, 328),
    "partial": (200, 328),
}


@pytest.mark.parametrize("shape", [*SHAPES.values(), (3, 5, 64)], ids=[*SHAPES, "3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp16 quantizes keep their operators
@pytest.mark.parametrize("case", [_fp8, _mxfp8, _blockwise], ids=["fp8", "mxfp8", "blockwise"])
def test_fused_kernels_equal_eager(case, dtype, shape):
    x = adversarial(shape, dtype)
    torch._dynamo.reset()
    with quant_core.use_compiled_kernels("inductor"), tracing_fused_kernels() as traced:
        got = torch.compile(case, backend="aot_eager", fullgraph=True)(x)
    assert traced[{_fp8: "quantize_fp8", _mxfp8: "quantize_mxfp8", _blockwise: "quantize_fp8_blockwise"}[case]] > 0
    assert_results_bitwise_equal(got, case(x))


# On the GPU, Inductor generates Triton code of its own for these torch ops (its fp32 -> FP8
# casts, its multiplies, with FMA contraction allowed and no div_rn): the fused kernels' results
# there equal eager's (quant-core's Triton kernels) bit for bit, specials and tiny scales included.
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [SHAPES["tiled-128"], SHAPES["partial"]], ids=["tiled-128", "partial"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", [_fp8, _mxfp8, _blockwise], ids=["fp8", "mxfp8", "blockwise"])
def test_inductor_kernels_on_cuda_equal_eager(case, dtype, shape):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    from torch._inductor.utils import fresh_cache

    x = adversarial(shape, dtype).cuda()
    torch._dynamo.reset()
    with quant_core.use_compiled_kernels("inductor"), fresh_cache(), tracing_fused_kernels() as traced:
        got = torch.compile(lambda t: case(t * 1), fullgraph=True)(x)  # `* 1`: a producer to fuse with
    assert sum(traced.values()) > 0
    assert_results_bitwise_equal(got, case(x * 1))


def _bf16_producer(x: torch.Tensor) -> torch.Tensor:
    """One rounding to bf16 per element, in eager and compiled alike, unless Inductor fuses the
    consumer and elides it."""
    return x * 1.7


def _kernels_and_operators(code: str) -> tuple[set[str], set[str]]:
    """Inductor's kernels and the quant_core operators called in a graph's generated code."""
    return set(re.findall(r"\bcpp_fused_\w+", code)), set(re.findall(r"torch\.ops\.quant_core\.(\w+)", code))


# Inductor fuses the producer, the quantize and (MXFP8) the dequantize into one kernel (with
# quant-core's kernels, Inductor's kernel writes the product for an operator to read), and the
# codes equal eager's, which reads the rounded bf16 tensor from memory: the fused kernel rounds
# again what Inductor left unrounded (without `bf16_rounded` 214 of these FP8 codes and 597 MXFP8
# values differ). Per-tensor FP8 takes its scale from the fp8_scale operator (a division) between
# the amax and the cast, each fused with the producer; blockwise FP8 with fmax / amax scales and
# an fp16 input (whose elided rounding is not redone: 122 values would differ) keep their operators.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_fuses_the_quantize_into_its_producer_and_equals_eager():
    from torch._inductor.utils import fresh_cache, run_and_get_code

    def fp8(x: torch.Tensor) -> object:
        return quant_core.quantize_fp8(_bf16_producer(x), E4M3, rowwise=True, columnwise=True)

    def mxfp8(x: torch.Tensor) -> object:
        q = quant_core.quantize_mxfp8(_bf16_producer(x), rowwise=True, columnwise=False)
        return quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv, torch.bfloat16)

    def blockwise(x: torch.Tensor) -> object:
        return quant_core.quantize_fp8_blockwise(_bf16_producer(x), (1, 128), rowwise=True, columnwise=False)

    def blockwise_divided(x: torch.Tensor) -> object:
        return quant_core.quantize_fp8_blockwise(_bf16_producer(x), (1, 128), power_2_scales=False)

    expected = [  # (case, input dtype, Inductor kernels each holding the producer, quant_core operators left)
        (fp8, torch.bfloat16, 2, {"fp8_scale"}),
        (mxfp8, torch.bfloat16, 1, set()),
        (blockwise, torch.bfloat16, 1, set()),
        (blockwise_divided, torch.bfloat16, 1, {"quantize_fp8_blockwise"}),
        (mxfp8, torch.float16, None, {"quantize_mxfp8"}),  # fp16's elided rounding is not redone
    ]
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    for case, dtype, num_kernels, operators in expected:
        torch._dynamo.reset()
        # A fresh cache: a graph cached while quant-core's fused kernels were edited is not theirs.
        with quant_core.use_compiled_kernels("inductor"), fresh_cache():
            got, code = run_and_get_code(torch.compile(case, fullgraph=True), x.to(dtype))
        assert_results_bitwise_equal(got, case(x.to(dtype)))
        kernels, called = _kernels_and_operators("\n".join(code))
        assert called == operators, case.__name__
        if num_kernels is not None:
            assert len(kernels) == num_kernels, (case.__name__, kernels)
            assert all("mul" in kernel for kernel in kernels), kernels


# torch's compile caches tell the two choices apart (the cache tag): one cache directory, a graph
# compiled with each choice after the other, both ways.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_each_choice_compiles_its_own_graph_from_one_cache():
    from torch._inductor.utils import fresh_cache, run_and_get_code

    def f(x: torch.Tensor) -> torch.Tensor:
        q = quant_core.quantize_mxfp8(x * 1.7)
        return quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv, torch.bfloat16)

    x = torch.ones(64, 64, dtype=torch.bfloat16)
    operators_left = []
    with fresh_cache():
        for kind in ("quant-core", "inductor", "quant-core"):
            torch._dynamo.reset()
            with quant_core.use_compiled_kernels(kind):
                _, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
            operators_left.append("torch.ops.quant_core" in "\n".join(code))
    assert operators_left == [True, False, True]


def test_the_switch_its_variable_and_the_cache_tag():
    assert quant_core.compiled_kernels() == "quant-core"
    before = torch.compiler.config.cache_key_tag
    assert before.endswith(f"quant-core-{quant_core.__version__}")
    with quant_core.use_compiled_kernels("inductor"):
        assert quant_core.compiled_kernels() == "inductor"
        assert torch.compiler.config.cache_key_tag == f"{before},quant-core-compiled-kernels=inductor"
        with quant_core.use_compiled_kernels("quant-core"):
            assert torch.compiler.config.cache_key_tag == before
        assert quant_core.compiled_kernels() == "inductor"
    assert (quant_core.compiled_kernels(), torch.compiler.config.cache_key_tag) == ("quant-core", before)
    message = "use_compiled_kernels\\('triton'\\) is not one of 'quant-core', 'inductor'"
    with pytest.raises(ValueError, match=message), quant_core.use_compiled_kernels("triton"):  # type: ignore[arg-type]
        pass
    assert quant_core.compiled_kernels() == "quant-core"


@pytest.mark.parametrize(
    ("value", "printed"),
    [(" Inductor ", "inductor user-tag,quant-core-{v},quant-core-compiled-kernels=inductor"), ("fused", None)],
)
def test_the_variable_is_read_at_import(value, printed):
    code = "import torch, quant_core; print(quant_core.compiled_kernels(), torch.compiler.config.cache_key_tag)"
    env = {
        **os.environ,
        "QUANT_CORE_COMPILED_KERNELS": value,
        "TORCH_COMPILE_CACHE_KEY_TAG": "user-tag",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if printed is None:
        assert run.returncode != 0
        assert "QUANT_CORE_COMPILED_KERNELS='fused' is not one of 'quant-core', 'inductor'" in run.stderr
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == printed.format(v=quant_core.__version__)


def test_a_forced_backend_wins_over_the_fused_kernels():
    def f(x: torch.Tensor) -> object:
        return quant_core.quantize_mxfp8(x * 2)

    x = adversarial((64, 64), torch.bfloat16)
    torch._dynamo.reset()
    with quant_core.use_compiled_kernels("inductor"), quant_core.use_backend("reference"):
        graph_ops: list[str] = []

        def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
            from torch._functorch.aot_autograd import aot_module_simplified

            def record(g: torch.fx.GraphModule, _: object) -> object:
                for node in g.graph.nodes:  # a mutating operator is wrapped by auto_functionalized
                    if node.op == "call_function":
                        functionalized = "auto_functionalized" in str(node.target)
                        graph_ops.append(str(node.args[0] if functionalized else node.target))
                return g.forward

            return aot_module_simplified(gm, inputs, fw_compiler=record)

        got = torch.compile(f, backend=backend, fullgraph=True)(x)
    assert "quant_core.quantize_mxfp8.default" in graph_ops  # the reference stays an opaque operator
    assert_results_bitwise_equal(got, f(x))
