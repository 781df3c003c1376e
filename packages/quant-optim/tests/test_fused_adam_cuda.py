"""FusedAdam on CUDA tensors (the reference path until a Triton kernel exists) equals the C++
CPU step bit for bit: [Note: Adam numerics] uses only correctly rounded fp32 operations."""

from __future__ import annotations

import pytest
import torch

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]


def tensors_of(p: torch.Tensor) -> list[torch.Tensor | None]:
    """A quantized parameter's buffers (None for a usage it does not hold), else [p]."""
    return list(p.buffers().values()) if isinstance(p, qt.QuantizedTensor) else [p]


def params_on(device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)  # values drawn on the CPU: CUDA's generator differs

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device)

    return [
        torch.nn.Parameter(values(512, 384)),
        torch.nn.Parameter(values(1000).to(torch.bfloat16)),
        *(
            qt.nn.quantized_parameter(values(256, 512), qt.recipe_from_name(r).quantizer("weight"))
            for r in ("fp8", "mxfp8", "fp8-block", "nvfp4")
        ),
    ]


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_step_equals_cpu_step_bitwise(moment_dtype):
    results = {}
    for device in ("cpu", "cuda"):
        params = params_on(device)
        optimizer = FusedAdam(
            params, lr=1e-2, weight_decay=0.1, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype
        )
        for step in range(5):
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(device=device, dtype=p.dtype)
            optimizer.step()
        results[device] = [
            [raw_bits(t.reshape(-1)).cpu() for t in tensors_of(p) if t is not None]
            + [raw_bits(v.reshape(-1)).cpu() for v in optimizer.state[p].values()]
            for p in params
        ]
    for i, (cpu, cuda) in enumerate(zip(results["cpu"], results["cuda"], strict=True)):
        for j, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
            assert torch.equal(a, b), f"parameter {i}, tensor {j}: {(a != b).sum()} of {a.numel()} bytes differ"
