"""On a Hopper GPU: torch._scaled_mm gives the emulated GEMM's result within accumulation tolerance.

Both compute sums of exactly representable products; only the accumulation differs. The
emulation accumulates in fp32; Hopper's FP8 tensor cores keep fewer accumulator bits (about 14,
as DeepSeek-V3's report measured), which shows as ~1e-4 relative difference in fp32 output (measured
1.0e-4 to 1.3e-4 on an H100). The tolerance is 5e-4: a scale, layout or operand mix-up is off by
tens of percent. Run with scripts/gpu-suite.sh.
"""

from __future__ import annotations

import pytest
import torch

import quant_tensors as qt
from quant_tensors.ops import operand_values

pytestmark = pytest.mark.cuda

# Relative L2 difference allowed between the tensor-core result and the fp32 emulation (fp32 out).
TOLERANCE = 5e-4
# The same with fast accumulation (no promotion of the FP8 tensor cores' partial sums).
FAST_TOLERANCE = 5e-3


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _emulated(a, b, a_usage, b_usage) -> torch.Tensor:
    return torch.matmul(operand_values(a, a_usage), operand_values(b, b_usage).t())


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.detach().float(), y.detach().float()
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize(
    ("recipe", "a_role", "b_role", "a_usage", "b_usage"),
    [
        ("fp8", "input", "weight", "rowwise", "rowwise"),  # fprop
        ("fp8", "grad_output", "weight", "rowwise", "columnwise"),  # dgrad (E5M2 x E4M3)
        ("fp8", "grad_output", "input", "columnwise", "columnwise"),  # wgrad
        ("fp8-block", "input", "weight", "rowwise", "rowwise"),  # 1x128 x 128x128
        ("fp8-block", "grad_output", "weight", "rowwise", "columnwise"),  # 1x128 x 128x128 (W^T tiles)
        ("fp8-block", "grad_output", "input", "columnwise", "columnwise"),  # 1x128 x 1x128
    ],
)
def test_hardware_gemm_matches_emulation(recipe, a_role, b_role, a_usage, b_usage):
    if not _hopper():
        pytest.skip("needs a Hopper GPU (sm_90) for these torch._scaled_mm kernels")
    r = qt.recipe_from_name(recipe)
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"input": (512, 1024), "weight": (1024, 1024), "grad_output": (512, 1024)}  # reductions: multiples of 512
    a = r.quantizer(a_role).quantize(torch.randn(*shapes[a_role], device="cuda", generator=g).bfloat16())
    b = r.quantizer(b_role).quantize(torch.randn(*shapes[b_role], device="cuda", generator=g).bfloat16())
    assert qt.ops.scaled_mm_path(a, b, a_usage=a_usage, b_usage=b_usage) == "torch._scaled_mm"
    hardware = qt.ops.scaled_mm(a, b, torch.float32, a_usage=a_usage, b_usage=b_usage)
    emulated = _emulated(a, b, a_usage, b_usage)
    assert hardware.shape == emulated.shape
    assert _relative(hardware, emulated) < TOLERANCE


@pytest.mark.parametrize("tokens", [1, 7, 112])
@pytest.mark.parametrize("b_usage", ["rowwise", "columnwise"])  # the weight in fprop, in dgrad
def test_any_token_count_runs_the_hardware_gemm(tokens, b_usage):
    """torch._scaled_mm takes any number of A's rows: one decoding token, or a ragged batch."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU (sm_90) for these torch._scaled_mm kernels")
    r = qt.recipe_from_name("fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = r.quantizer("input").quantize(torch.randn(tokens, 1024, device="cuda", generator=g).bfloat16())
    b = r.quantizer("weight").quantize(torch.randn(1024, 1024, device="cuda", generator=g).bfloat16())
    assert qt.ops.scaled_mm_path(a, b, b_usage=b_usage) == "torch._scaled_mm"
    for out_dtype in (torch.float32, torch.bfloat16):
        hardware = qt.ops.scaled_mm(a, b, out_dtype, b_usage=b_usage)
        emulated = _emulated(a, b, "rowwise", b_usage)
        assert hardware.shape == (tokens, 1024)
        assert _relative(hardware, emulated) < (TOLERANCE if out_dtype == torch.float32 else 1e-2)
    wgrad_a = r.quantizer("grad_output").quantize(torch.randn(tokens, 1024, device="cuda", generator=g).bfloat16())
    wgrad_b = r.quantizer("input").quantize(torch.randn(tokens, 1024, device="cuda", generator=g).bfloat16())
    wgrad_path = qt.ops.scaled_mm_path(wgrad_a, wgrad_b, a_usage="columnwise", b_usage="columnwise")
    assert wgrad_path == ("torch._scaled_mm" if tokens % 16 == 0 else "emulated")  # tokens are wgrad's K
    wgrad = qt.ops.scaled_mm(wgrad_a, wgrad_b, torch.float32, a_usage="columnwise", b_usage="columnwise")
    assert _relative(wgrad, _emulated(wgrad_a, wgrad_b, "columnwise", "columnwise")) < TOLERANCE


@pytest.mark.parametrize("k", [1024, 8192])
def test_fast_accumulation_stays_within_its_tolerance(k):
    """[Note: fast accumulation]: the unpromoted sum drifts further from the fp32 emulation than the
    promoted one (H100: 0.9e-3 at K = 2048, 2.9e-3 at 14336) but nowhere near a mix-up's tens of percent."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU (sm_90) for these torch._scaled_mm kernels")
    r = qt.Float8CurrentScaling()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = r.quantizer("input").quantize(torch.randn(512, k, device="cuda", generator=g).bfloat16())
    w = r.quantizer("weight").quantize(torch.randn(1024, k, device="cuda", generator=g).bfloat16())
    emulated = _emulated(x, w, "rowwise", "rowwise")
    fast = qt.ops.scaled_mm(x, w, torch.float32, fast_accumulation=True)
    promoted = qt.ops.scaled_mm(x, w, torch.float32)
    assert _relative(promoted, emulated) < TOLERANCE
    assert _relative(fast, emulated) < FAST_TOLERANCE
    assert not torch.equal(fast, promoted)  # the flag reached the GEMM


def test_tiled_operand_with_an_unaligned_reduction_dim_is_emulated():
    # torch 2.11's 1x128 x 128x128 kernel is wrong when the reduction dim has 6 blocks (768): emulate.
    if not _hopper():
        pytest.skip("needs a Hopper GPU (sm_90)")
    r = qt.Float8BlockScaling()
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = r.quantizer("grad_output").quantize(torch.randn(512, 768, device="cuda", generator=g).bfloat16())
    w = r.quantizer("weight").quantize(torch.randn(768, 1024, device="cuda", generator=g).bfloat16())
    assert qt.ops.scaled_mm_path(dy, w, b_usage="columnwise") == "emulated"
    result = qt.ops.scaled_mm(dy, w, torch.float32, b_usage="columnwise")
    assert torch.equal(result, _emulated(dy, w, "rowwise", "columnwise"))


@pytest.mark.parametrize("recipe", ["fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"])
def test_linear_on_cuda_matches_cpu_emulation(recipe):
    torch.manual_seed(0)
    cpu = qt.nn.Linear(1024, 1024, recipe=qt.recipe_from_name(recipe), dtype=torch.bfloat16)
    gpu = qt.nn.Linear(1024, 1024, recipe=qt.recipe_from_name(recipe), dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    dy = torch.randn(512, 1024, generator=torch.Generator().manual_seed(2)).bfloat16()
    x_cpu, x_gpu = x.clone().requires_grad_(True), x.cuda().requires_grad_(True)
    y_cpu, y_gpu = cpu(x_cpu), gpu(x_gpu)
    y_cpu.backward(dy)
    y_gpu.backward(dy.cuda())
    # Same quantized operands (every backend is bit-exact); the GEMMs differ only in accumulation,
    # then round to bf16: a few bf16 ulps at most.
    for got, want in ((y_gpu, y_cpu), (x_gpu.grad, x_cpu.grad), (gpu.weight.grad, cpu.weight.grad)):
        assert _relative(got.cpu(), want) < 1e-2


RECIPES = {
    "mxfp8": qt.MXFP8BlockScaling,
    "nvfp4": qt.NVFP4BlockScaling,
    "nvfp4-rht": lambda: qt.NVFP4BlockScaling(random_hadamard_transform=True),
}


@pytest.mark.parametrize(
    ("recipe", "a_role", "b_role", "a_usage", "b_usage"),
    [
        (recipe, *gemm)
        for recipe in ("mxfp8", "nvfp4")
        for gemm in (
            ("input", "weight", "rowwise", "rowwise"),  # fprop
            ("grad_output", "weight", "rowwise", "columnwise"),  # dgrad
            ("grad_output", "input", "columnwise", "columnwise"),  # wgrad
        )
    ]
    + [("nvfp4-rht", "grad_output", "input", "columnwise", "columnwise")],
)
def test_emulated_bf16_gemm_is_the_fp32_emulation_rounded_once(recipe, a_role, b_role, a_usage, b_usage):
    """The bf16 tensor-core emulation ([Note: exact bf16 operands]) against the fp32 one: each
    element within one bf16 rounding of it, plus what fp32 accumulation order can move (K * 2^-23
    of the sum of |products|). The operands' magnitudes differ by 10^4, so dropping a per-tensor
    factor (NVFP4's 1 / S) or applying one operand's for both is off by orders of magnitude, and a
    dropped bias (~1 against a bound of ~0.1) fails too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = RECIPES[recipe]()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"input": (512, 768), "weight": (384, 768), "grad_output": (512, 384)}
    magnitudes = {"input": 100.0, "weight": 0.01, "grad_output": 0.01}
    a_high, b_high = (
        (torch.randn(*shapes[role], device="cuda", generator=g) * magnitudes[role]).bfloat16()
        for role in (a_role, b_role)
    )
    a = r.quantizer(a_role).quantize(a_high, rowwise=True, columnwise=True)
    b = r.quantizer(b_role).quantize(b_high, rowwise=True, columnwise=True)
    bias = torch.randn(b_high.shape[0], device="cuda", generator=g).bfloat16() if b_usage == "rowwise" else None
    assert qt.ops.scaled_mm_path(a, b, a_usage=a_usage, b_usage=b_usage) == "emulated"
    got = qt.ops.scaled_mm(a, b, torch.bfloat16, a_usage=a_usage, b_usage=b_usage, bias=bias)
    a_values, b_values = operand_values(a, a_usage), operand_values(b, b_usage)
    want = torch.matmul(a_values, b_values.t()) + (0.0 if bias is None else bias.float())
    accumulation = a_values.shape[1] * 2.0**-23 * torch.matmul(a_values.abs(), b_values.abs().t())
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= want.abs() * 2.0**-8 + accumulation).all()
