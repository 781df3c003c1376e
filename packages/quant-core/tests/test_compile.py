"""The public functions trace under torch.compile(fullgraph=True) into one graph holding the
torch.ops.quant_core operators, and the compiled results equal eager bit for bit.

The cases compile with the aot_eager backend (Dynamo, fake kernels, functionalization: what
tracing needs, in well under a second each); the Inductor tests run in the GPU suite, except the
CPU case of the traced amax's (one compile, ~5 s of CPU).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import quant_core
from quant_core.testing import adversarial, assert_results_bitwise_equal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _per_tensor_cast(x: torch.Tensor, seed: torch.Tensor) -> object:
    scale, scale_inv = quant_core.fp8_scale(quant_core.amax(x), E4M3)
    return quant_core.cast_to_fp8(x, scale, E4M3, rowwise=True, columnwise=True), scale_inv


def _delayed(x: torch.Tensor, seed: torch.Tensor) -> object:
    history = torch.tensor([3.0, 700.0, 0.0], device=x.device)
    scale, _ = quant_core.fp8_scale(quant_core.amax_from_history(history), E5M2, margin=1, power_2_scales=True)
    codes = quant_core.cast_to_fp8(x, scale, E5M2)
    return codes, quant_core.push_amax_(history, quant_core.amax(x))


def _delayed_in_one_operator(x: torch.Tensor, seed: torch.Tensor) -> object:
    history = torch.tensor([3.0, 700.0, 0.0], device=x.device)
    scale, scale_inv = quant_core.delayed_fp8_scale_(history, quant_core.amax(x), E5M2, margin=-2)
    return quant_core.cast_to_fp8(x, scale, E5M2), scale_inv, history


def _quantize_into(x: torch.Tensor, seed: torch.Tensor) -> object:
    rowwise, scale_inv = torch.empty(x.shape, dtype=E4M3, device=x.device), torch.empty((), device=x.device)
    amax = torch.tensor(100.0, device=x.device)
    quant_core.quantize_fp8_into(x, E4M3, rowwise_out=rowwise, scale_inv_out=scale_inv, amax=amax)
    history = torch.zeros(4, device=x.device)
    columnwise = torch.empty(x.shape[::-1], dtype=E5M2, device=x.device)
    delayed_scale_inv = torch.empty((), device=x.device)
    quant_core.quantize_fp8_delayed_into(
        x, history, E5M2, columnwise_out=columnwise, scale_inv_out=delayed_scale_inv, power_2_scales=True
    )
    return rowwise, scale_inv, columnwise, delayed_scale_inv, history


def _fp8_round_trip(x: torch.Tensor, seed: torch.Tensor) -> object:
    q = quant_core.quantize_fp8(x, columnwise=True)
    return (
        q,
        quant_core.dequantize_fp8(q.columnwise_data, q.scale_inv, torch.bfloat16),
        quant_core.transpose_fp8(q.rowwise_data),
    )


def _mxfp8(x: torch.Tensor, seed: torch.Tensor) -> object:
    q = quant_core.quantize_mxfp8(x, columnwise=True)
    return q, quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv)


def _blockwise(block_shape: tuple[int, int]) -> Callable[[torch.Tensor, torch.Tensor], object]:
    def run(x: torch.Tensor, seed: torch.Tensor) -> object:
        q = quant_core.quantize_fp8_blockwise(x, block_shape, columnwise=True)
        values = quant_core.dequantize_fp8_blockwise(q.columnwise_data, q.columnwise_scale_inv, block_shape)
        if block_shape[0] == 1:
            return q, values
        return q, values, quant_core.transpose_fp8_blockwise(q.rowwise_data, q.rowwise_scale_inv)

    return run


def _quantize_many(x: torch.Tensor, seed: torch.Tensor) -> object:
    # Refills in place: the operator's buffer lists are graph inputs mutated, as for one tensor.
    mxfp8 = [quant_core.quantize_mxfp8(x * 0, columnwise=True), quant_core.quantize_mxfp8(x[:3].float() * 0)]
    quant_core.quantize_mxfp8_many([x, x[:3].float()], mxfp8)
    blockwise = [quant_core.quantize_fp8_blockwise(x.t() * 0, (128, 128), E5M2, rowwise=False, columnwise=True)]
    quant_core.quantize_fp8_blockwise_many([x.t()], blockwise, (128, 128), E5M2)
    return mxfp8, blockwise


def _nvfp4(block_shape: tuple[int, int], stochastic_rounding: bool) -> Callable[[torch.Tensor, torch.Tensor], object]:
    def run(x: torch.Tensor, seed: torch.Tensor) -> object:
        q = quant_core.quantize_nvfp4(
            x, block_shape, columnwise=True, stochastic_rounding=stochastic_rounding, seed=seed
        )
        values = quant_core.dequantize_nvfp4(q.rowwise_data, q.rowwise_scale_inv, q.amax, block_shape, torch.bfloat16)
        if block_shape[0] == 1:
            return q, values
        return q, values, quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)

    return run


def _nvfp4_hadamard(x: torch.Tensor, seed: torch.Tensor) -> object:
    # [Note: NVFP4 random Hadamard transform]: both amaxes in one operator, the transformed
    # columnwise usage, and its values mapped back by the inverse.
    amaxes = quant_core.hadamard_amaxes(x, 2**63 + 5)
    q = quant_core.quantize_nvfp4(
        x, columnwise=True, stochastic_rounding=True, seed=seed, hadamard_seed=2**63 + 5, global_amax=amaxes[0],
        columnwise_amax=amaxes[1],
    )  # fmt: skip
    values = quant_core.dequantize_nvfp4(q.columnwise_data, q.columnwise_scale_inv, q.columnwise_amax)
    return q, quant_core.hadamard_inverse_16(values, 2**63 + 5)


def _chunks(x: torch.Tensor, seed: torch.Tensor) -> object:
    # [Note: FP8 chunk rows]: 4 chunks of 2560 elements in blocks of 32, stochastic rounding with
    # the seed tensor as counter, error feedback on a residual made in the graph.
    residual = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
    rows = quant_core.quantize_fp8_chunks(x, 4, 32, stochastic_rounding=True, seed=7, counter=seed, residual=residual)
    return rows, residual, quant_core.dequantize_sum_fp8_chunks(rows, x.numel() // 4, 32, average=True, dtype=x.dtype)


def _others(x: torch.Tensor, seed: torch.Tensor) -> object:
    return quant_core.hadamard_transform_16(x, 2**64 - 3), quant_core.has_non_finite([x, x[:0]])


CASES: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "amax": lambda x, seed: quant_core.amax(x),
    "amax_many": lambda x, seed: quant_core.amax_many([x, x.t(), x[:0], x.float()[::2], x[0, 0]]),
    "fp8_scale+cast_to_fp8": _per_tensor_cast,
    "delayed_scaling": _delayed,
    "delayed_fp8_scale_": _delayed_in_one_operator,
    "quantize_fp8_into": _quantize_into,
    "quantize_fp8": _fp8_round_trip,
    "mxfp8": _mxfp8,
    "blockwise_1x128": _blockwise((1, 128)),
    "blockwise_128x128": _blockwise((128, 128)),
    "quantize_many": _quantize_many,
    "nvfp4_1x16": _nvfp4((1, 16), False),
    "nvfp4_16x16_stochastic": _nvfp4((16, 16), True),
    "nvfp4_hadamard": _nvfp4_hadamard,
    "fp8_chunks": _chunks,
    "hadamard+has_non_finite": _others,
}


def _quant_core_calls(counter: CompileCounterWithBackend) -> set[str]:
    return {
        str(node.target)
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("quant_core.")
    }


@pytest.mark.parametrize("name", CASES)
def test_public_functions_compile_to_one_graph_and_equal_eager(name):
    # (64, 160): partial blocks at the edges of every format (160 = 128 + 32, 64 < 128).
    x = adversarial((64, 160), torch.bfloat16, seed=len(name))
    seed = torch.tensor(2**62 + 1)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(CASES[name], backend=counter, fullgraph=True)(x, seed)
    assert counter.frame_count == 1
    assert _quant_core_calls(counter), "the kernels must be operators in the graph, not traced through"
    assert_results_bitwise_equal(got, CASES[name](x, seed))


def test_quantize_compiles_to_one_operator_and_updates_the_history_as_eager():
    # [Note: fused FP8 quantize]: scale (current or delayed: history read, then pushed) and cast
    # are one node each, given x's amax as torch ops; the history is a graph input mutated in
    # place, step after step.
    def quantize(x: torch.Tensor, history: torch.Tensor) -> object:
        current = quant_core.quantize_fp8(x, E4M3, columnwise=True)
        delayed = quant_core.quantize_fp8_delayed(x, history, E5M2, margin=1, columnwise=True)
        return current, delayed

    targets = [str(node.target).removesuffix(".default") for node in _quant_core_calls_compiled_like_eager(quantize)]
    assert targets == ["quant_core.quantize_fp8", "quant_core.quantize_fp8_delayed"]


def _quant_core_calls_compiled_like_eager(quantize: Callable[..., object]) -> list[torch.fx.Node]:
    """The quant_core operator nodes of `quantize(x, history)` compiled (aot_eager, one graph),
    after checking over 3 steps that its results and the history it updates equal eager's."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(quantize, backend=counter, fullgraph=True)
    history, eager_history = torch.zeros(3), torch.zeros(3)
    for step in range(3):
        x = adversarial((48, 80), torch.bfloat16, seed=step) * 4.0**step
        assert_results_bitwise_equal(compiled(x, history), quantize(x, eager_history))
        assert_results_bitwise_equal(history, eager_history)
    assert counter.frame_count == 1
    return [
        node
        for node in counter.graphs[0].graph.nodes
        if node.op == "call_function" and str(node.target).startswith("quant_core.")
    ]


def _every_per_tensor_quantize(x: torch.Tensor, history: torch.Tensor) -> object:
    """Each per-tensor quantize entry point, none given an amax, of a tensor made in the graph."""
    y = x * 4
    current = quant_core.quantize_fp8(y, E4M3, columnwise=True)
    delayed = quant_core.quantize_fp8_delayed(y, history, E5M2, margin=1, columnwise=True)
    rowwise, scale_inv = torch.empty(y.shape, dtype=E4M3), torch.empty(())
    quant_core.quantize_fp8_into(y, E4M3, rowwise_out=rowwise, scale_inv_out=scale_inv)
    columnwise, delayed_scale_inv = torch.empty(y.shape[::-1], dtype=E5M2), torch.empty(())
    quant_core.quantize_fp8_delayed_into(y, history, E5M2, columnwise_out=columnwise, scale_inv_out=delayed_scale_inv)
    amax_out, delayed_amax_out = torch.empty(()), torch.empty(())
    unchecked = quant_core.unchecked.quantize_fp8(y, None, E5M2, True, False, True, amax_out=amax_out)
    unchecked_delayed = quant_core.unchecked.quantize_fp8_delayed(
        y, None, history, E4M3, 0, False, "most_recent", True, True, amax_out=delayed_amax_out
    )
    nvfp4 = quant_core.quantize_nvfp4(y, columnwise=True)
    nvfp4_rowwise_hadamard = quant_core.quantize_nvfp4(y, hadamard_seed=3)  # only the plain amax: rowwise
    into = (rowwise, scale_inv, columnwise, delayed_scale_inv)
    return (
        current,
        delayed,
        into,
        unchecked,
        amax_out,
        unchecked_delayed,
        delayed_amax_out,
        nvfp4,
        nvfp4_rowwise_hadamard,
    )


def test_compiling_is_true_while_a_compile_traces_and_false_in_eager():
    # AOTAutograd traces a tensor subclass's __torch_dispatch__ inside the tracing context Dynamo
    # holds for its compile; torch.compiler.is_compiling() says so there only from torch 2.13 on.
    assert not quant_core.compiling()
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        assert quant_core.compiling()
    assert not quant_core.compiling()
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(quant_core.compiling())
        return x + 1

    traced(torch.zeros(2))
    assert seen == [True]


def test_quantizes_scale_with_an_amax_traced_as_torch_ops_and_equal_eager():
    # [Note: fused FP8 quantize]: under torch.compile every per-tensor quantize hands its operator
    # x's amax, measured by torch ops in the graph (which Inductor fuses into x's producer), not
    # by the `amax` operator or inside the quantize operator; amax_out and the history get it.
    calls = _quant_core_calls_compiled_like_eager(_every_per_tensor_quantize)
    targets = [str(node.target).removesuffix(".default") for node in calls]
    assert targets == [
        *(["quant_core.quantize_fp8", "quant_core.quantize_fp8_delayed"] * 3),
        "quant_core.quantize_nvfp4",
        "quant_core.quantize_nvfp4",
    ]
    for node, target in zip(calls, targets, strict=True):
        amax = node.args[2] if target == "quant_core.quantize_nvfp4" else node.args[1]
        assert isinstance(amax, torch.fx.Node), (target, amax)
        while amax.target in ("float", "reshape"):
            amax = amax.args[0]
        assert (amax.op, amax.target) == ("call_method", "amax"), (target, amax.format_node())


# Inductor generates code for whatever arithmetic is traced around the operators (on CUDA as
# Triton, whose division need not be IEEE): per-tensor FP8 leaves none ([Note: fused FP8
# quantize]), nvfp4_tensor_scale some. A cold Inductor compile costs ~20 s of CPU time, more than
# the 2-core CI can spend on it, so both devices run in the GPU suite (marker `cuda`); the
# aot_eager tests above cover tracing everywhere.
# Importing Inductor touches torch.jit.script_method, deprecated in torch 2.13 (torch's own warning).
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_inductor_scale_arithmetic_equals_eager_and_the_seed_is_not_specialized(device):
    def quantize(x: torch.Tensor, seed: torch.Tensor, history: torch.Tensor) -> object:
        per_tensor = quant_core.quantize_fp8(x, E5M2, rowwise=True, columnwise=True)
        delayed = quant_core.quantize_fp8_delayed(x, history, E4M3, margin=1, columnwise=True)
        return per_tensor, delayed, quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=seed)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(quantize, backend=counter, fullgraph=True)
    # Gaussian values: amaxes that are no power of two, so the scale divisions round.
    x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    history, eager_history = torch.tensor([7.0, 0.3], device=device), torch.tensor([7.0, 0.3], device=device)
    outputs = []
    for seed in (torch.tensor(1), torch.tensor(-(2**63) + 5)):  # the seed's value never recompiles
        seed = seed.to(device)
        got = compiled(x, seed, history)
        assert_results_bitwise_equal(got, quantize(x, seed, eager_history))
        assert_results_bitwise_equal(history, eager_history)
        outputs.append(got[2].rowwise_data)
    assert counter.frame_count == 1
    assert not torch.equal(outputs[0], outputs[1])


# [Note: traced Triton kernels]: on CUDA, Inductor traces every quant-core Triton kernel marked
# traceable into its own code; what it computes is eager's, bit for bit.
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", CASES)
def test_inductor_on_cuda_equals_eager(name):
    x = adversarial((64, 160), torch.bfloat16, seed=len(name)).cuda()
    seed = torch.tensor(2**62 + 1, device="cuda")
    torch._dynamo.reset()
    got = torch.compile(CASES[name], fullgraph=True)(x, seed)
    assert_results_bitwise_equal(got, CASES[name](x, seed))


# Under Inductor, the amax of a per-tensor quantize not given one is computed by the kernel that
# produces x (the traced amax, [Note: fused FP8 quantize]), and the results are eager's bit for bit.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_inductor_fuses_the_amax_into_the_producer_and_equals_eager(device):
    from torch._inductor.utils import run_and_get_code

    def quantize(x: torch.Tensor, history: torch.Tensor) -> object:
        y = torch.where(x > 0, x * 4, x * -0.5)  # one rounding per element, as in eager
        current = quant_core.quantize_fp8(y, E4M3, rowwise=True, columnwise=True)
        delayed = quant_core.quantize_fp8_delayed(y, history, E5M2, margin=1, columnwise=True)
        return current, delayed

    torch._dynamo.reset()
    compiled = torch.compile(quantize, fullgraph=True)
    history, eager_history = torch.zeros(4, device=device), torch.zeros(4, device=device)
    for step in range(3):
        x = adversarial((200, 328), torch.bfloat16, seed=step).to(device) * 4.0**step
        if step == 0:
            got, code = run_and_get_code(compiled, x, history)
            kernels = set(re.findall(r"\b(?:cpp|triton)_\w*fused_\w+", "\n".join(code)))
            assert any("amax" in k and "where" in k for k in kernels), kernels
            assert "quant_core.amax" not in "\n".join(code)
        else:
            got = compiled(x, history)
        assert_results_bitwise_equal(got, quantize(x, eager_history))
        assert_results_bitwise_equal(history, eager_history)


# On CUDA, Inductor launches the per-tensor FP8 Triton kernels
# from its own generated code (no quant_core operator left in it), bit for bit like eager, and
# delayed scaling's history advances in place step after step.
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_launches_the_fp8_triton_kernels_itself_and_equals_eager():
    from torch._inductor.utils import run_and_get_code

    def quantize(x: torch.Tensor, history: torch.Tensor) -> object:
        current = quant_core.quantize_fp8(x, E4M3, rowwise=True, columnwise=True)
        delayed = quant_core.quantize_fp8_delayed(x, history, E5M2, margin=1, columnwise=True)
        given = quant_core.quantize_fp8(x, E5M2, amax=quant_core.amax(x) * 2)
        return current, delayed, given

    compiled = torch.compile(quantize, fullgraph=True)
    history, eager_history = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    for step in range(3):
        # (200, 328): partial tiles in both dims; growing values move the delayed scale.
        x = adversarial((200, 328), torch.bfloat16, seed=step).cuda() * 4.0**step
        got, code = run_and_get_code(compiled, x, history)
        assert_results_bitwise_equal(got, quantize(x, eager_history))
        assert_results_bitwise_equal(history, eager_history)
        if step == 0:
            source = "\n".join(code)
            assert "torch.ops.quant_core" not in source  # no opaque operator call left
            assert "_cast_kernel" in source
            assert "_amax_kernel" in source


# [Note: static launches under torch.compile]: every kernel of every case, Inductor's and
# quant_core's, is launched by torch's C++ launcher. Inductor's strict flag makes a kernel that
# would take Triton's Python launcher fail the compile; a fresh cache directory makes every
# kernel compile (and choose its launcher) in this run.
@pytest.mark.cuda
def test_inductor_launches_every_kernel_statically(tmp_path):
    code = f"""
import sys
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import torch
from test_compile import CASES
from quant_core.testing import adversarial, assert_results_bitwise_equal
x = adversarial((64, 160), torch.bfloat16, seed=0).cuda()
seed = torch.tensor(2**62 + 1, device="cuda")
for name, case in CASES.items():
    torch._dynamo.reset()
    torch.compile(case, fullgraph=True)(x, seed)
torch.cuda.synchronize()
"""
    env = {**os.environ, "TORCHINDUCTOR_STRICT_STATIC_CUDA_LAUNCHER": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    env.pop("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS", None)  # quant_core's default
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
